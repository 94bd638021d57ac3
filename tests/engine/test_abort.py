"""An exception escaping generate() (Ctrl-C included) aborts that call's requests and leaves
the engine usable: no held blocks, no poisoned prefix cache, no leaked processes or memory."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nanovllm import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[2]
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 500 + 1 for j in range(250 + 40 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def llm(tiny_model):
    engine = LLM(tiny_model, num_kvcache_blocks=8)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def expected(llm) -> list[list[int]]:
    return [o["token_ids"] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def fail_on_call(target: object, name: str, n: int, exc: BaseException, monkeypatch,
                 before=None) -> None:
    """Make target.name raise `exc` on its n-th call (after running `before`, if given)."""
    original, calls = getattr(target, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            if before is not None:
                before()
            raise exc
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, wrapper)


def assert_idle_and_empty(llm) -> None:
    bm = llm.scheduler.block_manager
    assert llm.is_finished() and bm.num_free_blocks == len(bm.blocks) and not bm.used_block_ids


@pytest.mark.parametrize("where, n, exc", [
    ("model", 3, KeyboardInterrupt()),      # Ctrl-C during a forward pass
    ("model", 1, RuntimeError("CUDA out of memory")),  # during the first prefill
    ("schedule", 2, KeyboardInterrupt()),   # decode scheduling, at a block boundary
    ("commit", 4, ValueError("boom")),       # reading a step's sampled ids
])
def test_exception_mid_generate_aborts_the_call(llm, expected, monkeypatch, where, n, exc):
    target, name = {"model": (llm, "_launch"),  # the engine's private test hook
                    "schedule": (llm.scheduler.block_manager, "may_append"),
                    "commit": (llm.scheduler, "commit")}[where]
    fail_on_call(target, name, n, exc, monkeypatch)
    with pytest.raises(type(exc)):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert_idle_and_empty(llm)
    monkeypatch.undo()
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == expected


def test_failed_prefill_does_not_poison_the_prefix_cache(llm, expected, monkeypatch):
    # The failed prefill hashed PROMPTS[3]'s full blocks before their K/V was written; make
    # that K/V garbage so a cache hit on them would change the output.
    llm.reset_prefix_cache()
    fail_on_call(llm, "_launch", 1, KeyboardInterrupt(), monkeypatch,
                 before=lambda: llm.model_runner.kv_cache.zero_())
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[3:], PARAMS, use_tqdm=False)
    monkeypatch.undo()
    assert llm.generate(PROMPTS[3:], PARAMS, use_tqdm=False)[0]["token_ids"] == expected[3]


def test_requests_outside_the_call_are_recomputed(llm, expected, monkeypatch):
    other = llm.add_request(PROMPTS[0], PARAMS)  # queued by hand, not by the failing call
    fail_on_call(llm, "_launch", 3, KeyboardInterrupt(), monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[1:], PARAMS, use_tqdm=False)
    monkeypatch.undo()
    assert [seq.seq_id for seq in llm.scheduler.waiting] == [other]
    assert llm.scheduler.waiting[0].block_table == [] and not llm.scheduler.running
    finished = []
    while not llm.is_finished():
        finished += llm.step()[0]
    assert [o["request_id"] for o in finished] == [other]
    assert finished[0]["token_ids"] == expected[0]
    assert_idle_and_empty(llm)


CHILD = """
import sys
from nanovllm import LLM, SamplingParams

llm = LLM(sys.argv[1], num_kvcache_blocks=16)
short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
reference = llm.generate([[1, 2, 3]], short, use_tqdm=False)[0]["token_ids"]
step = llm._step  # what generate() calls each step

def step_and_report():
    result = step()
    llm._step = step  # report once; before the print, which the parent answers with SIGINT
    print("STEPPING", flush=True)
    return result

llm._step = step_and_report
long = SamplingParams(temperature=0, max_tokens=3500, ignore_eos=True)
try:
    llm.generate([[i + 1] * (100 + i) for i in range(8)], long, use_tqdm=False)
    sys.exit("generate finished before the interrupt")
except KeyboardInterrupt:
    print("INTERRUPTED", flush=True)
bm = llm.scheduler.block_manager
assert llm.is_finished() and bm.num_free_blocks == len(bm.blocks), "blocks held after abort"
assert llm.generate([[1, 2, 3]], short, use_tqdm=False)[0]["token_ids"] == reference
print("RECOVERED", flush=True)
llm.shutdown()
"""


def nanovllm_shm() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("nanovllm")}


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_abort_request_releases_penalty_rows(llm):
    """An aborted request's penalty rows (TokenCounts) are freed as a finished one's: five
    aborted streams hold none, and the table does not grow past its first rows."""
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                            repetition_penalty=1.2)
    counts = llm.model_runner.token_counts
    for i in range(5):
        request_id = llm.add_request([1 + i, 2, 3, 4], params)
        for _ in range(3):
            llm.step()
        assert llm.abort_request(request_id)
    while not llm.is_finished():
        llm.step()
    assert counts.slots == {} and counts.output_counts.shape[0] <= 8


def test_sigint_during_generate_then_generate_again(tiny_model):
    shm_before = nanovllm_shm()
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, tiny_model], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in child.stdout:  # wait until the long generate is in flight
            lines.append(line.strip())
            if line.strip() == "STEPPING":
                child.send_signal(signal.SIGINT)
                break
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    lines += out.split()
    assert child.returncode == 0, f"child failed: {lines}\n{err[-3000:]}"
    assert lines[-3:] == ["STEPPING", "INTERRUPTED", "RECOVERED"]
    assert nanovllm_shm() <= shm_before  # nothing new left in shared memory

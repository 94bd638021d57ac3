"""data_parallel_size: the keyword, request placement, and two CPU replicas on a local Ray cluster
(greedy parity with one engine and transformers, a killed replica, Ctrl-C, clean shutdown)."""
import importlib.util
import io
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tqdm import tqdm

from nanovllm import LLM, SamplingParams
from nanovllm.data_parallel.placement import place_requests
from tests.reference import hf_greedy, load_hf

ROOT = Path(__file__).resolve().parents[1]
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason='Ray is not installed (pip install -e ".[ray]")')
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# seeded, so each request's tokens do not depend on its replica or batch mates
RICH = SamplingParams(temperature=0.8, seed=7, n=2, logprobs=2, presence_penalty=0.5,
                      repetition_penalty=1.2, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("bad", [0, -1, "2", True, 1.5, None])
def test_data_parallel_size_is_validated(tiny_model, bad):
    with pytest.raises(ValueError, match=rf"data_parallel_size={bad!r} is invalid"):
        LLM(tiny_model, data_parallel_size=bad)


def test_without_ray_the_error_names_the_extra(tiny_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(ValueError, match=r'data_parallel_size=2 .*pip install -e "\.\[ray\]"'):
        LLM(tiny_model, data_parallel_size=2)


def test_a_bad_backend_name_is_refused_before_ray(tiny_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # Ray is never reached
    with pytest.raises(ValueError, match=r"^attention_backend='bogus' is invalid"):
        LLM(tiny_model, data_parallel_size=2, attention_backend="bogus")


def test_one_replica_is_the_plain_engine_and_never_imports_ray(tiny_model):
    code = ("import sys; from nanovllm import LLM, SamplingParams\n"
            f"llm = LLM({tiny_model!r}, data_parallel_size=1, num_kvcache_blocks=8)\n"
            "assert type(llm) is LLM and llm.scheduler is not None\n"
            "out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True),\n"
            "                   use_tqdm=False)\n"
            "assert len(out[0]['token_ids']) == 2\n"
            "llm.shutdown()\n"
            "assert 'ray' not in sys.modules, 'data_parallel_size=1 imported ray'\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_placement_balances_expected_tokens_and_keeps_input_order():
    rng = random.Random(0)
    prompts = [[0] * rng.randint(1, 200) for _ in range(300)]
    max_tokens = [rng.randint(1, 200) for _ in prompts]
    placed = place_requests(prompts, max_tokens, 3, block_size=256)
    assert sorted(i for part in placed for i in part) == list(range(300))
    assert all(part == sorted(part) for part in placed)
    loads = [sum(len(prompts[i]) + max_tokens[i] for i in part) for part in placed]
    assert max(loads) - min(loads) <= 200 + 200  # within one request


def test_placement_keeps_a_small_shared_prefix_group_on_one_replica():
    block = 256
    prompts = [[5] * block + [i] for i in range(3)] + [[i] * 40 for i in range(1, 200)]
    placed = place_requests(prompts, [8] * len(prompts), 2, block_size=block)
    assert any({0, 1, 2} <= set(part) for part in placed)


def test_placement_cuts_a_group_too_big_for_one_replica():
    block = 256
    prompts = [[5] * block + [i] * (i + 1) for i in range(40)]  # all share the first block
    placed = place_requests(prompts, [8] * 40, 2, block_size=block)
    loads = [sum(len(prompts[i]) + 8 for i in part) for part in placed]
    assert min(loads) > 0 and max(loads) - min(loads) <= sum(loads) / 2 / 4


def test_placement_with_more_replicas_than_requests():
    assert place_requests([[1], [2]], [5, 5], 4, block_size=256) == [[0], [1], [], []]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pids: list[int], timeout: float = 20.0) -> list[int]:
    """The pids still alive after waiting up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(map(_alive, pids)):
        time.sleep(0.2)
    return [pid for pid in pids if _alive(pid)]


def _prompts() -> list[list[int]]:
    """Mixed lengths, with two prompts sharing a first block (small enough to stay together)."""
    rng = random.Random(3)
    shared = [rng.randrange(1, 512) for _ in range(256)]
    return ([[rng.randrange(1, 512) for _ in range(rng.randint(1, 400))] for _ in range(28)]
            + [shared + [rng.randrange(1, 512) for _ in range(n)] for n in (3, 30)])


def _structured_requests() -> tuple[list, list[SamplingParams]] | None:
    """Every structured-output kind (greedy) and the steering fields; None without xgrammar."""
    if importlib.util.find_spec("xgrammar") is None:
        return None
    from tests.engine.test_structured_outputs import FIVE_PROMPTS, KINDS
    params = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=s) for s in KINDS]
    steered = [SamplingParams(temperature=0, max_tokens=8, logit_bias={300: 100}),
               SamplingParams(temperature=0, max_tokens=8, min_tokens=4, bad_words=["fox"],
                              allowed_token_ids=list(range(250, 300)))]
    return FIVE_PROMPTS + FIVE_PROMPTS[:2], params + steered


@pytest.fixture(scope="module")
def reference(tiny_model) -> list[list[int]]:
    hf = load_hf(tiny_model)
    return [hf_greedy(hf, prompt, GREEDY.max_tokens) for prompt in _prompts()]


@needs_ray
@pytest.mark.slow
def test_two_replicas_match_one_engine_and_transformers(tiny_model, reference):
    import ray
    assert not ray.is_initialized()
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    prompts = _prompts()
    single = LLM(tiny_model, num_kvcache_blocks=64)
    expected = single.generate(prompts, GREEDY, use_tqdm=False)
    convs = [[{"role": "user", "content": "hello world"}], [{"role": "user", "content": "fox"}]]
    expected_chat = single.chat(convs, GREEDY, use_tqdm=False)
    expected_rich = single.generate(prompts[:6], RICH, use_tqdm=False)
    structured = _structured_requests()
    expected_structured = single.generate(*structured, use_tqdm=False) if structured else []
    single.shutdown()

    llm = LLM(tiny_model, data_parallel_size=2, num_kvcache_blocks=64)
    pids = [info["pid"] for info in llm.replica_info]
    assert [info["seed"] for info in llm.replica_info] == [0, 1]  # independent draws
    try:
        assert vars(llm.get_default_sampling_params()) == vars(
            single.get_default_sampling_params())
        assert llm.get_tokenizer().encode("hello world") == \
            single.get_tokenizer().encode("hello world")
        llm.reset_stats()
        with pytest.raises(TypeError, match=r"use_tqdm='no'"):  # before any replica works
            llm.generate(prompts, GREEDY, use_tqdm="no")
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.stats()
        chat = llm.chat(convs, GREEDY, use_tqdm=False)
        bars = []
        rich = llm.generate(prompts[:6], RICH, use_tqdm=lambda **kw: bars.append(
            tqdm(**kw, file=io.StringIO())) or bars[-1])
        # grammars compile on the replicas' own engines; steering travels in SamplingParams
        got_structured = llm.generate(*structured, use_tqdm=False) if structured else []
    finally:
        llm.shutdown()
    assert [o["token_ids"] for o in got_structured] == [
        o["token_ids"] for o in expected_structured]
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in expected] == reference
    assert [o["text"] for o in chat] == [o["text"] for o in expected_chat]
    # n, logprobs and the penalties travel to the replicas as they are
    assert len(rich) == 6 and all(len(out["outputs"]) == RICH.n for out in rich)
    assert len(bars) == 1 and bars[0].total == bars[0].n == 6  # the caller's bar counted them
    for out, want in zip(rich, expected_rich):
        assert [c["token_ids"] for c in out["outputs"]] == [c["token_ids"] for c in
                                                            want["outputs"]]
        for got, ref in zip(out["outputs"], want["outputs"]):
            assert [d.keys() for d in got["logprobs"]] == [d.keys() for d in ref["logprobs"]]
            assert all(abs(a - b) < 1e-4 for g, r in zip(got["logprobs"], ref["logprobs"])
                       for a, b in zip(g.values(), r.values()))
    assert all(r["prefill_tokens"] > 0 for r in stats["replicas"])  # both replicas served
    assert stats["prefill_tokens"] == sum(r["prefill_tokens"] for r in stats["replicas"])
    assert stats["prefill_tokens"] + stats["cache_hit_blocks"] * 256 == sum(map(len, prompts))
    assert stats["cache_hit_blocks"] == 1  # the shared first block, computed once
    # This LLM started the local cluster, so shutdown stopped it with all its processes.
    assert not ray.is_initialized()
    assert _wait_gone(pids) == []
    # Other processes on this machine may create segments meanwhile: look for ours only.
    shm_new = (set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()) - shm_before
    assert [name for name in shm_new if "ray" in name or "plasma" in name
            or any(str(pid) in name for pid in pids)] == []


@pytest.fixture
def joined_cluster():
    """A Ray cluster started before the LLM: the LLM joins it and must leave it running."""
    import ray
    ray.init(num_cpus=2, include_dashboard=False)
    yield ray
    ray.shutdown()


def _during_generate(llm, action, delay: float = 1.0) -> None:
    """Run a generate() of 4 x 3000 tokens and `action` after `delay` s; it must end within
    seconds of the action (the generate alone takes far longer on CPU)."""
    timer = threading.Timer(delay, action)
    timer.start()
    t = time.monotonic()
    try:
        llm.generate([[1, 2, 3]] * 4, SamplingParams(temperature=0, max_tokens=3000,
                                                     ignore_eos=True), use_tqdm=False)
    finally:
        timer.cancel()
        assert time.monotonic() - t < delay + 10, "generate() ran on after the action"


@needs_ray
@pytest.mark.slow
def test_killed_replica_and_ctrl_c_stop_every_replica(tiny_model, joined_cluster):
    ray = joined_cluster
    llm = LLM(tiny_model, data_parallel_size=2, num_kvcache_blocks=64)
    pids = [info["pid"] for info in llm.replica_info]
    with pytest.raises(RuntimeError, match=rf"data-parallel replica 1 of 2 \(pid {pids[1]} "):
        _during_generate(llm, lambda: os.kill(pids[1], signal.SIGKILL))
    assert _wait_gone(pids) == []  # the surviving replica was stopped too
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2]], GREEDY, use_tqdm=False)
    assert ray.is_initialized()  # the cluster was not this LLM's to stop

    llm = LLM(tiny_model, data_parallel_size=2, num_kvcache_blocks=64)
    pids = [info["pid"] for info in llm.replica_info]
    with pytest.raises(KeyboardInterrupt):
        _during_generate(llm, lambda: os.kill(os.getpid(), signal.SIGINT))
    assert _wait_gone(pids) == []
    llm.shutdown()  # harmless after the abort

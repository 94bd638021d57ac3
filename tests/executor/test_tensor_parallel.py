"""Tensor parallelism on CPU (gloo): parity with TP=1 and transformers, failures, lifecycles."""
import gc
import glob
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist

from benchmarks.random_checkpoints import build_checkpoint
from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.executor import multiproc as worker
from nanovllm.executor import shm_channel
from nanovllm.executor.rank0_thread import abandoned_call_running
from nanovllm.runner.model_runner import ModelRunner
from tests.reference import hf_greedy, load_hf

NUM_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
# An engine in its own process; argv: checkpoint, prompts (JSON), barrier dir, max_tokens.
ENGINE_SCRIPT = """
import json, os, sys, time
from nanovllm import LLM, SamplingParams
if __name__ == "__main__":
    path, prompts, barrier = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    llm = LLM(path, tensor_parallel_size=2, num_kvcache_blocks=16)
    print(json.dumps({"pid": os.getpid(), "worker_pid": llm.executor.processes[0].pid,
                      "shm": llm.executor.channel.name, "port": llm.executor.store.port}),
          flush=True)
    open(os.path.join(barrier, str(os.getpid())), "w").close()
    deadline = time.monotonic() + 120
    while len(os.listdir(barrier)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # both engines are up before either generates
    params = SamplingParams(temperature=0, max_tokens=int(sys.argv[4]), ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    print(json.dumps({"tokens": [o["token_ids"] for o in outs]}), flush=True)
    if os.environ.get("DIE_AFTER_GENERATE"):
        os.kill(os.getpid(), 9)  # the engine's process dies without shutting down
    llm.shutdown()
"""


def prompts(seed: int = 0) -> list[list[int]]:
    """Mixed lengths; one prompt spans two 256-token blocks."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 512) for _ in range(n)] for n in (5, 300, 37)]


def tokens(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return [o["token_ids"] for o in llm.generate(batch, GREEDY, use_tqdm=False)]


def segment_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def process_gone(pid: int) -> bool:
    """True once `pid` has exited (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def assert_nothing_left(shm_name: str) -> None:
    assert not segment_exists(shm_name)
    assert mp.active_children() == []
    assert not dist.is_initialized()
    assert not abandoned_call_running(wait_s=10)  # a call left on a dead peer has failed too


@pytest.fixture(scope="module")
def bias_model(tmp_path_factory) -> str:
    """q/k/v/o biases: the row-parallel o_proj must add its bias once, not once per rank."""
    return build_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "bias"), seed=7,
                            attention_bias=True)


# ---- configuration errors, before any process starts ---------------------------------------
@pytest.mark.parametrize("tp, name", [(3, "num_attention_heads"), (4, "num_key_value_heads")])
def test_tp_must_divide_heads(tiny_model, tp, name):
    with pytest.raises(ValueError, match=f"tensor_parallel_size={tp} does not divide {name}="):
        LLM(tiny_model, tensor_parallel_size=tp)
    assert mp.active_children() == []  # refused before any worker started


def test_tp_must_divide_intermediate_size_and_vocab(tmp_path):
    odd_mlp = build_checkpoint(str(tmp_path / "mlp"), intermediate_size=100, num_hidden_layers=1,
                               num_attention_heads=8, num_key_value_heads=8, hidden_size=128)
    with pytest.raises(ValueError, match="tensor_parallel_size=8 does not divide "
                                         "intermediate_size=100"):
        Config(odd_mlp, tensor_parallel_size=8)
    odd_vocab = build_checkpoint(str(tmp_path / "vocab"), vocab_size=509, num_hidden_layers=1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide vocab_size=509"):
        Config(odd_vocab, tensor_parallel_size=2)


def test_tp_range_and_visible_gpus(tiny_model, monkeypatch):
    with pytest.raises(ValueError, match="tensor_parallel_size=9 is invalid: expected an int"):
        Config(tiny_model, tensor_parallel_size=9)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 exceeds the 1 visible CUDA"):
        Config(tiny_model, tensor_parallel_size=2, device="cuda")


# ---- parity ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["untied_gqa2_d16", "tied_mha_d32", "bias"])
def test_tp2_greedy_matches_tp1_and_transformers(checkpoints, bias_model, name):
    path = bias_model if name == "bias" else checkpoints[name]
    batch = prompts()
    with_tp1 = LLM(path, num_kvcache_blocks=16)
    expected = tokens(with_tp1, batch)
    with_tp1.shutdown()
    llm = LLM(path, tensor_parallel_size=2, num_kvcache_blocks=16)
    try:
        assert llm.model_runner.model.lm_head.weight.shape[0] == 256  # half of vocab 512
        assert tokens(llm, batch) == expected
        again = tokens(llm, batch)  # the prompts now hit the prefix cache on both ranks
    finally:
        llm.shutdown()
    assert again == expected
    hf = load_hf(path)
    assert expected == [hf_greedy(hf, p, NUM_TOKENS) for p in batch]


# ---- failures -------------------------------------------------------------------------------
# A dead worker is named within worker.DEATH_GRACE_S (5 s) plus clean-up; this bound leaves room
# for a busy machine and is still far below the 300 s collective timeout a hang would wait out.
NOTICED_WITHIN_S = 60

def test_killing_a_worker_between_steps_raises_and_leaks_nothing(tiny_model):
    llm = LLM(tiny_model, tensor_parallel_size=2, num_kvcache_blocks=16)
    shm, victim = llm.executor.channel.name, llm.executor.processes[0]
    assert segment_exists(shm) and mp.active_children() == [victim]
    for prompt in prompts():
        llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
    llm.step()
    llm.step()  # one prefill and one decode: the worker is serving
    os.kill(victim.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker died: rank 1 \(pid \d+\) exit code -9"):
        while True:
            llm.step()
    assert time.monotonic() - start < NOTICED_WITHIN_S
    assert_nothing_left(shm)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.step()
    llm.shutdown()


def test_killing_a_worker_inside_a_step_raises_and_leaks_nothing(tiny_model, monkeypatch):
    llm = LLM(tiny_model, tensor_parallel_size=2, num_kvcache_blocks=16)
    shm, victim = llm.executor.channel.name, llm.executor.processes[0]

    def run_after_killing(runner: ModelRunner, seqs, is_prefill):
        os.kill(victim.pid, signal.SIGKILL)  # rank 0 then waits on a dead peer's collective
        return ModelRunner.run(runner, seqs, is_prefill)

    monkeypatch.setitem(worker.RANK_COMMANDS, "run", run_after_killing)  # rank 0 only
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker died: rank 1"):
        llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert time.monotonic() - start < NOTICED_WITHIN_S
    assert_nothing_left(shm)
    llm.shutdown()


def test_workers_exit_when_the_engine_process_dies(tiny_model, tmp_path):
    open(tmp_path / "no-partner", "w").close()  # the script's barrier waits for two files
    proc = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, tiny_model, "[[1, 2, 3]]",
                           str(tmp_path), "4"], env={**os.environ, "DIE_AFTER_GENERATE": "1"},
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    info = json.loads(proc.stdout.splitlines()[0])
    deadline = time.monotonic() + 10
    while not process_gone(info["worker_pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process_gone(info["worker_pid"])
    # Nobody called shutdown: Python's resource tracker unlinks the segment once both are gone.
    while segment_exists(info["shm"]) and time.monotonic() < deadline + 5:
        time.sleep(0.1)
    assert not segment_exists(info["shm"])


def test_a_failed_start_leaves_nothing_behind(tiny_model, tmp_path):
    # Weights that cannot be read: every rank fails while loading, once the workers are up.
    shutil.copytree(tiny_model, tmp_path / "model")
    (tmp_path / "model" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(Exception):  # noqa: B017  (whatever safetensors raises)
        LLM(str(tmp_path / "model"), tensor_parallel_size=2, num_kvcache_blocks=16)
    assert mp.active_children() == [] and not dist.is_initialized()
    assert glob.glob(f"/dev/shm/nanovllm-{os.getpid()}-*") == []


# ---- lifecycles -----------------------------------------------------------------------------
def test_two_engines_one_after_the_other_in_one_process(tiny_model, monkeypatch):
    batch, names, results = prompts(1), [], []
    for capacity in (1 << 20, 1024):  # the second engine's prefill outgrows its channel
        monkeypatch.setattr(shm_channel, "DEFAULT_CAPACITY", capacity)
        llm = LLM(tiny_model, tensor_parallel_size=2, num_kvcache_blocks=16)
        names.append(llm.executor.channel.name)
        results.append(tokens(llm, batch))
        names.append(llm.executor.channel.name)
        assert (names[-1] != names[-2]) == (capacity == 1024)  # grown: a new, bigger segment
        llm.shutdown()
        assert_nothing_left(names[-1])
    assert results[0] == results[1] and len(set(names)) == 3
    assert not any(segment_exists(name) for name in names)


def test_shutdown_waits_for_the_watchdog(tiny_model, monkeypatch):
    """The watchdog's target holds the executor: shutdown returns once that thread has ended,
    so the engine is freed where its user drops it. Left to a daemon thread at interpreter
    exit, freeing the runner's tensors aborted the process ("terminate called without an
    active exception")."""
    real_wait = worker.wait

    def late_wait(objects, timeout=None):
        ready = real_wait(objects, timeout)
        time.sleep(0.2)  # the watchdog scheduled late, as on a loaded machine
        return ready

    monkeypatch.setattr(worker, "wait", late_wait)
    llm = LLM(tiny_model, tensor_parallel_size=2, num_kvcache_blocks=16)
    executor = weakref.ref(llm.executor)
    llm.shutdown()
    assert not [t for t in threading.enumerate() if t.name == "nanovllm-tp-watchdog"]
    del llm
    gc.collect()
    assert executor() is None


@pytest.mark.slow
def test_two_processes_each_with_a_tp2_engine_at_once(tiny_model, tmp_path):
    batch = prompts(2)
    cmd = [sys.executable, "-c", ENGINE_SCRIPT, tiny_model, json.dumps(batch), str(tmp_path),
           str(NUM_TOKENS)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-2000:]
    infos = [[json.loads(line) for line in out.splitlines()] for out, _ in outputs]
    assert infos[0][0]["shm"] != infos[1][0]["shm"]
    assert infos[0][0]["port"] != infos[1][0]["port"]
    llm = LLM(tiny_model, num_kvcache_blocks=16)
    expected = tokens(llm, batch)
    llm.shutdown()
    assert infos[0][1]["tokens"] == infos[1][1]["tokens"] == expected
    assert not any(segment_exists(info[0]["shm"]) for info in infos)

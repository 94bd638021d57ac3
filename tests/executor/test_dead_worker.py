"""A tensor-parallel worker killed by a signal: rank 0's watchdog notices at once, so the engine
raises within seconds (NCCL alone would wait out its 300 s collective timeout) even when rank 0's
launch, the communicator's abort or a device sync waits forever on the dead peer, and shuts down
leaving no process or shared-memory segment."""
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from nanovllm import LLM, SamplingParams
from nanovllm.executor import multiproc as worker
from nanovllm.executor.rank0_thread import abandoned_call_running
from nanovllm.runner.model_runner import ModelRunner
from nanovllm.runner.sampled_ids import SampledIds
from tests.executor.test_tensor_parallel import (
    assert_nothing_left,
    process_gone,
    prompts,
    segment_exists,
)

GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def wait_until(condition: Callable[[], object], timeout_s: float) -> bool:
    """Poll `condition` until it holds (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class NeverDone:
    """A CUDA event of a step whose collective waits on a dead peer."""

    def query(self) -> bool:
        return False


def test_a_step_waiting_on_a_dead_peer_gives_up_once_told():
    sampled = SampledIds(torch.zeros(3, dtype=torch.int64))
    sampled.ready, give_up = NeverDone(), threading.Event()
    started = time.monotonic()  # before the timer starts: it may fire 0.2 s after its start
    threading.Timer(0.2, give_up.set).start()
    with pytest.raises(RuntimeError, match="step abandoned"):
        sampled.wait(give_up)
    assert 0.2 <= time.monotonic() - started < 2


def test_no_device_sync_after_a_peer_died(monkeypatch):
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    runner = SimpleNamespace(device=torch.device("cuda", 0), peer_died=threading.Event())
    ModelRunner.wait_idle(runner)  # a failed step's clean-up, while every rank is alive
    runner.peer_died.set()
    ModelRunner.wait_idle(runner)  # the failed step's collective may wait on the dead peer
    assert synced == [runner.device]


def test_watchdog_aborts_the_communicator_when_a_worker_dies(tiny_model, monkeypatch):
    aborted = []
    monkeypatch.setattr(worker, "abort_communicator",
                        lambda device: aborted.append((device, time.monotonic())))
    llm = LLM(tiny_model, tensor_parallel_size=2, num_kvcache_blocks=16)
    try:
        shm, victim = llm.executor.channel.name, llm.executor.processes[0]
        llm.generate(prompts(), SamplingParams(max_tokens=2), use_tqdm=False)
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert llm.executor.worker_died.wait(timeout=5)  # set just before the abort
        assert wait_until(lambda: aborted, 2)
        assert aborted[0][0] == "cpu" and aborted[0][1] - killed < 2
        with pytest.raises(worker.WorkerDiedError, match=r"rank 1 \(pid \d+\) exit code -9"):
            llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert_nothing_left(shm)
        assert len(aborted) == 1  # the shutdown after the death does not abort twice
    finally:
        llm.shutdown()


def test_no_abort_on_a_clean_shutdown(tiny_model, monkeypatch):
    aborted = []
    monkeypatch.setattr(worker, "abort_communicator", aborted.append)
    llm = LLM(tiny_model, tensor_parallel_size=2, num_kvcache_blocks=16)
    workers = llm.executor
    llm.shutdown()
    time.sleep(2 * worker.PARENT_POLL_S)  # the watchdog has seen the workers exit by now
    assert not aborted and not workers.worker_died.is_set()


def test_shutdown_after_a_death_never_waits_on_the_group(tiny_model, monkeypatch):
    # Rank 0's abort and its runner's shutdown (a device sync on CUDA) block until released,
    # as NCCL's can when a peer died mid-collective; the spawned worker is not patched.
    release = threading.Event()
    real_shutdown = ModelRunner.shutdown
    monkeypatch.setattr(worker, "abort_communicator", lambda device: release.wait())
    monkeypatch.setattr(ModelRunner, "shutdown",
                        lambda runner: release.wait() and real_shutdown(runner))
    llm = LLM(tiny_model, tensor_parallel_size=2, num_kvcache_blocks=16)
    shm, victim = llm.executor.channel.name, llm.executor.processes[0]
    times = {}

    def generate_then_shut_down() -> None:
        try:
            llm.generate(prompts(), GREEDY, use_tqdm=False)
        except worker.WorkerDiedError:
            times["raised"] = time.monotonic()
        llm.shutdown()
        times["done"] = time.monotonic()

    try:
        llm.generate(prompts(), SamplingParams(max_tokens=2), use_tqdm=False)
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert wait_until(lambda: process_gone(victim.pid), 5)
        caller = threading.Thread(target=generate_then_shut_down, daemon=True)
        caller.start()
        caller.join(worker.RELEASE_TIMEOUT_S + 10)
        assert not caller.is_alive(), "generate or shutdown waited on the stuck abort"
        assert times["raised"] - killed < worker.RELEASE_TIMEOUT_S + 5
        assert times["done"] - times["raised"] < 1
        assert not segment_exists(shm) and mp.active_children() == []
        assert process_gone(victim.pid)
    finally:
        release.set()  # the stuck calls return; the release thread then leaves the group
        assert wait_until(lambda: not dist.is_initialized(), 10)
        llm.shutdown()


def test_a_launch_blocked_on_a_dead_peer_still_raises_within_seconds(tiny_model, monkeypatch):
    # NCCL can block rank 0 inside a launch on a dead peer, and its abort then waits as well.
    release = threading.Event()
    monkeypatch.setattr(worker, "abort_communicator", lambda device: release.wait())
    llm = LLM(tiny_model, tensor_parallel_size=2, num_kvcache_blocks=16)
    shm, victim = llm.executor.channel.name, llm.executor.processes[0]

    def kill_then_block(runner: ModelRunner, seqs, is_prefill) -> None:
        os.kill(victim.pid, signal.SIGKILL)
        release.wait()

    monkeypatch.setitem(worker.RANK_COMMANDS, "run", kill_then_block)  # rank 0 only
    errors = []

    def generate() -> None:
        try:
            llm.generate(prompts(), GREEDY, use_tqdm=False)
        except worker.WorkerDiedError as error:
            errors.append(error)

    try:
        caller = threading.Thread(target=generate, daemon=True)
        caller.start()
        caller.join(worker.RELEASE_TIMEOUT_S + 10)
        assert not caller.is_alive(), "generate waited on rank 0's blocked launch"
        assert errors and "rank 1" in str(errors[0])
        assert not segment_exists(shm) and mp.active_children() == []
    finally:
        release.set()
        assert wait_until(lambda: not dist.is_initialized(), 10)
        assert wait_until(lambda: not abandoned_call_running(), 10)  # later TP engines may start
        llm.shutdown()


# A TP=2 CUDA engine in its own process whose rank 1 is killed at step argv[2]; it prints the
# phases' times as JSON and exits, so the test also sees that the process can exit.
KILL_SCRIPT = """
import json, multiprocessing as mp, os, signal, sys, time
import torch, torch.distributed as dist
from nanovllm import LLM, SamplingParams
from nanovllm.executor import multiproc as worker
from nanovllm.runner.model_runner import ModelRunner
from tests.executor.test_tensor_parallel import process_gone, prompts, segment_exists
if __name__ == "__main__":
    path, kill_at_step = sys.argv[1], int(sys.argv[2])
    llm = LLM(path, tensor_parallel_size=2, num_kvcache_blocks=16, device="cuda")
    shm, victim, calls, killed = llm.executor.channel.name, llm.executor.processes[0], [0], []
    def run_after_killing(runner, seqs, is_prefill):
        calls[0] += 1
        if calls[0] == kill_at_step:
            os.kill(victim.pid, signal.SIGKILL)  # rank 0 then waits on a dead peer's kernel
            killed.append(time.monotonic())
        return ModelRunner.run(runner, seqs, is_prefill)
    worker.RANK_COMMANDS["run"] = run_after_killing  # rank 0 only
    try:
        llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                     use_tqdm=False)
        error = None
    except RuntimeError as e:
        error = f"{type(e).__name__}: {e}"
    raised = time.monotonic()
    llm.shutdown()
    done = time.monotonic()
    gone = process_gone(victim.pid)
    deadline = time.monotonic() + 5
    while dist.is_initialized() and time.monotonic() < deadline:
        time.sleep(0.05)
    print(json.dumps(dict(error=error, kill_to_error_s=raised - killed[0],
                          shutdown_s=done - raised, victim_gone=gone,
                          segment_left=segment_exists(shm), children=len(mp.active_children()),
                          group_left=not dist.is_initialized(), reported_at=time.time())),
          flush=True)
"""


@pytest.mark.gpu
@pytest.mark.parametrize("kill_at_step", [1, 3], ids=["prefill", "graph-decode"])
def test_dead_cuda_worker_raises_within_seconds(tiny_model, kill_at_step):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    print(f"\ntorch {torch.__version__}, NCCL {torch.cuda.nccl.version()}")
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, tiny_model, str(kill_at_step)],
                          capture_output=True, text=True, timeout=150)
    exited = time.time()
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    exit_s = exited - report.pop("reported_at")
    print(f"dead worker at step {kill_at_step}: {report}, report -> exit {exit_s:.2f} s, "
          f"return code {proc.returncode}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["error"].startswith("WorkerDiedError: tensor-parallel worker died: rank 1")
    assert report["kill_to_error_s"] < 15 and report["shutdown_s"] < 5 and exit_s < 10
    assert report["victim_gone"] and not report["segment_left"] and report["children"] == 0

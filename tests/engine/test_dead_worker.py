"""A tensor-parallel worker killed by a signal: rank 0's watchdog notices at once and aborts the
communicator, so the engine raises within seconds (NCCL alone would wait out its 300 s
collective timeout), and shuts down leaving no process or shared-memory segment, even when the
abort or a device sync would wait forever on the dead peer."""
import faulthandler
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from nanovllm import LLM, SamplingParams
from nanovllm.engine import worker
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.sampled_ids import SampledIds
from tests.engine.test_tensor_parallel import (
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


@contextmanager
def hard_bound(seconds: float) -> Iterator[None]:
    """Past `seconds`, print every thread's stack and exit: a hang shows where it waits instead
    of running silently into the suite's time limit."""
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


class NeverDone:
    """A CUDA event of a step whose collective waits on a dead peer."""

    def query(self) -> bool:
        return False


def test_a_step_waiting_on_a_dead_peer_gives_up_once_told():
    sampled = SampledIds(torch.zeros(3, dtype=torch.int64))
    sampled.ready, give_up = NeverDone(), threading.Event()
    threading.Timer(0.2, give_up.set).start()
    started = time.monotonic()
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
        shm, victim = llm.workers.channel.name, llm.workers.processes[0]
        llm.generate(prompts(), SamplingParams(max_tokens=2), use_tqdm=False)
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert llm.workers.worker_died.wait(timeout=5)  # set just before the abort
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
    workers = llm.workers
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
    shm, victim = llm.workers.channel.name, llm.workers.processes[0]
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


@pytest.mark.gpu
@pytest.mark.parametrize("kill_at_step", [1, 3], ids=["prefill", "graph-decode"])
def test_dead_cuda_worker_raises_within_seconds(tiny_model, monkeypatch, kill_at_step):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    print(f"\ntorch {torch.__version__}, NCCL {torch.cuda.nccl.version()}")
    with hard_bound(90):
        llm = LLM(tiny_model, tensor_parallel_size=2, num_kvcache_blocks=16, device="cuda")
    shm, victim = llm.workers.channel.name, llm.workers.processes[0]
    calls, killed = [0], []

    def run_after_killing(runner: ModelRunner, seqs, is_prefill):
        calls[0] += 1
        if calls[0] == kill_at_step:
            os.kill(victim.pid, signal.SIGKILL)  # rank 0 then waits on a dead peer's kernel
            killed.append(time.monotonic())
        return ModelRunner.run(runner, seqs, is_prefill)

    monkeypatch.setitem(worker.WORKER_COMMANDS, "run", run_after_killing)  # rank 0 only
    try:
        with hard_bound(30), pytest.raises(RuntimeError, match="worker died: rank 1"):
            llm.generate(prompts(), GREEDY, use_tqdm=False)
        raised = time.monotonic()
        with hard_bound(30):
            llm.shutdown()
            assert wait_until(lambda: process_gone(victim.pid), 5)
            assert not segment_exists(shm) and mp.active_children() == []
            done = time.monotonic()
            group_left = wait_until(lambda: not dist.is_initialized(), 10)  # the abort ended
            left = time.monotonic()
            freed = wait_until(lambda: not any(t.name == "nanovllm-tp-release"
                                               for t in threading.enumerate()), 5)
        print(f"dead worker at step {kill_at_step}: kill -> error {raised - killed[0]:.2f} s, "
              f"error -> shutdown done {done - raised:.2f} s, error -> group left "
              f"{left - raised:.2f} s{'' if group_left else ' (still there: abort stuck)'}, "
              f"rank 0's GPU state freed: {freed}")
        assert raised - killed[0] < 15 and done - raised < 5 and group_left and freed
    finally:
        with hard_bound(20):
            llm.shutdown()

"""A tensor-parallel worker killed by a signal: rank 0's watchdog notices at once and aborts the
communicator, so the engine raises within seconds (NCCL alone would wait out its 300 s
collective timeout), and shuts down leaving no process or shared-memory segment."""
import os
import signal
import time

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine import worker
from nanovllm.engine.model_runner import ModelRunner
from tests.engine.test_tensor_parallel import assert_nothing_left, process_gone, prompts

GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


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
        assert llm.workers.worker_died.wait(timeout=5)  # set once the abort has returned
        assert aborted and aborted[0][0] == "cpu" and aborted[0][1] - killed < 2
        with pytest.raises(worker.WorkerDiedError, match=r"rank 1 \(pid \d+\) exit code -9"):
            llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert_nothing_left(shm)
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


@pytest.mark.gpu
@pytest.mark.parametrize("kill_at_step", [1, 3], ids=["prefill", "graph-decode"])
def test_dead_cuda_worker_raises_within_seconds(tiny_model, monkeypatch, kill_at_step):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
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
        with pytest.raises(RuntimeError, match="worker died: rank 1"):
            llm.generate(prompts(), GREEDY, use_tqdm=False)
        seconds = time.monotonic() - killed[0]
        print(f"\ndead worker at step {kill_at_step}: rank 0 raised {seconds:.2f} s after the "
              f"kill")
        assert seconds < 30, seconds
        assert_nothing_left(shm)
        assert process_gone(victim.pid)
    finally:
        llm.shutdown()

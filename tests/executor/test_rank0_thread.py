"""Rank0Thread: calls run in order on one daemon thread, errors reach the caller, a caller gives
up on a call that never returns once told that a peer died, and such a call can disturb no
other engine (no new TP engine starts beside it; the forward context is per thread)."""
import _thread
import gc
import multiprocessing as mp
import threading
import time
import weakref

import pytest
import torch

from nanovllm import LLM
from nanovllm.executor.rank0_thread import PeerDiedError, Rank0Thread, abandoned_call_running
from nanovllm.utils.context import Context, forward_context, get_context


def test_calls_return_results_and_raise_errors_in_order():
    rank0, give_up, seen = Rank0Thread(torch.device("cpu")), threading.Event(), []
    try:
        assert rank0.call(give_up, lambda a, b=0: a + b, 2, b=3) == 5
        with pytest.raises(ZeroDivisionError):
            rank0.call(give_up, lambda: 1 / 0)
        for i in range(5):
            rank0.call(give_up, seen.append, i)
        assert seen == [0, 1, 2, 3, 4]
        assert rank0.thread.name == "nanovllm-tp-rank0" and rank0.thread.daemon
    finally:
        rank0.close()
    rank0.thread.join(2)
    assert not rank0.thread.is_alive()


def test_a_call_stuck_forever_is_abandoned_once_a_peer_died():
    rank0, give_up, never = Rank0Thread(torch.device("cpu")), threading.Event(), threading.Event()
    started = time.monotonic()  # before the timer starts: it may fire 0.2 s after its start
    threading.Timer(0.2, give_up.set).start()
    with pytest.raises(PeerDiedError, match="peer died"):
        rank0.call(give_up, never.wait)  # as an NCCL launch blocked on a dead peer
    assert 0.2 <= time.monotonic() - started < 1
    assert rank0.thread.is_alive()  # left behind, as a daemon
    rank0.close()
    never.set()
    rank0.thread.join(2)
    assert not rank0.thread.is_alive()


def test_an_interrupted_caller_waits_for_the_call_to_end():
    # Ctrl-C reaches the caller while rank 0's call runs; cleaning up after it (freeing the
    # runner, leaving the group) must not race the call, so the KeyboardInterrupt waits for it.
    rank0, give_up, ended = Rank0Thread(torch.device("cpu")), threading.Event(), []

    def step() -> None:
        time.sleep(0.5)
        ended.append(time.monotonic())

    threading.Timer(0.1, _thread.interrupt_main).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            rank0.call(give_up, step)
        assert ended  # the call had ended when the interrupt reached the caller
    finally:
        rank0.close()


def test_an_idle_thread_holds_no_command_tensors():
    rank0, give_up = Rank0Thread(torch.device("cpu")), threading.Event()
    try:
        weights = torch.ones(4)
        alive = weakref.ref(weights)
        assert rank0.call(give_up, lambda t: t.sum().item(), weights) == 4
        del weights
        gc.collect()
        assert alive() is None  # e.g. the last batch of update_weights is freed on return
    finally:
        rank0.close()


def test_a_running_abandoned_call_blocks_new_engines_until_it_ends():
    rank0, give_up, release = Rank0Thread(torch.device("cpu")), threading.Event(), threading.Event()
    give_up.set()
    with pytest.raises(PeerDiedError):
        rank0.call(give_up, release.wait)
    assert abandoned_call_running()
    release.set()  # the abandoned call returns
    rank0.close()
    rank0.thread.join(2)
    assert not abandoned_call_running()


def test_waiting_for_an_abandoned_call_returns_once_it_ends():
    rank0, give_up, release = Rank0Thread(torch.device("cpu")), threading.Event(), threading.Event()
    give_up.set()
    with pytest.raises(PeerDiedError):
        rank0.call(give_up, release.wait)
    rank0.close()
    try:
        assert abandoned_call_running(wait_s=0.2)  # still running after the wait
        threading.Timer(0.3, release.set).start()
        started = time.monotonic()
        assert not abandoned_call_running(wait_s=10)
        assert time.monotonic() - started < 2  # returned when the call ended, not at 10 s
    finally:
        release.set()
        rank0.thread.join(2)


def test_a_tp_engine_starts_once_a_recently_abandoned_call_ends(tiny_model):
    # As after a worker died mid-collective: the stuck gloo call fails a moment later.
    rank0, give_up, release = Rank0Thread(torch.device("cpu")), threading.Event(), threading.Event()
    give_up.set()
    with pytest.raises(PeerDiedError):
        rank0.call(give_up, release.wait)
    rank0.close()
    threading.Timer(0.5, release.set).start()
    llm = LLM(tiny_model, tensor_parallel_size=2, num_kvcache_blocks=16)
    try:
        assert not abandoned_call_running()
    finally:
        llm.shutdown()


def test_a_tp_engine_refuses_to_start_beside_an_abandoned_call(tiny_model):
    rank0, give_up, release = Rank0Thread(torch.device("cpu")), threading.Event(), threading.Event()
    give_up.set()
    with pytest.raises(PeerDiedError):
        rank0.call(give_up, release.wait)
    try:
        with pytest.raises(RuntimeError, match="fresh process"):
            LLM(tiny_model, tensor_parallel_size=2, num_kvcache_blocks=16)
        assert mp.active_children() == []  # refused before any worker started
    finally:
        release.set()
        rank0.close()
        rank0.thread.join(2)


def test_the_forward_context_is_per_thread():
    seen = []
    with forward_context(Context(is_prefill=True, max_seqlen_q=7)):
        thread = threading.Thread(target=lambda: seen.append(get_context().max_seqlen_q))
        thread.start()
        thread.join()
        assert get_context().max_seqlen_q == 7
    assert seen == [0]


@pytest.mark.gpu
def test_the_call_runs_on_the_callers_cuda_stream():
    rank0, give_up = Rank0Thread(torch.device("cuda", 0)), threading.Event()
    try:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            assert rank0.call(give_up, torch.cuda.current_stream) == side
        assert rank0.call(give_up, torch.cuda.current_stream) == torch.cuda.current_stream()
    finally:
        rank0.close()

"""Rank0Thread: calls run in order on one daemon thread, errors reach the caller, and a caller
gives up on a call that never returns once told that a peer died."""
import _thread
import threading
import time

import pytest
import torch

from nanovllm.engine.rank0_thread import PeerDiedError, Rank0Thread


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
    threading.Timer(0.2, give_up.set).start()
    started = time.monotonic()
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

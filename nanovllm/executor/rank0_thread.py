"""Rank 0's share of each tensor-parallel command, run in a thread the caller can walk away from.

With NCCL, a launch on a dead peer can block inside the host call itself (the communicator's
abort then waits on the same peer), where no poll of ours can reach. Running rank 0's share here
lets the engine raise WorkerDiedError within seconds; the stuck call stays behind in a daemon
thread, which does not hold up the interpreter's exit.
"""
import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch

GIVE_UP_POLL_S = 0.05  # how soon a caller notices `give_up` while rank 0's call is stuck
# Threads whose caller gave up on a running call; the group then closes them, so one is still
# alive exactly while that call runs (weak: a finished one goes with its worker group).
_abandoned: "weakref.WeakSet[Rank0Thread]" = weakref.WeakSet()


class PeerDiedError(RuntimeError):
    """Rank 0's call was abandoned because a peer died while it ran."""


class Rank0Thread:
    """One daemon thread that runs calls in order; `call` waits for each, or gives up."""

    def __init__(self, device: torch.device):
        self.device = device
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="nanovllm-tp-rank0", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while (item := self.calls.get()) is not None:
            fn, args, kwargs, stream, future = item
            del item  # an idle thread holds no command's tensors
            try:
                # The caller's CUDA stream (and so device): the call orders its work as if it
                # ran on the caller's thread, e.g. after weights made on a side stream.
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    future.set_result(fn(*args, **kwargs))
            except BaseException as error:
                future.set_exception(error)
            del fn, args, kwargs, future

    def call(self, give_up: threading.Event, fn: Callable, *args, **kwargs) -> object:
        """fn(*args, **kwargs) on this thread; raises PeerDiedError once `give_up` is set."""
        future: Future = Future()
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self.calls.put((fn, args, kwargs, stream, future))
        try:
            return _wait(future, give_up)
        except PeerDiedError:
            _abandoned.add(self)
            raise
        except BaseException:
            if not future.done():
                # A Ctrl-C (or SystemExit from a signal handler) leaves the call running: let
                # it end (or its peer die) before the caller cleans up after it, as when the
                # call ran on the caller's thread. A second Ctrl-C stops the wait.
                with contextlib.suppress(BaseException):
                    _wait(future, give_up)
            raise

    def close(self) -> None:
        """Let the thread end after its current call (if that call ever returns)."""
        self.calls.put(None)


def abandoned_call_running(wait_s: float = 0.0) -> bool:
    """Whether a call some caller gave up on still runs after up to `wait_s` seconds."""
    # Its collectives would reach any new process group: no TP engine may start until it ends.
    deadline = time.monotonic() + wait_s
    while any(t.thread.is_alive() for t in list(_abandoned)):
        if time.monotonic() >= deadline:
            return True
        time.sleep(GIVE_UP_POLL_S)
    return False


def _wait(future: Future, give_up: threading.Event) -> object:
    """The call's result (or its error), or PeerDiedError once `give_up` is set."""
    while True:
        try:
            return future.result(timeout=GIVE_UP_POLL_S)
        except FutureTimeout:
            if give_up.is_set():
                raise PeerDiedError("step abandoned: a tensor-parallel peer died during it") \
                    from None

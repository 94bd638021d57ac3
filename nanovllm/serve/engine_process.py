"""EngineProcess: the engine loop in a process of its own, so the engine's host work and the
caller's (an HTTP server streaming hundreds of responses) do not share one GIL."""
import asyncio
import dataclasses
import itertools
import logging
import multiprocessing as mp
import pickle
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.util import Finalize

from nanovllm.engine.request_checks import RequestLimits
from nanovllm.lora.request import LoRARequest
from nanovllm.sampling_params import SamplingParams
from nanovllm.serve.engine_loop import EngineLoop, EngineStats, Publish, Update, run_callback

logger = logging.getLogger(__name__)
_STOP_TIMEOUT_S = 60  # a clean stop frees the model, the KV pool and any tensor-parallel workers


class EngineProcess:
    """An EngineLoop over LLMEngine(model, **kwargs) in a spawned process; EngineThread's
    interface. Updates come back over a pipe that the caller's event loop reads (`attach`): a
    reader thread would wait for the GIL while the loop is busy, and the engine would block."""

    def __init__(self, model: str, kwargs: dict, publish: Publish):
        self.publish = publish
        ctx = mp.get_context("spawn")  # a clean interpreter: no CUDA or threads inherited
        self._updates, updates_out = ctx.Pipe(duplex=False)
        commands_in, self._commands = ctx.Pipe(duplex=False)
        # Not a daemon: the engine starts tensor-parallel workers of its own.
        self._process = ctx.Process(target=_engine_main, name="nanovllm-engine",
                                    args=(model, kwargs, commands_in, updates_out))
        self._process.start()
        commands_in.close()
        updates_out.close()
        # At interpreter exit, before multiprocessing joins its children: close our end of
        # the command pipe, which stops the engine (a script that never called shutdown).
        self._finalizer = Finalize(self, self._commands.close, exitpriority=10)
        self._open: set[int] = set()  # handles added and not yet finished, failed or aborted
        self._acks: dict[int, Callable[[], None]] = {}
        self._next_ack = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        try:
            self.limits = self._wait_until_ready()
        except BaseException:  # a start-up error, or Ctrl-C while the model loads (the engine
            self._kill(_STOP_TIMEOUT_S)  # then stops once loaded: its command pipe is closed)
            raise

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read updates in `loop` from now on (the loop that calls add and abort)."""
        if self._loop is not loop and not self._closed:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._updates.fileno())
            loop.add_reader(self._updates.fileno(), self._drain)
            self._loop = loop

    def add(self, handle: int, token_ids: list[int], params: SamplingParams,
            lora_request: LoRARequest | None = None) -> None:
        if self._closed:
            self.publish([Update(handle, [], error="the engine process exited")], EngineStats())
            return
        self._open.add(handle)
        self._send(("add", handle, token_ids, params, lora_request))

    def abort(self, handle: int, done: Callable[[], None] | None = None) -> None:
        """Abort a request; `done` is called (in the attached loop) once its blocks are free."""
        if self._closed:
            run_callback(done)
            return
        ack = next(self._next_ack)
        if done is not None:
            self._acks[ack] = done
        self._send(("abort", handle, ack))

    def is_alive(self) -> bool:
        return not self._closed and self._process.is_alive()

    def shutdown(self) -> None:
        """Fail the requests still running, stop the process and wait for it; idempotent."""
        # From the attached loop's thread, or once that loop has ended.
        if self._process.is_alive():
            self._send(("stop",))
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        # Drain until EOF: its last updates must not block it. EOF comes when _engine_main
        # returns, before the process has exited (the interpreter is still tearing down), and
        # poll() returns at once from then on; so the deadline is a time, not a poll count.
        while not self._closed and self._process.is_alive():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self._updates.poll(min(left, 0.05)):
                self._drain()
        self._kill(timeout=max(deadline - time.monotonic(), 0))
        self._drain()  # what is left, then EOF: the open requests fail

    def _send(self, command: tuple) -> None:
        try:
            self._commands.send(command)
        except OSError:  # the process is gone; reading its pipe's EOF fails the open requests
            pass

    def _wait_until_ready(self) -> RequestLimits:
        """The engine's request limits once it is built; its start-up error, raised here."""
        try:
            kind, payload = self._updates.recv()
        except EOFError:
            self._process.join()
            kind, payload = "error", RuntimeError("the engine process exited while starting "
                                                  f"(exit code {self._process.exitcode})")
        if kind == "error":
            raise payload
        return payload

    def _drain(self) -> None:
        """Hand every message waiting in the pipe to `publish`; at EOF, fail what is open."""
        if self._closed:
            return
        try:
            while self._updates.poll(0):
                kind, *payload = self._updates.recv()
                if kind == "ack":
                    run_callback(self._acks.pop(payload[0], None))
                else:
                    self._publish(*payload)
        except (EOFError, OSError):
            self._close()

    def _publish(self, rows: list[tuple], stats: tuple) -> None:
        updates = [Update(*row) for row in rows]
        for update in updates:
            if update.final is not None or update.error is not None:
                self._open.discard(update.handle)
        self.publish(updates, EngineStats(*stats))

    def _close(self) -> None:
        """The process has ended: stop reading, fail the open requests and pending aborts."""
        self._closed = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._updates.fileno())
        lost = [Update(handle, [], error="the engine process exited") for handle in self._open]
        self._open.clear()
        self.publish(lost, EngineStats())
        acks, self._acks = self._acks, {}
        for done in acks.values():
            run_callback(done)

    def _kill(self, timeout: float) -> None:
        """Close the command pipe (a live engine then stops), wait `timeout` s, then kill."""
        self._finalizer()
        self._process.join(timeout)
        if self._process.is_alive():
            logger.error("the engine process did not stop in time: killing it")
            self._process.kill()
            self._process.join()


def _engine_main(model: str, kwargs: dict, commands: Connection, updates: Connection) -> None:
    """The engine process: build the engine, report ready (or why not), run the loop."""
    # Signals sent to the whole process group (Ctrl-C, a service manager's SIGTERM) are the
    # server's to handle: it drains its streams, then stops the engine through the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from nanovllm.engine.llm_engine import LLMEngine
    try:
        engine = LLMEngine(model, **kwargs)
    except Exception as e:
        logger.exception("the engine failed to start")
        updates.send(("error", _portable(e)))
        return
    updates.send(("ready", engine.request_limits()))

    def next_command(block: bool) -> tuple | None:
        try:
            return commands.recv() if commands.poll(None if block else 0) else None
        except EOFError:  # the parent is gone
            return ("stop",)

    def publish(batch: list[Update], stats: EngineStats) -> None:
        # Plain tuples: a quarter of the pickled bytes and a tenth of the time of dataclasses.
        updates.send(("step", [tuple(vars(u).values()) for u in batch],
                      dataclasses.astuple(stats)))

    loop = EngineLoop(engine, next_command, publish,
                      acknowledge=lambda ack: updates.send(("ack", ack)))
    try:
        loop.run()
    except OSError:  # the parent closed its end while we published
        pass
    finally:
        engine.shutdown()


def _portable(error: Exception) -> Exception:
    """`error` if it survives a pickle round trip, else a RuntimeError with its message."""
    try:
        return pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")

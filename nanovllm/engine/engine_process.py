"""EngineProcess: the engine loop in a process of its own, so the engine's host work and the
caller's (an HTTP server streaming hundreds of responses) do not share one GIL."""
import itertools
import logging
import multiprocessing as mp
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from nanovllm.engine.engine_loop import EngineLoop, EngineStats, Publish, Update
from nanovllm.engine.validation import RequestLimits
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_STOP_TIMEOUT_S = 60  # a clean stop frees the model, the KV pool and any tensor-parallel workers


class EngineProcess:
    """Spawns a process that builds LLMEngine(model, **kwargs) and runs an EngineLoop over it.
    Commands go to it over one pipe; its updates come back over another, and a reader thread
    hands them to `publish`. The same interface as EngineThread."""

    def __init__(self, model: str, kwargs: dict, publish: Publish):
        self.publish = publish
        ctx = mp.get_context("spawn")  # a clean interpreter: no CUDA or threads inherited
        updates_in, updates_out = ctx.Pipe(duplex=False)
        commands_in, self._commands = ctx.Pipe(duplex=False)
        # Not a daemon: the engine starts tensor-parallel workers of its own.
        self._process = ctx.Process(target=_engine_main, name="nanovllm-engine",
                                    args=(model, kwargs, commands_in, updates_out))
        self._process.start()
        commands_in.close()
        updates_out.close()
        self._updates = updates_in
        self._send_lock = threading.Lock()
        self._open: set[int] = set()  # handles added and not yet finished, failed or aborted
        self._acks: dict[int, Callable[[], None]] = {}
        self._next_ack = itertools.count()
        self.limits = self._wait_until_ready()
        self._reader = threading.Thread(target=self._read, name="nanovllm-engine-reader",
                                        daemon=True)
        self._reader.start()

    def add(self, handle: int, token_ids: list[int], params: SamplingParams) -> None:
        self._open.add(handle)
        self._send(("add", handle, token_ids, params))

    def abort(self, handle: int, done: Callable[[], None] | None = None) -> None:
        """Abort a request before the next step; `done` is called (in the reader thread)
        after its blocks are freed."""
        ack = next(self._next_ack)
        if done is not None:
            self._acks[ack] = done
        self._send(("abort", handle, ack))

    def is_alive(self) -> bool:
        return self._process.is_alive() and self._reader.is_alive()

    def shutdown(self) -> None:
        """Fail the requests still running, stop the process and wait for it; idempotent."""
        if self._process.is_alive():
            self._send(("stop",))
            self._process.join(_STOP_TIMEOUT_S)
        if self._process.is_alive():
            logger.error("the engine process did not stop in %d s: killing it", _STOP_TIMEOUT_S)
            self._process.kill()
            self._process.join()
        self._reader.join()

    def _send(self, command: tuple) -> None:
        try:
            with self._send_lock:
                self._commands.send(command)
        except OSError:  # the process is gone; the reader fails the open requests
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
            self._process.join()
            raise payload
        return payload

    def _read(self) -> None:
        """Hand each step's updates to `publish` until the process ends; then fail what is open."""
        try:
            while True:
                kind, *payload = self._updates.recv()
                if kind == "ack":
                    done = self._acks.pop(payload[0], None)
                    if done is not None:
                        done()
                    continue
                updates, stats = payload
                for update in updates:
                    if update.final is not None or update.error is not None:
                        self._open.discard(update.handle)
                self.publish(updates, stats)
        except (EOFError, OSError):
            pass
        lost = [Update(h, [], error="the engine process exited") for h in list(self._open)]
        self._open.clear()
        self.publish(lost, EngineStats())
        for done in self._acks.values():
            done()


def _engine_main(model: str, kwargs: dict, commands: Connection, updates: Connection) -> None:
    """The engine process: build the engine, report ready (or why not), run the loop."""
    # Ctrl-C reaches the whole process group; the parent decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from nanovllm.engine.llm_engine import LLMEngine
    try:
        engine = LLMEngine(model, **kwargs)
    except Exception as e:
        try:
            updates.send(("error", e))
        except Exception:  # not picklable: its message then
            updates.send(("error", RuntimeError(f"{type(e).__name__}: {e}")))
        return
    updates.send(("ready", engine.request_limits()))

    def next_command(block: bool) -> tuple | None:
        try:
            return commands.recv() if commands.poll(None if block else 0) else None
        except EOFError:  # the parent is gone
            return ("stop",)

    loop = EngineLoop(engine, next_command,
                      publish=lambda batch, stats: updates.send(("step", batch, stats)),
                      acknowledge=lambda ack: updates.send(("ack", ack)))
    try:
        loop.run()
    except OSError:  # the parent closed its end while we published
        pass
    finally:
        engine.shutdown()

"""The engine loop behind AsyncLLM: steps one engine, taking commands between steps."""
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.lora.request import LoRARequest
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class Update:
    """What one request gained in one step; `final` is its output dict once it is finished."""

    handle: int
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None  # one per new token, when asked
    final: dict | None = None
    error: str | None = None


@dataclass
class EngineStats:
    """A snapshot of the scheduler after a step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use


Publish = Callable[[list[Update], EngineStats], None]
# ("add", handle, token_ids, params) | ("abort", handle, ack) | ("stop",); None: no command
NextCommand = Callable[[bool], tuple | None]


class EngineLoop:
    """Owns an LLMEngine: applies add/abort commands (requests named by the caller's handles)
    between steps, and publishes each step's updates; `acknowledge(ack)` ends an abort."""

    def __init__(self, engine: LLMEngine, next_command: NextCommand, publish: Publish,
                 acknowledge: Callable[[object], None]):
        self.engine = engine
        self.next_command = next_command
        self.publish = publish
        self.acknowledge = acknowledge
        self._request_ids: dict[int, int] = {}  # handle -> engine request id
        self._handles: dict[int, int] = {}  # engine request id -> handle
        self._num_read: dict[int, int] = {}  # engine request id -> completion tokens published

    def run(self) -> None:
        """Step until told to stop; then fail the requests still open."""
        while self._handle_commands(block=self.engine.is_finished()):
            if self.engine.is_finished():
                continue
            try:
                outputs, _ = self.engine.step()
            except Exception as e:  # the engine recovers; the requests in the batch fail
                logger.exception("engine step failed")
                self.publish(self._fail_all(f"engine step failed: {e!r}"), self._stats())
                continue
            self.publish(self._updates(outputs), self._stats())
        self.publish(self._fail_all("the engine is shutting down"), self._stats())

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when idle); False once told to stop."""
        updates, acks = [], []
        try:
            command = self.next_command(block)
            while command is not None:
                if command[0] == "stop":
                    return False
                if command[0] == "add":
                    updates += self._add(*command[1:])
                else:
                    updates += self._abort(command[1])
                    acks.append(command[2])
                command = self.next_command(False)
        finally:
            if updates:
                self.publish(updates, self._stats())
            for ack in acks:  # after the abort's update: its stream ends before abort() returns
                self.acknowledge(ack)
        return True

    def _add(self, handle: int, token_ids: list[int], params: SamplingParams,
             lora_request: LoRARequest | None = None) -> list[Update]:
        try:
            request_id = self.engine.add_request(token_ids, params, lora_request)
        except ValueError as e:  # validated by the caller already; the engine has the last word
            return [Update(handle, [], error=str(e))]
        self._request_ids[handle], self._handles[request_id] = request_id, handle
        self._num_read[request_id] = 0
        return []

    def _abort(self, handle: int) -> list[Update]:
        request_id = self._request_ids.pop(handle, None)
        if request_id is None:  # finished or failed already
            return []
        del self._handles[request_id], self._num_read[request_id]
        self.engine.abort_request(request_id)
        return [Update(handle, [], final={"finish_reason": "abort", "text": None})]

    def _updates(self, outputs: list[dict]) -> list[Update]:
        """Finished requests with their last tokens, then the new tokens of running ones."""
        updates = []
        for out in outputs:
            request_id = out["request_id"]
            handle = self._handles.pop(request_id)
            del self._request_ids[handle]
            start = self._num_read.pop(request_id)
            logprobs = out["logprobs"]
            updates.append(Update(handle, out["token_ids"][start:],
                                  None if logprobs is None else logprobs[start:], final=out))
        for request_id, (token_ids, logprobs) in self.engine.new_tokens(self._num_read).items():
            self._num_read[request_id] += len(token_ids)
            updates.append(Update(self._handles[request_id], token_ids, logprobs))
        return updates

    def _fail_all(self, error: str) -> list[Update]:
        """Abort every request and tell its caller why."""
        for request_id in self._handles:
            self.engine.abort_request(request_id)
        updates = [Update(handle, [], error=error) for handle in self._request_ids]
        self._request_ids.clear()
        self._handles.clear()
        self._num_read.clear()
        return updates

    def _stats(self) -> EngineStats:
        scheduler = self.engine.scheduler
        blocks = scheduler.block_manager
        return EngineStats(len(scheduler.running), len(scheduler.waiting),
                           len(blocks.used_block_ids) / len(blocks.blocks))


class EngineThread:
    """An EngineLoop in a daemon thread of this process (sharing the caller's GIL)."""

    def __init__(self, engine: LLMEngine, publish: Publish):
        self.limits = engine.request_limits()
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        loop = EngineLoop(engine, self._next_command, publish, run_callback)
        self._thread = threading.Thread(target=loop.run, name="nanovllm-engine", daemon=True)
        self._thread.start()

    def add(self, handle: int, token_ids: list[int], params: SamplingParams,
            lora_request: LoRARequest | None = None) -> None:
        self._commands.put(("add", handle, token_ids, params, lora_request))

    def abort(self, handle: int, done: Callable[[], None] | None = None) -> None:
        """Abort a request; `done` is called (in the engine thread) once its blocks are free."""
        self._commands.put(("abort", handle, done))

    def attach(self, loop) -> None:
        """Nothing to do: updates reach the caller through `publish`, from the engine thread."""

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> None:
        """Fail the requests still running, stop the loop and wait for it; safe to call twice."""
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join()

    def _next_command(self, block: bool) -> tuple | None:
        try:
            return self._commands.get(block=block)
        except queue.Empty:
            return None


def run_callback(done: Callable[[], None] | None) -> None:
    """Run an abort's callback; one that fails (its event loop has closed) is only logged."""
    if done is None:
        return
    try:
        done()
    except Exception:
        logger.exception("an abort callback failed")

"""The engine loop's ordering, and the engine in a process of its own: start-up errors, death,
and an interpreter that exits without shutting it down."""
import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from nanovllm import SamplingParams
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.serve.async_llm import AsyncLLM
from nanovllm.serve.engine_loop import EngineLoop

LONG = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)


def test_an_abort_is_acknowledged_after_its_final_update(tiny_model):
    """The caller learns the blocks are free only once the stream's last update is out, so
    `await llm.abort(...)` returns after the stream has ended."""
    engine = LLMEngine(tiny_model, device="cpu", num_kvcache_blocks=16)
    commands = [("add", 7, [1, 2, 3], LONG), None, ("abort", 7, "ack-7"), ("stop",)]
    events = []

    def next_command(block: bool):
        return commands.pop(0)

    def publish(updates, stats):
        events.extend(("final", u.handle, u.final["finish_reason"]) for u in updates if u.final)
        events.append(("stats", stats.num_running, stats.kv_cache_usage))

    try:
        EngineLoop(engine, next_command, publish, lambda ack: events.append(("ack", ack))).run()
    finally:
        engine.shutdown()
    final = events.index(("final", 7, "abort"))
    assert events[final + 1] == ("stats", 0, 0.0) and events[final + 2] == ("ack", "ack-7")


def children() -> set:
    return set(multiprocessing.active_children())


def test_a_bad_keyword_fails_before_the_engine_process_starts(tiny_model):
    before = children()
    with pytest.raises(ValueError, match="unknown argument.*num_kv_blocks"):
        AsyncLLM(tiny_model, device="cpu", num_kv_blocks=16)
    assert children() == before


def test_a_start_up_error_of_the_engine_is_raised_by_the_constructor(tiny_model, tmp_path):
    """An error only the engine finds (weights that do not load) reaches the caller."""
    shutil.copytree(tiny_model, tmp_path / "ckpt")
    (weights,) = (tmp_path / "ckpt").glob("*.safetensors")
    weights.write_bytes(b"\x10" + b"\x00" * 7 + b"{not a header")
    before = children()
    with pytest.raises(Exception, match="deserializing header"):
        AsyncLLM(str(tmp_path / "ckpt"), device="cpu", num_kvcache_blocks=16)
    assert children() == before


def test_a_dead_engine_process_fails_open_and_later_requests(tiny_model):
    """A killed engine process ends every open stream with an error, stops the engine, and a
    request or an abort after that fails at once instead of waiting forever."""
    before = children()
    llm = AsyncLLM(tiny_model, device="cpu", num_kvcache_blocks=16)

    async def run():
        stream = llm.generate([1, 2, 3], LONG, "long")
        await anext(stream)
        (process,) = children() - before
        os.kill(process.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="the engine process exited"):
            async for _ in stream:
                pass
        assert not llm.is_running
        with pytest.raises(RuntimeError, match="the engine is not running"):
            await asyncio.wait_for(anext(llm.generate([1, 2], LONG, "after")), 5)
        await asyncio.wait_for(llm.abort("long"), 5)

    asyncio.run(run())
    llm.shutdown()
    assert children() == before


def test_a_script_that_never_shuts_down_exits(tiny_model, tmp_path):
    """Interpreter exit stops the engine process (a user script without shutdown())."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio
        from nanovllm import SamplingParams
        from nanovllm.serve.async_llm import AsyncLLM

        async def main(llm):
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            async for out in llm.generate([1, 2, 3], params, "r"):
                pass
            print("done", out.finish_reason, flush=True)

        if __name__ == "__main__":
            llm = AsyncLLM({tiny_model!r}, device="cpu", num_kvcache_blocks=16)
            asyncio.run(main(llm))
    """))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done length" in proc.stdout and time.monotonic() - start < 60


def test_shutdown_joins_a_cleanly_exiting_engine(tiny_model, caplog):
    """shutdown() waits for the engine process to exit by itself: its update pipe reaches EOF
    while the process is still tearing down (the loop returned, the interpreter is exiting),
    and that is no reason to kill it. It used to be killed (exit code -9) every time."""
    before = children()
    llm = AsyncLLM(tiny_model, device="cpu", num_kvcache_blocks=16)
    (process,) = children() - before

    async def run():
        # ignore_eos: a sampled EOS would end the request early ("stop"), now and then
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        outputs = [out async for out in llm.generate([1, 2, 3], params, "r")]
        assert outputs[-1].finish_reason == "length"

    asyncio.run(run())
    with caplog.at_level(logging.WARNING, logger="nanovllm.serve.engine_process"):
        llm.shutdown()
    assert process.exitcode == 0
    assert "did not stop in time" not in caplog.text
    assert not llm.is_running and children() == before
    llm.shutdown()  # idempotent

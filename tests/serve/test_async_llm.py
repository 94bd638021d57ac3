"""AsyncLLM with its engine in a thread and in a process: streaming, abort, failures."""
import asyncio
import multiprocessing

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.serve.async_llm import AsyncLLM

GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module", params=["thread", "process"])
def llm(tiny_model, request):
    before = set(multiprocessing.active_children())
    engine = AsyncLLM(tiny_model, engine_process=request.param == "process", device="cpu",
                      num_kvcache_blocks=16)
    yield engine
    engine.shutdown()
    assert not engine.is_running and set(multiprocessing.active_children()) == before


def assert_idle(llm: AsyncLLM) -> None:
    """Nothing runs and every KV block is free, from the engine itself where it is in this
    process, else from the last stats it published."""
    if llm.engine is not None:
        blocks = llm.engine.scheduler.block_manager
        assert blocks.num_free_blocks == len(blocks.blocks)
    stats = llm.stats
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0), stats


async def collect(llm: AsyncLLM, prompt, params, request_id: str) -> tuple[str, list[int], str]:
    text, token_ids = "", []
    async for out in llm.generate(prompt, params, request_id):
        text += out.new_text
        token_ids += out.new_token_ids
    return text, token_ids, out.finish_reason


def test_concurrent_streams_equal_offline(llm, tiny_model):
    prompts = [[i + 1] * (3 + i) for i in range(4)]
    offline = LLM(tiny_model, device="cpu", num_kvcache_blocks=16)
    expected = [offline.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    offline.shutdown()

    async def run():
        return await asyncio.gather(*(collect(llm, p, GREEDY, f"r{i}")
                                      for i, p in enumerate(prompts)))

    for (text, token_ids, reason), out in zip(asyncio.run(run()), expected):
        assert (text, token_ids, reason) == (out["text"], out["token_ids"], out["finish_reason"])


def test_new_logprobs_concatenate_to_the_offline_logprobs(llm, tiny_model):
    """Every output carries its new tokens' logprob dicts, the final one included; None for a
    request that did not ask."""
    prompt = [7, 8, 9, 10]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=32, ignore_eos=True, logprobs=2)
    offline = LLM(tiny_model, device="cpu", num_kvcache_blocks=16)
    expected = offline.generate(prompt, params, use_tqdm=False)[0]
    offline.shutdown()

    async def run():
        asked = [out async for out in llm.generate(prompt, params, "logprobs")]
        plain = [out async for out in llm.generate(prompt, GREEDY, "plain")]
        return asked, plain

    asked, plain = asyncio.run(run())
    assert len(asked) > 1  # running requests' outputs, not only the final one
    token_ids, logprobs = [], []
    for out in asked:
        assert len(out.new_logprobs) == len(out.new_token_ids)
        token_ids += out.new_token_ids
        logprobs += out.new_logprobs
    assert token_ids == expected["token_ids"] and len(logprobs) == 32
    for got, want in zip(logprobs, expected["logprobs"]):
        assert got.keys() == want.keys()
        assert got == pytest.approx(want, abs=1e-5)
    assert all(out.new_logprobs is None for out in plain)


@pytest.mark.parametrize("skip", [True, False])
def test_a_stream_skips_special_tokens_as_offline_does(llm, tiny_model, skip):
    """The tiny checkpoint's greedy answer to [7, 8, 9] holds an EOS (ignored here, so that
    its text counts): streamed, its text is the offline text, with or without the EOS's."""
    params = SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=skip,
                            ignore_eos=True)
    offline = LLM(tiny_model, device="cpu", num_kvcache_blocks=16)
    expected = offline.generate([7, 8, 9], params, use_tqdm=False)[0]
    offline.shutdown()
    assert (offline.tokenizer.eos_token in expected["text"]) is not skip
    text, token_ids, reason = asyncio.run(collect(llm, [7, 8, 9], params, f"eos-{skip}"))
    assert (text, token_ids, reason) == (expected["text"], expected["token_ids"], "length")


def test_a_stream_without_detokenize_has_no_text(llm):
    params = SamplingParams(temperature=0, max_tokens=16, detokenize=False)
    text, token_ids, _ = asyncio.run(collect(llm, [7, 8, 9], params, "bare"))
    assert text == "" and token_ids == asyncio.run(collect(llm, [7, 8, 9], GREEDY, "full"))[1]


def test_abort_frees_the_blocks_at_once(llm):
    long = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)

    async def run():
        stream = llm.generate([1, 2, 3], long, "long")
        first = await anext(stream)
        assert first.new_token_ids and first.finish_reason is None
        await llm.abort("long")
        # The engine is idle now (nothing else runs): its pool is safe to read from here.
        assert_idle(llm)
        last = await anext(stream)
        assert last.finish_reason == "abort"
        with pytest.raises(StopAsyncIteration):
            await anext(stream)

    asyncio.run(run())


def test_bad_requests_raise_before_queueing(llm):
    async def run():
        with pytest.raises(ValueError, match="max_model_len"):
            await anext(llm.generate([1] * 5000, GREEDY, "too-long"))
        busy = llm.generate([1, 2], SamplingParams(max_tokens=200, ignore_eos=True), "dup")
        await anext(busy)
        with pytest.raises(ValueError, match="request_id='dup' is already in use"):
            await anext(llm.generate([1, 2], GREEDY, "dup"))
        with pytest.raises(ValueError, match="n=2: a stream is one completion"):
            await anext(llm.generate([1, 2], SamplingParams(n=2), "n"))
        await busy.aclose()  # leaving early aborts it: queued before the next request
        await collect(llm, [1, 2], GREEDY, "after")

    asyncio.run(run())
    assert_idle(llm)


@pytest.fixture(scope="module")
def thread_llm(tiny_model):
    engine = AsyncLLM(tiny_model, engine_process=False, device="cpu", num_kvcache_blocks=16)
    yield engine
    engine.shutdown()


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(thread_llm, monkeypatch):
    llm = thread_llm
    runner = llm.engine.model_runner
    launch = runner.launch

    def fail_once(*args, **kwargs):
        monkeypatch.setattr(runner, "launch", launch)
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(runner, "launch", fail_once)

    async def run():
        with pytest.raises(RuntimeError, match="engine step failed.*out of memory"):
            await collect(llm, [1, 2, 3], GREEDY, "doomed")
        return await collect(llm, [1, 2, 3], GREEDY, "next")

    text, token_ids, reason = asyncio.run(run())
    assert len(token_ids) == GREEDY.max_tokens and reason == "length"
    assert_idle(llm)

"""The server's logprobs (both OpenAI formats) and n completions, streamed and not, against the
offline engine; a server subprocess of this module's own."""
import asyncio
import itertools
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")  # the serve extra; without it this module is not collected

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.serve.openai.serving import interleave  # noqa: E402
from tests.serve.conftest import metrics, stream, wait_until_idle  # noqa: E402

WORDS = ["hello", "world", "the", "quick", "brown", "fox", "cache", "block"]
CANDIDATES = [" ".join(words) for words in itertools.permutations(WORDS, 3)]
LOGPROB_TOKENS = 8
PROMPT = "the paged attention kernel"
MAX_TOKENS = 24
SAMPLED = dict(n=3, seed=1234, temperature=0.8, max_tokens=MAX_TOKENS)
ECHO_PROMPT = [5, 17, 42, 99, 3, 250, 7]
MULTI_PROMPTS = [PROMPT, "the quick brown fox", "hello world"]


def messages(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def completion(prompt, **fields) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            **fields}


def first_whole(llm: LLM, run) -> tuple[str, dict]:
    """The first candidate whose answer `run(candidate)` is whole tokens: each decodes alone to
    whole characters (no piece of a UTF-8 sequence), so the token strings concatenate to the
    text, and its top tokens decode to distinct strings, so a completions top_logprobs dict
    keeps every entry. The tiny model's random weights pick byte tokens often."""
    def decode(token_id: int) -> str:
        return llm.tokenizer.decode([token_id])

    for candidate in CANDIDATES:
        out = run(candidate)
        if ("".join(map(decode, out["token_ids"])) == out["text"]
                and all(len(set(map(decode, entry))) == len(entry) for entry in out["logprobs"])):
            return candidate, out
    pytest.fail("no candidate prompt has an answer of whole tokens")


@pytest.fixture(scope="module")
def offline(tiny_model):
    """The offline engine's answers to what the tests send."""
    llm = LLM(tiny_model, device="cpu")
    try:
        greedy = SamplingParams(temperature=0, max_tokens=LOGPROB_TOKENS, logprobs=3)
        chat_greedy = SamplingParams(temperature=0, max_tokens=LOGPROB_TOKENS, logprobs=2)
        return SimpleNamespace(
            completion=first_whole(llm, lambda p: llm.generate(p, greedy, use_tqdm=False)[0]),
            chat=first_whole(llm, lambda p: llm.chat(messages(p), chat_greedy,
                                                     use_tqdm=False)[0]),
            sampled=llm.generate(PROMPT, SamplingParams(**SAMPLED), use_tqdm=False)[0],
            greedy=llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                use_tqdm=False)[0],
            echoed=llm.generate(ECHO_PROMPT, SamplingParams(
                temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1), use_tqdm=False)[0],
            echo_prompt_text=llm.tokenizer.decode(ECHO_PROMPT),
            multi=llm.generate(MULTI_PROMPTS, SamplingParams(**SAMPLED), use_tqdm=False),
            multi_prompt_tokens=sum(len(llm.tokenizer.encode(p)) for p in MULTI_PROMPTS),
            num_prompt_tokens=len(llm.tokenizer.encode(PROMPT)),
            decode=lambda token_id: llm.tokenizer.decode([token_id]))
    finally:
        llm.shutdown()


def test_completions_logprobs_equal_offline_streamed_and_not(client, offline):
    prompt, expected = offline.completion
    body = completion(prompt, max_tokens=LOGPROB_TOKENS, logprobs=3)
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    logprobs = choice["logprobs"]
    tokens = [offline.decode(t) for t in expected["token_ids"]]
    assert logprobs["tokens"] == tokens and "".join(tokens) == choice["text"] == expected["text"]
    assert logprobs["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
    assert logprobs["token_logprobs"] == pytest.approx(
        [entry[t] for t, entry in zip(expected["token_ids"], expected["logprobs"])], abs=1e-5)
    for top, entry in zip(logprobs["top_logprobs"], expected["logprobs"], strict=True):
        assert len(top) in (3, 4)  # the top 3, and the sampled token when it is not among them
        assert top == pytest.approx({offline.decode(i): lp for i, lp in entry.items()}, abs=1e-5)

    _, events = stream(client, "/v1/completions", body)
    assert len(events) > 1
    streamed = {key: [] for key in logprobs}
    for event in events:
        for key, values in event["choices"][0]["logprobs"].items():
            streamed[key] += values
    assert streamed["tokens"] == tokens and streamed["text_offset"] == logprobs["text_offset"]
    assert streamed["token_logprobs"] == pytest.approx(logprobs["token_logprobs"], abs=1e-5)
    for got, want in zip(streamed["top_logprobs"], logprobs["top_logprobs"], strict=True):
        assert got == pytest.approx(want, abs=1e-5)


def test_chat_logprobs_equal_offline_streamed_and_not(client, offline):
    content, expected = offline.chat
    body = {"messages": messages(content), "max_tokens": LOGPROB_TOKENS, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    entries = choice["logprobs"]["content"]
    tokens = [entry["token"] for entry in entries]
    assert tokens == [offline.decode(t) for t in expected["token_ids"]]
    assert "".join(tokens) == choice["message"]["content"] == expected["text"]
    for entry, token_id, want in zip(entries, expected["token_ids"], expected["logprobs"],
                                     strict=True):
        assert entry["logprob"] == pytest.approx(want[token_id], abs=1e-5)
        top = sorted(want.items(), key=lambda item: -item[1])[:2]
        assert [e["token"] for e in entry["top_logprobs"]] == [offline.decode(i) for i, _ in top]
        assert [e["logprob"] for e in entry["top_logprobs"]] == pytest.approx(
            [lp for _, lp in top], abs=1e-5)
        for e in [entry, *entry["top_logprobs"]]:
            assert e["bytes"] == list(e["token"].encode())

    _, events = stream(client, "/v1/chat/completions", body)
    assert events[0]["choices"][0]["logprobs"] is None  # the role chunk
    streamed = [entry for event in events[1:]
                for entry in event["choices"][0]["logprobs"]["content"]]
    assert [entry["token"] for entry in streamed] == tokens
    for got, want in zip(streamed, entries, strict=True):
        assert got["logprob"] == pytest.approx(want["logprob"], abs=1e-5)
        assert got["top_logprobs"] == [{**e, "logprob": pytest.approx(e["logprob"], abs=1e-5)}
                                       for e in want["top_logprobs"]]


def by_index(events: list[dict]) -> tuple[list[int], dict[int, list[dict]]]:
    """The streamed choices' indexes in order, and each index's choices."""
    order, choices = [], {}
    for event in events:
        (choice,) = event["choices"]  # one choice per chunk
        order.append(choice["index"])
        choices.setdefault(choice["index"], []).append(choice)
    return order, choices


def test_n_seeded_completions_equal_offline_streamed_and_not(client, offline):
    expected = offline.sampled["outputs"]
    assert len({out["text"] for out in expected}) == 3  # each completion has its own seed
    num_tokens = sum(len(out["token_ids"]) for out in expected)
    usage = {"prompt_tokens": offline.num_prompt_tokens, "completion_tokens": num_tokens,
             "total_tokens": offline.num_prompt_tokens + num_tokens}
    body = completion(PROMPT, **SAMPLED)
    response = client.post("/v1/completions", json=body).json()
    assert [(c["index"], c["text"], c["finish_reason"], c["logprobs"])
            for c in response["choices"]] == [(i, out["text"], out["finish_reason"], None)
                                              for i, out in enumerate(expected)]
    assert response["usage"] == usage

    _, events = stream(client, "/v1/completions",
                       {**body, "stream_options": {"include_usage": True}})
    assert events[-1]["choices"] == [] and events[-1]["usage"] == usage
    order, choices = by_index(events[:-1])
    assert sorted(choices) == [0, 1, 2] and order != sorted(order)  # interleaved
    for index, out in enumerate(expected):
        assert "".join(c["text"] for c in choices[index]) == out["text"]
        reasons = [c["finish_reason"] for c in choices[index]]
        assert reasons[-1] == out["finish_reason"] and not any(reasons[:-1])


def test_n_greedy_choices_are_identical(client, offline):
    response = client.post("/v1/completions", json=completion(PROMPT, n=2)).json()
    assert [c["text"] for c in response["choices"]] == [offline.greedy["text"]] * 2
    assert response["usage"]["completion_tokens"] == 2 * len(offline.greedy["token_ids"])

    content, expected = offline.chat
    _, events = stream(client, "/v1/chat/completions", {
        "messages": messages(content), "max_tokens": LOGPROB_TOKENS, "temperature": 0, "n": 2})
    assert [e["choices"][0] for e in events[:2]] == [
        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": None} for i in (0, 1)]
    _, choices = by_index(events)
    for index in (0, 1):
        assert "".join(c["delta"]["content"] for c in choices[index]) == expected["text"]
        assert [c["finish_reason"] for c in choices[index]][-1] == expected["finish_reason"]


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", completion("hi", logprobs=21), "logprobs"),
    ("/v1/completions", completion("hi", logprobs=-1), "logprobs"),
    ("/v1/chat/completions", {"messages": messages("hi"), "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": messages("hi"), "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", completion("hi", n=0), "n"),
    ("/v1/chat/completions", {"messages": messages("hi"), "n": 129}, "n"),
])
def test_bad_logprobs_and_n_are_400s(client, route, body, param):
    for stream_it in (False, True):
        response = client.post(route, json={**body, "stream": stream_it})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == 400 and error["param"] == param and error["message"]
    assert client.get("/health").status_code == 200
    good = client.post("/v1/completions", json=completion("hi", n=2, logprobs=1, max_tokens=2))
    assert good.status_code == 200 and len(good.json()["choices"]) == 2


def test_disconnect_mid_stream_aborts_all_n_requests(client):
    body = completion("hello", n=4, max_tokens=3000, ignore_eos=True, stream=True,
                      temperature=0.8, seed=5)
    with client.stream("POST", "/v1/completions", json=body) as response:
        seen, lines = set(), response.iter_lines()  # held: closing it would hang up
        for line in lines:
            if line.startswith("data: "):
                seen.add(json.loads(line[len("data: "):])["choices"][0]["index"])
                if len(seen) == 4:
                    break
        assert metrics(client)["nanovllm:num_requests_running"] == 4
    values = wait_until_idle(client, timeout=5)
    assert values["nanovllm:num_requests_running"] == 0
    assert values["nanovllm:kv_cache_usage_perc"] == 0


def test_echo_returns_the_prompt_and_its_logprobs_as_an_eval_harness_reads_them(client,
                                                                                 offline):
    """An evaluation harness's loglikelihood request (echo, logprobs=1, max_tokens=1): the
    prompt leads the text, and token_logprobs score every prompt token but the first (None)
    as the offline engine's prompt_logprobs do; n choices each echo it."""
    expected = offline.echoed
    body = client.post("/v1/completions", json=completion(
        ECHO_PROMPT, max_tokens=1, logprobs=1, echo=True, n=2)).json()
    for choice in body["choices"]:
        assert choice["text"] == offline.echo_prompt_text + expected["text"]
        logprobs = choice["logprobs"]
        scored = ECHO_PROMPT[1:] + expected["token_ids"]
        want = [entry[t] for t, entry in zip(scored, expected["prompt_logprobs"][1:]
                                             + expected["logprobs"])]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:] == pytest.approx(want, abs=1e-5)
        assert len(logprobs["tokens"]) == len(ECHO_PROMPT) + 1
        assert logprobs["text_offset"][len(ECHO_PROMPT)] == len(offline.echo_prompt_text)
    assert body["usage"]["prompt_tokens"] == len(ECHO_PROMPT)
    plain = client.post("/v1/completions", json=completion(ECHO_PROMPT, max_tokens=1,
                                                           echo=True)).json()["choices"][0]
    assert plain["text"] == offline.echo_prompt_text + expected["text"]
    assert plain["logprobs"] is None


def test_a_list_of_prompts_gets_n_choices_each_streamed_and_not(client, offline):
    """`prompt` as a list (strings or token-id lists): choice j * n + i is completion i of
    prompt j, each as offline; usage counts every prompt once."""
    want = [c["text"] for out in offline.multi for c in out["outputs"]]
    body = client.post("/v1/completions", json=completion(MULTI_PROMPTS, **SAMPLED)).json()
    assert [c["index"] for c in body["choices"]] == list(range(len(want)))
    assert [c["text"] for c in body["choices"]] == want
    assert body["usage"]["prompt_tokens"] == offline.multi_prompt_tokens
    pieces, events = stream(client, "/v1/completions", completion(
        MULTI_PROMPTS, **SAMPLED, stream_options={"include_usage": True}))
    texts = [""] * len(want)
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == want and events[-1]["usage"] == body["usage"]


def test_metrics_count_a_request_of_n_choices_once(client):
    """Prompt tokens and request latencies once per request; generated tokens of every choice."""
    before = metrics(client)
    body = client.post("/v1/completions", json=completion([5, 17, 42, 99, 3], n=4,
                                                          ignore_eos=True)).json()
    after = wait_until_idle(client)
    assert len(body["choices"]) == 4 and body["usage"]["prompt_tokens"] == 5

    def grew(name: str) -> float:
        return after[f"nanovllm:{name}"] - before.get(f"nanovllm:{name}", 0)

    assert grew("prompt_tokens_total") == 5
    assert grew("generation_tokens_total") == body["usage"]["completion_tokens"] == 4 * MAX_TOKENS
    assert grew("e2e_request_latency_seconds_count") == 1
    assert grew("time_to_first_token_seconds_count") == 1


def test_interleave_raises_an_error_and_closes_the_other_streams():
    closed = []

    async def outputs(index: int, fail_after: int | None):
        try:
            for i in itertools.count():
                if i == fail_after:
                    raise RuntimeError("engine step failed")
                yield i
                await asyncio.sleep(0)
        finally:
            closed.append(index)

    async def run() -> list[tuple[int, int]]:
        got = []
        with pytest.raises(RuntimeError, match="engine step failed"):
            async for item in interleave([outputs(0, None), outputs(1, 3), outputs(2, None)]):
                got.append(item)
        return got

    got = asyncio.run(run())
    assert sorted(closed) == [0, 1, 2]
    assert [i for index, i in got if index == 1] == [0, 1, 2]


def test_interleave_cancelled_before_a_first_output_closes_every_stream():
    """A client that leaves before any output: the cancelled wait aborts all n requests."""
    closed = []

    async def silent(index: int):
        try:
            await asyncio.Event().wait()
            yield index
        finally:
            closed.append(index)

    async def run() -> None:
        task = asyncio.ensure_future(anext(interleave([silent(i) for i in range(3)])))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert sorted(closed) == [0, 1, 2]

"""The OpenAI-compatible server, through a real HTTP client against a server subprocess."""
import asyncio
import os
import random
import signal
import time
from pathlib import Path

import httpx
import pytest

from nanovllm import LLM, SamplingParams
from tests.serve.conftest import (
    API_KEY,
    descendants,
    metrics,
    start_server,
    stop_server,
    stream,
    wait_until_idle,
)

PROMPTS = ["hello world the", "the quick brown fox jumps", [5, 17, 42, 99, 3]]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
CHAT = [{"role": "user", "content": "the paged attention kernel"}]
PENALTIES = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)


@pytest.fixture(scope="module")
def offline(tiny_model):
    """The offline engine's outputs: one call per request, as the server runs them here."""
    llm = LLM(tiny_model, device="cpu")
    try:
        completions = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in PROMPTS]
        chat = llm.chat(CHAT, GREEDY, use_tqdm=False)[0]
        # A stop string from the middle of the first completion's text.
        text = completions[0]["text"]
        stop = text[len(text) // 2:len(text) // 2 + 2]
        stopped = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                          stop=stop), use_tqdm=False)[0]
        penalized = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                            **PENALTIES), use_tqdm=False)[0]
    finally:
        llm.shutdown()
    return completions, chat, stop, stopped, penalized


def completion(prompt, **fields) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            **fields}


def test_completions_equal_offline_streamed_and_not(client, offline):
    for prompt, expected in zip(PROMPTS, offline[0]):
        body = client.post("/v1/completions", json=completion(prompt)).json()
        assert body["choices"][0]["text"] == expected["text"]
        assert body["choices"][0]["finish_reason"] == expected["finish_reason"]
        assert body["usage"]["completion_tokens"] == len(expected["token_ids"])
        pieces, events = stream(client, "/v1/completions",
                                completion(prompt, stream_options={"include_usage": True}))
        assert "".join(pieces) == expected["text"]
        assert events[-1]["usage"]["completion_tokens"] == len(expected["token_ids"])
        assert events[-2]["choices"][0]["finish_reason"] == expected["finish_reason"]


def test_chat_completions_equal_offline_streamed_and_not(client, offline):
    expected = offline[1]["text"]
    body = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected}
    pieces, events = stream(client, "/v1/chat/completions", {
        "messages": CHAT, "max_completion_tokens": MAX_TOKENS, "temperature": 0})
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(pieces) == expected


def test_stop_string_is_cut_from_the_stream(client, offline):
    _, _, stop, expected, _ = offline
    assert expected["finish_reason"] == "stop" and stop not in expected["text"]
    pieces, _ = stream(client, "/v1/completions", completion(PROMPTS[0], stop=[stop]))
    assert "".join(pieces) == expected["text"]


def test_include_stop_str_in_output_keeps_the_stop_string(client, offline):
    _, _, stop, expected, _ = offline
    body = completion(PROMPTS[0], stop=[stop], include_stop_str_in_output=True)
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (expected["text"] + stop, "stop")
    pieces, _ = stream(client, "/v1/completions", body)
    assert "".join(pieces) == expected["text"] + stop


def test_penalties_reach_the_sampler(client, offline):
    """OpenAI's presence/frequency penalties and vLLM's repetition_penalty, as offline."""
    expected = offline[4]
    assert expected["text"] != offline[0][1]["text"]  # the penalties change this answer
    body = client.post("/v1/completions", json=completion(PROMPTS[1], **PENALTIES)).json()
    assert body["choices"][0]["text"] == expected["text"]


def test_special_tokens_are_skipped_unless_asked(client, offline):
    """vLLM's skip_special_tokens: the EOS in [7, 8, 9]'s greedy answer (ignored, so that it
    does not stop it) is not in the text by default, and is with skip_special_tokens false."""
    texts = [client.post("/v1/completions", json=completion(
        [7, 8, 9], max_tokens=64, skip_special_tokens=skip, ignore_eos=True)).json()
        ["choices"][0]["text"] for skip in (True, False)]
    assert "<|endoftext|>" in texts[1] and texts[1].replace("<|endoftext|>", "") == texts[0]


@pytest.mark.parametrize("route, body, status, param", [
    ("/v1/completions", completion("hi", temperature=-1), 400, "temperature"),
    ("/v1/completions", completion("hi", max_tokens="many"), 400, "max_tokens"),
    ("/v1/completions", completion([1, 2, 100000]), 400, "prompt"),
    ("/v1/completions", completion("hi", presence_penalty=3), 400, "presence_penalty"),
    ("/v1/completions", completion("hi", repetition_penalty=0), 400, "repetition_penalty"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/completions", completion("hi", model="gpt-9"), 404, "model"),
])
def test_bad_requests_get_openai_errors(client, route, body, status, param):
    for stream_it in (False, True):
        response = client.post(route, json={**body, "stream": stream_it})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["code"] == status and error["param"] == param and error["message"]
    assert client.get("/health").status_code == 200


def test_api_key_is_required(server, client):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(f"{server[0]}/v1/completions", json=completion("hi"),
                              headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server[0]}/health").status_code == 200  # no key needed
    models = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny"]


def test_disconnect_mid_stream_aborts_the_request(client):
    body = completion("hello", max_tokens=3000, ignore_eos=True, stream=True)
    with client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert metrics(client)["nanovllm:num_requests_running"] == 1
    values = wait_until_idle(client, timeout=5)
    assert values["nanovllm:num_requests_running"] == 0
    assert values["nanovllm:kv_cache_usage_perc"] == 0


def test_disconnect_before_a_full_answer_aborts_the_request(server, client):
    body = completion("hello", max_tokens=3000, ignore_eos=True)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server[0]}/v1/completions", json=body, timeout=1,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    values = wait_until_idle(client, timeout=5)
    assert values["nanovllm:num_requests_running"] == 0
    assert values["nanovllm:kv_cache_usage_perc"] == 0


async def one_client(http: httpx.AsyncClient, rng: random.Random) -> int:
    """Stream one request; leave after a few chunks (a long request, which only an abort ends
    in time), or read a short one to the end."""
    leave_after = rng.choice([1, 2, 5, None, None])
    max_tokens = rng.randint(4, 40) if leave_after is None else 2000
    body = completion([rng.randrange(1, 500) for _ in range(rng.randint(2, 40))],
                      max_tokens=max_tokens, ignore_eos=True, stream=True)
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        num_chunks = 0
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                num_chunks += 1
                if num_chunks == leave_after:
                    return num_chunks
    return num_chunks


def test_200_concurrent_streams_with_disconnects_free_every_block(server, client):
    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=250)
        async with httpx.AsyncClient(base_url=server[0], limits=limits, timeout=60,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            rng = random.Random(0)
            return await asyncio.gather(*(one_client(http, rng) for _ in range(200)))

    chunks = asyncio.run(run())
    assert len(chunks) == 200 and all(n >= 1 for n in chunks)
    values = wait_until_idle(client)
    assert values["nanovllm:num_requests_running"] == 0
    assert values["nanovllm:num_requests_waiting"] == 0
    assert values["nanovllm:kv_cache_usage_perc"] == 0
    assert values["nanovllm:generation_tokens_total"] > 0
    assert client.post("/v1/completions", json=completion("hi")).status_code == 200


def test_a_dead_engine_makes_the_server_answer_503(tiny_model, tmp_path):
    """The engine process killed: /health and new requests answer 503 (OpenAI's body), and
    Ctrl-C still stops the server cleanly."""
    proc, url = start_server(tiny_model, tmp_path / "server.log", "--num-kvcache-blocks", "16",
                             "--served-model-name", "tiny")
    try:
        (engine,) = [pid for pid in descendants(proc.pid)
                     if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        os.kill(engine, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.get(f"{url}/health").status_code == 503
        for stream_it in (False, True):
            response = httpx.post(f"{url}/v1/completions",
                                  json=completion("hi", stream=stream_it))
            assert response.status_code == 503, response.text
            assert response.json()["error"]["type"] == "service_unavailable"
    finally:
        stop_server(proc)
    assert proc.returncode == 0, (tmp_path / "server.log").read_text()[-3000:]


def test_the_openai_sdk_retrieves_the_model_and_reads_errors(server):
    """models.retrieve() works; an unknown model, route or bad field raises the SDK's error
    with OpenAI's body parsed."""
    openai = pytest.importorskip("openai")
    sdk = openai.OpenAI(base_url=f"{server[0]}/v1", api_key=API_KEY, max_retries=0)
    model = sdk.models.retrieve("tiny")
    assert model.id == "tiny" and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("gpt-9")
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model="tiny", prompt="hi", max_tokens=2,
                               stream_options={"include_usage": True})
    assert bad.value.body["param"] == "stream_options"
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.get("/nothing", cast_to=object)
    assert missing.value.body["message"].startswith("Invalid URL")

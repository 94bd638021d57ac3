"""The request fields' edges against the in-process app (engine in a thread, a short context):
strict types, streaming options, the context length, routes, stop tokens, echo, logprobs."""
import json

import pytest
from fastapi.testclient import TestClient

from nanovllm import LLM, SamplingParams
from nanovllm.serve.async_llm import AsyncLLM
from nanovllm.serve.openai.app import build_app

MAX_MODEL_LEN = 64
PROMPT = "hello world the"
CHAT = [{"role": "user", "content": "the paged attention kernel"}]


@pytest.fixture(scope="module")
def app(tiny_model):
    """(client, tokenizer): the app over a thread engine with a 64-token context."""
    llm = AsyncLLM(tiny_model, engine_process=False, device="cpu", num_kvcache_blocks=4,
                   max_model_len=MAX_MODEL_LEN)
    with TestClient(build_app(llm, "tiny")) as client:  # its lifespan shuts the engine down
        yield client, llm.tokenizer


def completion(prompt=PROMPT, **fields) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, **fields}


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": CHAT, "max_tokens": 8, "temperature": 0, **fields}


def events(client: TestClient, route: str, body: dict) -> list[dict]:
    """A streamed request's parsed events before [DONE]."""
    with client.stream("POST", route, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def assert_400(response, param: str | None) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return error


@pytest.mark.parametrize("route, field, value", [
    ("/v1/completions", "max_tokens", True), ("/v1/completions", "max_tokens", "3"),
    ("/v1/completions", "max_tokens", 3.0), ("/v1/completions", "n", True),
    ("/v1/completions", "temperature", True), ("/v1/completions", "temperature", "0.5"),
    ("/v1/completions", "seed", "1"), ("/v1/completions", "logprobs", True),
    ("/v1/completions", "stream", "true"), ("/v1/completions", "ignore_eos", 1),
    ("/v1/completions", "top_k", 2.0), ("/v1/completions", "stop_token_ids", [True]),
    ("/v1/completions", "prompt", [True, 3]), ("/v1/completions", "echo", "yes"),
    ("/v1/chat/completions", "max_completion_tokens", "4"),
    ("/v1/chat/completions", "logprobs", 1), ("/v1/chat/completions", "top_logprobs", True),
])
def test_numbers_and_bools_are_strict(app, route, field, value):
    client, _ = app
    body = chat() if "chat" in route else completion()
    response = client.post(route, json={**body, field: value})
    assert response.status_code == 400, response.text
    param = response.json()["error"]["param"]  # the field, or a path into it
    assert param == field or param.startswith(f"{field}."), param


def test_floats_take_ints_as_openai_does(app):
    client, _ = app
    response = client.post("/v1/completions", json=completion(temperature=1, top_p=1, seed=3))
    assert response.status_code == 200, response.text


def test_nested_fields_are_strict_and_named(app):
    client, _ = app
    response = client.post("/v1/completions", json=completion(
        stream=True, stream_options={"include_usage": "yes"}))
    assert_400(response, "stream_options.include_usage")
    messages = [{"role": "user", "content": [{"type": "text", "text": 3}]}]
    assert_400(client.post("/v1/chat/completions", json=chat(messages=messages)),
               "messages.0.content.0.text")


@pytest.mark.parametrize("route, fields, param", [
    ("/v1/chat/completions", dict(max_completion_tokens=0), "max_completion_tokens"),
    ("/v1/chat/completions", dict(max_tokens=0), "max_tokens"),
    ("/v1/completions", dict(max_tokens=-1), "max_tokens"),
    ("/v1/completions", dict(n=2, best_of=1), "best_of"),  # OpenAI's and vLLM's: best_of >= n
])
def test_a_bad_value_names_the_field_sent(app, route, fields, param):
    client, _ = app
    body = (chat if "chat" in route else completion)(**fields)
    value = assert_400(client.post(route, json=body), param)["message"]
    assert value.startswith(f"{param}={fields[param]}"), value


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_without_stream_is_a_400(app, route):
    client, _ = app
    body = (chat if "chat" in route else completion)(stream_options={"include_usage": True})
    assert_400(client.post(route, json=body), "stream_options")


def test_prompt_and_max_tokens_beyond_the_context_are_a_400(app):
    """vLLM's message; without max_tokens the default fits the rest of the context."""
    client, _ = app
    prompt = [5] * 60
    error = assert_400(client.post("/v1/completions", json=completion(prompt, max_tokens=10)),
                       "max_tokens")
    assert error["message"].startswith(
        "This model's maximum context length is 64 tokens. However, you requested 70 tokens "
        "(60 in the messages, 10 in the completion).")
    chat_body = chat(max_tokens=None, max_completion_tokens=MAX_MODEL_LEN)
    assert "maximum context length is 64" in assert_400(
        client.post("/v1/chat/completions", json=chat_body), "max_completion_tokens")["message"]
    assert_400(client.post("/v1/completions", json=completion([5] * 64, max_tokens=None)),
               "prompt")
    fits = client.post("/v1/completions", json=completion(prompt, max_tokens=4)).json()
    assert fits["usage"]["completion_tokens"] == 4
    for body in (completion(prompt, max_tokens=None, ignore_eos=True),
                 completion([5] * 52, max_tokens=None, ignore_eos=True)):  # the default, 16
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
        assert choice["finish_reason"] == "length"
    default = client.post("/v1/chat/completions", json=chat(max_tokens=None, ignore_eos=True))
    usage = default.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN


@pytest.mark.parametrize("method, route, status", [
    ("GET", "/v1/nothing", 404), ("POST", "/v2/completions", 404),
    ("GET", "/v1/completions", 405), ("DELETE", "/v1/models", 405),
])
def test_unknown_routes_and_methods_get_openai_errors(app, method, route, status):
    client, _ = app
    response = client.request(method, route)
    assert response.status_code == status
    assert response.json() == {"error": {
        "message": f"{'Invalid URL' if status == 404 else 'Invalid method for URL'} "
                   f"({method} {route})", "type": "invalid_request_error", "param": None,
        "code": status}}


def test_a_model_is_retrieved_by_id(app):
    client, _ = app
    card = client.get("/v1/models/tiny").json()
    assert card == client.get("/v1/models").json()["data"][0]
    assert card["id"] == "tiny" and card["object"] == "model"
    response = client.get("/v1/models/gpt-9")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"


def test_a_malformed_body_names_no_offset(app):
    client, _ = app
    response = client.post("/v1/completions", content=b'{"prompt": ',
                           headers={"Content-Type": "application/json"})
    error = assert_400(response, None)
    assert "not valid JSON" in error["message"]
    assert_400(client.post("/v1/completions", json=[1, 2]), None)


def test_the_stop_token_text_is_left_out(app, tiny_model):
    """As vLLM: a stop_token_ids token (or an EOS, special or not) stays in the tokens only."""
    client, tokenizer = app
    offline = LLM(tiny_model, device="cpu", num_kvcache_blocks=4)
    try:
        ids = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16,
                                                      ignore_eos=True), use_tqdm=False)[0]
    finally:
        offline.shutdown()
    ids = ids["token_ids"]
    # a token with text of its own (the tiny vocabulary leaves some ids without one)
    i = next(i for i in range(3, len(ids))
             if ids[i] not in ids[:i] and tokenizer.decode(ids[i]))
    body = completion(max_tokens=16, ignore_eos=True, stop_token_ids=[ids[i]])
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == tokenizer.decode(ids[:i], skip_special_tokens=True)
    streamed = "".join(e["choices"][0]["text"] for e in events(client, "/v1/completions", body))
    assert streamed == choice["text"]
    raw = client.post("/v1/completions", json=completion(
        [7, 8, 9], max_tokens=60, skip_special_tokens=False)).json()["choices"][0]
    assert raw["finish_reason"] == "stop" and "<|endoftext|>" not in raw["text"]


def test_text_parts_are_joined_with_newlines(app):
    client, _ = app
    parts = [{"role": "user", "content": [{"type": "text", "text": "the paged"},
                                          {"type": "text", "text": "attention kernel"}]}]
    joined = [{"role": "user", "content": "the paged\nattention kernel"}]
    got, want = [client.post("/v1/chat/completions", json=chat(messages=m)).json()
                 for m in (parts, joined)]
    assert got["usage"] == want["usage"] and got["choices"] == want["choices"]

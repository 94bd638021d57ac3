"""logit_bias, allowed_token_ids, min_tokens and bad_words through the server, against the
offline engine; a server subprocess of this module's own."""
import pytest

pytest.importorskip("fastapi")  # the serve extra; without it this module is not collected

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.utils.tokenizer import load_tokenizer  # noqa: E402

PROMPT = "the quick brown fox"
MAX_TOKENS = 12
STEERED = [dict(allowed_token_ids=[5, 17, 42, 300]), dict(bad_words=["hello"], min_tokens=3)]


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            **fields}


@pytest.fixture(scope="module")
def offline(tiny_model) -> list[dict]:
    llm = LLM(tiny_model, device="cpu")
    try:
        return [llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **f),
                             use_tqdm=False)[0] for f in STEERED]
    finally:
        llm.shutdown()


def test_logit_bias_of_100_gives_its_token(client, tiny_model):
    expected = load_tokenizer(tiny_model).decode([300] * MAX_TOKENS)
    body = client.post("/v1/completions", json=completion(logit_bias={"300": 100})).json()
    assert body["choices"][0]["text"] == expected
    chat = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
        "max_tokens": MAX_TOKENS, "logit_bias": {"300": 100}}).json()
    assert chat["choices"][0]["message"]["content"] == expected


def test_min_tokens_holds_back_stop_token_ids(client):
    fields = dict(logit_bias={"300": 100}, stop_token_ids=[300], max_tokens=16)
    short = client.post("/v1/completions", json=completion(**fields)).json()
    assert short["usage"]["completion_tokens"] == 1
    body = client.post("/v1/completions", json=completion(min_tokens=5, **fields)).json()
    assert body["usage"]["completion_tokens"] == 6
    assert body["choices"][0]["finish_reason"] == "stop"


def test_allowed_token_ids_and_bad_words_equal_offline(client, offline):
    for fields, expected in zip(STEERED, offline):
        body = client.post("/v1/completions", json=completion(**fields)).json()
        assert body["choices"][0]["text"] == expected["text"]


@pytest.mark.parametrize("fields, param", [
    (dict(logit_bias={"abc": 1}), "logit_bias"), (dict(logit_bias={"100000": 1}), "logit_bias"),
    (dict(logit_bias={"3": "x"}), "logit_bias.3"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, 600]), "allowed_token_ids"),
    (dict(min_tokens=MAX_TOKENS + 1), "min_tokens"), (dict(min_tokens=-1), "min_tokens"),
    (dict(bad_words=[""]), "bad_words")])
def test_a_bad_value_is_a_400_naming_it(client, fields, param):
    for route, body in [("/v1/completions", completion(**fields)),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": MAX_TOKENS, **fields})]:
        response = client.post(route, json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param, response.text

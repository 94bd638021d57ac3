"""vLLM's prompt options: truncate_prompt_tokens, add_special_tokens, the chat template's
continue_final_message, documents and tool call arguments; the model's sampling defaults."""
import pytest
from fastapi.testclient import TestClient

from nanovllm.serve.async_llm import AsyncLLM
from nanovllm.serve.openai.app import build_app
from nanovllm.serve.openai.chat_template import chat_prompt
from nanovllm.serve.openai.protocol import ChatCompletionRequest
from tests.engine.test_generation_config import model_with_defaults  # noqa: F401
from tests.serve.test_request_fields import TOOL_TEMPLATE
from tests.serve.test_server_fields import (  # noqa: F401
    MAX_MODEL_LEN,
    app,
    assert_400,
    chat,
    completion,
)

LONG_PROMPT = "the quick brown fox jumps over the lazy dog"


def _usage_and_text(client, route: str, body: dict) -> tuple[int, str]:
    response = client.post(route, json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    choice = answer["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    return answer["usage"]["prompt_tokens"], text


def test_truncate_prompt_tokens_keeps_the_last_tokens(app):  # noqa: F811
    """The prompt's last k tokens, as if sent as token ids; -1 keeps max_model_len; a value
    below -1 or above max_model_len is a 400."""
    client, tokenizer = app
    ids = tokenizer.encode(LONG_PROMPT)
    assert len(ids) > 3
    got = _usage_and_text(client, "/v1/completions",
                          completion(LONG_PROMPT, truncate_prompt_tokens=3))
    assert got == _usage_and_text(client, "/v1/completions", completion(ids[-3:]))
    whole = _usage_and_text(client, "/v1/completions", completion(LONG_PROMPT))
    assert _usage_and_text(client, "/v1/completions",
                           completion(LONG_PROMPT, truncate_prompt_tokens=-1)) == whole
    for bad in (-2, 0, MAX_MODEL_LEN + 1):
        for route, body in (("/v1/completions", completion(truncate_prompt_tokens=bad)),
                            ("/v1/chat/completions", chat(truncate_prompt_tokens=bad))):
            assert_400(client.post(route, json=body), "truncate_prompt_tokens")


def test_truncated_chat_prompt_leaves_the_rest_of_the_context(app):  # noqa: F811
    """Without max_tokens a chat completion may fill the context the truncated prompt left."""
    client, _ = app
    body = chat(messages=[{"role": "user", "content": LONG_PROMPT * 4}], max_tokens=None,
                truncate_prompt_tokens=10, ignore_eos=True)
    usage = client.post("/v1/chat/completions", json=body).json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (10, MAX_MODEL_LEN - 10)


def _with_bos(tokenizer, monkeypatch) -> None:
    """A stand-in BOS (id 0) that encode adds unless told not to."""
    encode = tokenizer.encode

    def encode_with_bos(text, add_special_tokens=True, **kwargs):
        ids = encode(text, add_special_tokens=False, **kwargs)
        return [0, *ids] if add_special_tokens else ids

    monkeypatch.setattr(tokenizer, "encode", encode_with_bos)


def test_echo_gives_the_prompt_the_model_read(app, monkeypatch):  # noqa: F811
    """A prompt left whole is echoed as sent (not with the BOS the tokenizer added); a
    truncated one as its kept tokens' text."""
    client, tokenizer = app
    _with_bos(tokenizer, monkeypatch)
    ids = tokenizer.encode(LONG_PROMPT)
    assert not tokenizer.decode(ids).startswith(LONG_PROMPT)

    def echoed(**fields) -> str:
        body = completion(LONG_PROMPT, echo=True, max_tokens=1, **fields)
        return client.post("/v1/completions", json=body).json()["choices"][0]["text"]

    assert echoed(truncate_prompt_tokens=-1).startswith(LONG_PROMPT)
    assert echoed(truncate_prompt_tokens=len(ids)).startswith(LONG_PROMPT)
    assert echoed(truncate_prompt_tokens=3).startswith(tokenizer.decode(ids[-3:]))
    assert not echoed(truncate_prompt_tokens=3).startswith(LONG_PROMPT)


def test_refused_fields_are_named_before_the_template_renders(app):  # noqa: F811
    client, _ = app
    body = chat(chat_template="{{ x }}", continue_final_message=True)
    assert_400(client.post("/v1/chat/completions", json=body), "chat_template")


def test_add_special_tokens_reaches_encode(app, monkeypatch):  # noqa: F811
    """Completions add the tokenizer's special tokens unless told not to; chat adds them only
    when asked (the template writes its own). A stand-in BOS makes them countable."""
    client, tokenizer = app
    _with_bos(tokenizer, monkeypatch)
    for route, body, default in (("/v1/completions", completion(), True),
                                 ("/v1/chat/completions", chat(), False)):
        counts = {flag: _usage_and_text(client, route, {**body, "add_special_tokens": flag})[0]
                  for flag in (False, True)}
        assert counts[True] == counts[False] + 1, route
        assert _usage_and_text(client, route, body)[0] == counts[default], route


@pytest.fixture
def template(app):  # noqa: F811
    """Set the tokenizer's chat template for one test."""
    _, tokenizer = app
    saved = tokenizer.chat_template

    def set_template(text: str):
        tokenizer.chat_template = text
        return tokenizer

    yield set_template
    tokenizer.chat_template = saved


def _rendered(tokenizer, **fields) -> str:
    return tokenizer.decode(chat_prompt(tokenizer, ChatCompletionRequest(**chat(**fields))))


def test_continue_final_message_leaves_the_last_message_open(app, template):  # noqa: F811
    """The final assistant message is continued, not closed; with add_generation_prompt also
    true it is a 400 (vLLM's)."""
    client, _ = app
    tokenizer = template(TOOL_TEMPLATE)
    turns = [{"role": "user", "content": "the"}, {"role": "assistant", "content": "quick"}]
    closed = _rendered(tokenizer, messages=turns, add_generation_prompt=False)
    opened = _rendered(tokenizer, messages=turns, add_generation_prompt=False,
                       continue_final_message=True)
    assert closed.endswith("quick;") and opened.endswith("quick"), (closed, opened)
    assert_400(client.post("/v1/chat/completions",
                           json=chat(messages=turns, continue_final_message=True)),
               "continue_final_message")


def test_documents_reach_the_template(app, template):  # noqa: F811
    tokenizer = template("{% for d in documents or [] %}[{{ d.text }}]{% endfor %}"
                         "{{ messages[0].content }}")
    assert _rendered(tokenizer).startswith("the paged")
    assert _rendered(tokenizer, documents=[{"text": "lazy"}]).startswith("[lazy]")


def test_tool_call_arguments_reach_the_template_as_objects(app, template):  # noqa: F811
    """JSON text arguments are parsed (vLLM), so `| tojson` renders them once; empty ones are
    {}; text that is not JSON is a 400 naming it."""
    client, _ = app
    tokenizer = template("{% for m in messages %}{% for c in m.tool_calls or [] %}"
                         "{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}")

    def turns(arguments):
        call = {"id": "c1", "type": "function", "function": {"name": "f",
                                                             "arguments": arguments}}
        return [{"role": "user", "content": "the"},
                {"role": "assistant", "content": None, "tool_calls": [call]}]

    assert _rendered(tokenizer, messages=turns('{"a": 1}')) == '{"a": 1}'
    assert _rendered(tokenizer, messages=turns("")) == "{}"
    assert_400(client.post("/v1/chat/completions", json=chat(messages=turns("{a"))),
               "messages.1.tool_calls.0.function.arguments")


@pytest.fixture
def defaults_app(model_with_defaults):  # noqa: F811
    llm = AsyncLLM(model_with_defaults, engine_process=False, device="cpu",
                   num_kvcache_blocks=4, max_model_len=MAX_MODEL_LEN)
    with TestClient(build_app(llm, "tiny")) as client:
        yield client


def test_unset_sampling_fields_take_the_models_defaults(defaults_app):
    """The checkpoint's top_k=1 (generation_config.json) makes a request without sampling
    fields greedy; a request's own top_k (0: off, as vLLM) wins."""
    client = defaults_app
    body = {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 8, "ignore_eos": True}

    def text(**fields) -> str:
        response = client.post("/v1/completions", json={**body, **fields})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    greedy = text(temperature=0)
    assert text() == greedy
    assert text(top_k=0, temperature=1.0, seed=3) != greedy

"""Every field of the request models works or is refused: the table, and the tests of the
fields that streaming, echo and vLLM's extensions add."""
import logging

import pytest

from nanovllm.serve.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
    TextPart,
)
from nanovllm.serve.openai.tool_calls import FunctionDefinition, Tool
from nanovllm.serve.openai.validation import REFUSED
from tests.serve.test_server_fields import app, chat, completion, events  # noqa: F401

# field -> "module::test" that shows it working
WORKS = {
    "model": "test_server::test_bad_requests_get_openai_errors",
    "prompt": "test_server::test_completions_equal_offline_streamed_and_not",
    "messages": "test_server::test_chat_completions_equal_offline_streamed_and_not",
    "messages.role": "test_server::test_chat_completions_equal_offline_streamed_and_not",
    "messages.content": "test_server_fields::test_text_parts_are_joined_with_newlines",
    "messages.content.type": "test_server_fields::test_text_parts_are_joined_with_newlines",
    "messages.content.text": "test_server_fields::test_text_parts_are_joined_with_newlines",
    "max_tokens": "test_server_fields::test_prompt_and_max_tokens_beyond_the_context_are_a_400",
    "max_completion_tokens": "test_server::test_chat_completions_equal_offline_streamed_and_not",
    "temperature": "test_server::test_completions_equal_offline_streamed_and_not",
    "top_p": "test_request_fields::test_filters_reach_the_sampler",
    "top_k": "test_request_fields::test_filters_reach_the_sampler",
    "min_p": "test_request_fields::test_filters_reach_the_sampler",
    "n": "test_server_choices::test_n_seeded_completions_equal_offline_streamed_and_not",
    "seed": "test_server_choices::test_n_seeded_completions_equal_offline_streamed_and_not",
    "stream": "test_server::test_completions_equal_offline_streamed_and_not",
    "stream_options": "test_server::test_completions_equal_offline_streamed_and_not",
    "stream_options.include_usage": "test_server::test_completions_equal_offline_streamed_and_not",
    "stream_options.continuous_usage_stats": "test_request_fields::test_continuous_usage_stats",
    "stop": "test_server::test_stop_string_is_cut_from_the_stream",
    "include_stop_str_in_output":
        "test_server::test_include_stop_str_in_output_keeps_the_stop_string",
    "presence_penalty": "test_server::test_penalties_reach_the_sampler",
    "frequency_penalty": "test_server::test_penalties_reach_the_sampler",
    "repetition_penalty": "test_server::test_penalties_reach_the_sampler",
    "ignore_eos": "test_server::test_special_tokens_are_skipped_unless_asked",
    "stop_token_ids": "test_server_fields::test_the_stop_token_text_is_left_out",
    "skip_special_tokens": "test_server::test_special_tokens_are_skipped_unless_asked",
    "logprobs": "test_server_choices::test_completions_logprobs_equal_offline_streamed_and_not",
    "top_logprobs": "test_server_choices::test_chat_logprobs_equal_offline_streamed_and_not",
    "echo": "test_request_fields::test_echo_streams_the_prompt_first",
    "prompt_logprobs": "test_request_fields::test_prompt_logprobs_as_vllm_returns_them",
    "logit_bias": "test_server_steering::test_logit_bias_of_100_gives_its_token",
    "min_tokens": "test_server_steering::test_min_tokens_holds_back_stop_token_ids",
    "allowed_token_ids": "test_server_steering::test_allowed_token_ids_and_bad_words_equal_offline",
    "bad_words": "test_server_steering::test_allowed_token_ids_and_bad_words_equal_offline",
    "response_format": "test_server_structured::test_json_schema_output_validates",
    "structured_outputs": "test_server_structured::test_structured_outputs_field",
    "tools": "test_tool_calls::test_required_tool_call_arguments_follow_the_schema",
    "tool_choice": "test_tool_calls::test_named_tool_choice_calls_that_tool",
    "tools.type": "test_tool_calls::test_required_tool_call_arguments_follow_the_schema",
    "tools.function": "test_tool_calls::test_required_tool_call_arguments_follow_the_schema",
    "tools.function.name": "test_tool_calls::test_named_tool_choice_calls_that_tool",
    "tools.function.description": "test_tool_calls::test_tools_reach_the_chat_template",
    "tools.function.parameters":
        "test_tool_calls::test_required_tool_call_arguments_follow_the_schema",
    # enforced where a grammar makes the call; with "auto" a 400 (test_bad_tools_are_400s...)
    "tools.function.strict":
        "test_tool_calls::test_strict_tools_are_served_where_nothing_or_the_grammar_calls",
    "parallel_tool_calls":
        "test_tool_calls::test_required_without_parallel_tool_calls_makes_one_call",
    "messages.name": "test_request_fields::test_tool_fields_of_messages_reach_the_template",
    "messages.tool_calls": "test_request_fields::test_tool_fields_of_messages_reach_the_template",
    "messages.tool_call_id":
        "test_request_fields::test_tool_fields_of_messages_reach_the_template",
    "add_generation_prompt": "test_request_fields::test_template_options_reach_the_template",
    "chat_template_kwargs": "test_request_fields::test_template_options_reach_the_template",
    "continue_final_message":
        "test_request_prompt_options::test_continue_final_message_leaves_the_last_message_open",
    "documents": "test_request_prompt_options::test_documents_reach_the_template",
    "add_special_tokens": "test_request_prompt_options::test_add_special_tokens_reaches_encode",
    "truncate_prompt_tokens":
        "test_request_prompt_options::test_truncate_prompt_tokens_keeps_the_last_tokens",
}
# field -> a value it refuses with a 400 naming it
REFUSED_VALUES = {"suffix": "!", "best_of": 2, "use_beam_search": True, "length_penalty": 0.5,
                  "spaces_between_special_tokens": False,
                  "return_tokens_as_token_ids": True, "return_token_ids": True, "priority": 1,
                  "cache_salt": "salt", "guided_json": {"type": "object"},
                  "guided_regex": "a+", "guided_choice": ["a"], "guided_grammar": 'root ::= "a"',
                  "chat_template": "{{ messages[0].content }}"}
NESTED = {"messages": ChatMessage, "messages.content": TextPart, "stream_options": StreamOptions,
          "tools": Tool, "tools.function": FunctionDefinition}


def field_names(model, prefix: str = "") -> set[str]:
    """Every field of a request model, nested models' as dotted paths."""
    names = set()
    for name in model.model_fields:
        path = f"{prefix}{name}"
        names.add(path)
        if path in NESTED:
            names |= field_names(NESTED[path], f"{path}.")
    return names


def test_every_field_works_or_is_refused():
    tables = (set(WORKS), set(REFUSED_VALUES))
    for name in field_names(CompletionRequest) | field_names(ChatCompletionRequest):
        assert sum(name in table for table in tables) == 1, name
    assert set(REFUSED_VALUES) == set(REFUSED)
    for test in WORKS.values():  # the tests named exist
        module, function = test.split("::")
        assert hasattr(__import__(f"tests.serve.{module}", fromlist=[function]), function), test


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field", sorted(REFUSED_VALUES))
def test_refused_fields_are_400s_naming_them(app, route, field):  # noqa: F811
    client, _ = app
    request = ChatCompletionRequest if "chat" in route else CompletionRequest
    if field not in request.model_fields:
        pytest.skip(f"{field} is not a field of {request.__name__}")
    body = (chat if "chat" in route else completion)(**{field: REFUSED_VALUES[field]})
    response = client.post(route, json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == field
    for value in REFUSED[field]:  # e.g. best_of=1, OpenAI's default
        neutral = client.post(route, json={**body, field: value})
        assert neutral.status_code == 200, neutral.text


def test_chat_echo_is_refused(app):  # noqa: F811
    """echo is a completions field (the prompt leads the text); a chat request's is a 400."""
    client, _ = app
    response = client.post("/v1/chat/completions", json=chat(echo=True))
    assert response.status_code == 400 and response.json()["error"]["param"] == "echo"
    assert client.post("/v1/chat/completions", json=chat(echo=False)).status_code == 200


@pytest.mark.parametrize("route, field", [
    ("/v1/completions", "n"), ("/v1/completions", "stream"), ("/v1/completions", "echo"),
    ("/v1/completions", "best_of"), ("/v1/chat/completions", "n"),
    ("/v1/chat/completions", "stream"), ("/v1/chat/completions", "logprobs")])
def test_null_fields_take_their_defaults(app, route, field):  # noqa: F811
    """OpenAI documents these as nullable: null is the default (as vLLM takes it)."""
    client, _ = app
    body = (chat if "chat" in route else completion)()
    expected = client.post(route, json=body).json()["choices"]
    response = client.post(route, json={**body, field: None})
    assert response.status_code == 200, response.text
    assert response.json()["choices"] == expected


def _prompt_tokens(client, body: dict) -> int:
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


# renders an assistant's tool calls and a tool result's call id and name, as Qwen3's does
# (tersely: the app's context is 64 tokens)
TOOL_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments }}"
    "{% endfor %}{% if m.tool_call_id %}{{ m.tool_call_id }}{% endif %}"
    "{% if m.name %}{{ m.name }}{% endif %};{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
    "{% if enable_thinking is false %}no thinking{% endif %}")


@pytest.fixture
def tool_template(app):  # noqa: F811
    _, tokenizer = app
    template, tokenizer.chat_template = tokenizer.chat_template, TOOL_TEMPLATE
    yield
    tokenizer.chat_template = template


def test_tool_fields_of_messages_reach_the_template(app, tool_template):  # noqa: F811
    """An assistant's tool_calls and a result's tool_call_id and name are what the template
    renders of a tool conversation: each one lengthens the prompt it renders."""
    client, _ = app
    call = {"id": "c1", "type": "function", "function": {"name": "paged", "arguments": "{}"}}
    turns = [{"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "name": "paged", "content": "the"}]
    full = _prompt_tokens(client, chat(messages=turns, max_tokens=1))
    for field in ("tool_calls", "tool_call_id", "name"):
        fewer = [{k: v for k, v in t.items() if k != field} for t in turns]
        assert _prompt_tokens(client, chat(messages=fewer, max_tokens=1)) < full, field


def test_template_options_reach_the_template(app, tool_template):  # noqa: F811
    """add_generation_prompt=false leaves the assistant's header out; chat_template_kwargs are
    the template's variables (Qwen3's enable_thinking) and override the request's options; one
    that sets the template or the call's own arguments is a 400."""
    client, _ = app
    plain = _prompt_tokens(client, chat())
    assert _prompt_tokens(client, chat(add_generation_prompt=False)) < plain
    thinking_off = chat(chat_template_kwargs={"enable_thinking": False})
    assert _prompt_tokens(client, thinking_off) > plain
    # over the request's own options (vLLM's order)
    assert _prompt_tokens(client, chat(chat_template_kwargs={"add_generation_prompt": False})) \
        < plain
    for key in ("tokenize", "chat_template", "conversation", "return_dict"):  # the call's
        clash = client.post("/v1/chat/completions",
                            json=chat(chat_template_kwargs={key: "x"}))
        assert clash.status_code == 400, key
        assert clash.json()["error"]["param"] == "chat_template_kwargs", clash.json()


@pytest.mark.parametrize("fields", [dict(top_k=1), dict(top_p=1e-9), dict(min_p=1.0)])
def test_filters_reach_the_sampler(app, fields):  # noqa: F811
    """Each filter, set to keep only the top token, turns sampling at temperature 1 greedy."""
    client, _ = app
    greedy = client.post("/v1/completions", json=completion(max_tokens=16, ignore_eos=True))
    body = completion(max_tokens=16, ignore_eos=True, temperature=1.0, seed=1)
    free = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    kept = client.post("/v1/completions", json={**body, **fields}).json()["choices"][0]["text"]
    assert kept == greedy.json()["choices"][0]["text"] != free


def test_echo_streams_the_prompt_first(app):  # noqa: F811
    """As vLLM: each choice's first chunk starts with its prompt; the pieces add up to the
    text of the same request not streamed. Echo with logprobs is not streamed (a 400)."""
    client, _ = app
    body = completion(["hello world the", "the quick brown"], echo=True, n=2)
    whole = client.post("/v1/completions", json=body).json()["choices"]
    pieces, firsts = {}, {}
    for event in events(client, "/v1/completions", body):
        for choice in event["choices"]:
            firsts.setdefault(choice["index"], choice["text"])
            pieces[choice["index"]] = pieces.get(choice["index"], "") + choice["text"]
    assert [pieces[i] for i in range(4)] == [c["text"] for c in whole]
    assert all(firsts[i].startswith("hello world the") for i in (0, 1))
    assert all(firsts[i].startswith("the quick brown") for i in (2, 3))
    response = client.post("/v1/completions", json={**body, "stream": True, "logprobs": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "echo"


def test_prompt_logprobs_as_vllm_returns_them(app):  # noqa: F811
    """Completions: in each choice; chat: beside the choices. The first entry is None; the
    prompt's own token is in each entry, scored as echo's logprobs score it."""
    client, _ = app
    prompt = [5, 17, 42, 99, 3]
    body = completion(prompt, prompt_logprobs=2, echo=True, logprobs=2, max_tokens=1, n=2)
    choices = client.post("/v1/completions", json=body).json()["choices"]
    for choice in choices:
        entries = choice["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(prompt)
        for token, entry, echoed in zip(prompt[1:], entries[1:],
                                        choice["logprobs"]["token_logprobs"][1:]):
            assert 2 <= len(entry) <= 3 and entry[str(token)]["logprob"] == echoed
            ranks = sorted(e["rank"] for e in entry.values() if e["rank"] is not None)
            assert ranks == [1, 2] and all(e["decoded_token"] is not None
                                           for e in entry.values())
    assert choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
    assert "prompt_logprobs" not in client.post("/v1/completions", json=completion(
        prompt)).json()["choices"][0]
    answer = client.post("/v1/chat/completions", json=chat(prompt_logprobs=0)).json()
    assert answer["prompt_logprobs"][0] is None
    assert len(answer["prompt_logprobs"]) == answer["usage"]["prompt_tokens"]
    for value, stream in ((-1, False), (21, False), (1, True)):
        response = client.post("/v1/completions", json=completion(
            prompt, prompt_logprobs=value, stream=stream))
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "prompt_logprobs"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats(app, route):  # noqa: F811
    """Every chunk carries its choice's usage so far; include_usage's last chunk the total."""
    client, _ = app
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = (chat if "chat" in route else completion)(stream_options=options, max_tokens=6)
    got = events(client, route, body)
    assert all("usage" in event for event in got)
    counts = [event["usage"]["completion_tokens"] for event in got[:-1]]
    assert counts == sorted(counts) and counts[-1] == got[-1]["usage"]["completion_tokens"]
    assert got[-1]["choices"] == []
    plain = events(client, route, {**body, "stream_options": {"include_usage": True}})
    assert all("usage" not in event for event in plain[:-1])
    alone = events(client, route, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in event for event in alone)  # it needs include_usage (vLLM)


def test_plain_text_response_format_is_served(app):  # noqa: F811
    client, _ = app
    response = client.post("/v1/chat/completions", json=chat(response_format={"type": "text"}))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_fields_are_ignored_and_named_in_the_log(app, route, caplog):  # noqa: F811
    """As vLLM: a request with fields no field reads is served, and the log names them, nested
    ones by their path (a misspelt `temprature` or `paramters` would otherwise change nothing
    without a word)."""
    client, _ = app
    fields = dict(temprature=0.5, user="me", response_format={"type": "text", "strict": True})
    ignored = ["response_format.strict", "temprature", "user"]
    if "chat" in route:
        tool = {"type": "function", "function": {"name": "f", "paramters": {}}}
        fields.update(messages=[{"role": "user", "content": "hi", "nmae": "x"}], tools=[tool])
        ignored = sorted([*ignored, "messages.0.nmae", "tools.0.function.paramters"])
    body = (chat if "chat" in route else completion)(**fields)
    with caplog.at_level(logging.WARNING, logger="nanovllm.serve.openai.serving"):
        response = client.post(route, json=body)
    assert response.status_code == 200, response.text
    assert f"present in the request but ignored: {ignored}" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nanovllm.serve.openai.serving"):
        assert client.post(route, json=(chat if "chat" in route else completion)()).is_success
    assert "ignored" not in caplog.text

"""tools and tool_choice: the Hermes parser on given strings, and forced calls through the
in-process app whose arguments follow the tool's schema."""
import json

import jsonschema
import pytest

from nanovllm.serve.openai.chat_template import chat_prompt
from nanovllm.serve.openai.protocol import ChatCompletionRequest
from nanovllm.serve.openai.tool_calls import output_parser, parse_hermes
from tests.serve.test_server_structured import chat, sapp  # noqa: F401

WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Lima"]}, "metric": {"type": "boolean"}},
    "required": ["city", "metric"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "description": "the time",
                                           "parameters": CLOCK}}]
SCHEMAS = {"weather": WEATHER, "clock": CLOCK}


def test_hermes_valid_call_with_text_around():
    text = ('Let me look. <tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call> Done.')
    content, calls = parse_hermes(text)
    assert content == "Let me look.  Done."
    assert len(calls) == 1 and calls[0]["id"].startswith("call_")
    assert calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}


def test_hermes_invalid_json_stays_text():
    text = 'x <tool_call>{"name": "weather", "arguments": {</tool_call>'
    assert parse_hermes(text) == (text, [])
    assert parse_hermes("no calls here") == ("no calls here", [])


def test_hermes_several_calls_an_unclosed_one_and_a_bad_one():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
            '<tool_call>[1]</tool_call>'
            '<tool_call>{"name": "b", "arguments": {"x": 1}}')
    content, calls = parse_hermes(text)
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert calls[1]["function"]["arguments"] == '{"x": 1}'
    assert content == "<tool_call>[1]</tool_call>"
    assert len({c["id"] for c in calls}) == 2


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call> and '
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert len(output_parser("auto")(text)[1]) == 2
    content, calls = output_parser("auto", parallel=False)(text)
    assert [c["function"]["name"] for c in calls] == ["a"] and content == "and"
    required = '[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {}}]'
    assert len(output_parser("required", parallel=False)(required)[1]) == 1


def assert_tool_calls(response, names: set[str]) -> list[dict]:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    message = choice["message"]
    assert message["content"] is None and message["tool_calls"], message
    for call in message["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] in names
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, SCHEMAS[call["function"]["name"]])
    return message["tool_calls"]


@pytest.mark.parametrize("seed", range(3))
def test_required_tool_call_arguments_follow_the_schema(sapp, seed):  # noqa: F811
    response = sapp.post("/v1/chat/completions", json=chat(
        tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, max_tokens=200))
    assert_tool_calls(response, {"weather", "clock"})


def test_required_without_parallel_tool_calls_makes_one_call(sapp):  # noqa: F811
    """parallel_tool_calls=false: the grammar's list holds one call (the random model, left
    free, calls several)."""
    body = chat(tools=TOOLS, tool_choice="required", temperature=2.0, seed=0, max_tokens=400,
                n=8)
    free = sapp.post("/v1/chat/completions", json=body).json()["choices"]
    assert max(len(c["message"]["tool_calls"]) for c in free) > 1
    one = sapp.post("/v1/chat/completions", json={**body, "parallel_tool_calls": False})
    assert one.status_code == 200, one.text
    assert all(len(c["message"]["tool_calls"]) == 1 for c in one.json()["choices"])


@pytest.mark.parametrize("choice", ["none", "required", {"type": "function",
                                                         "function": {"name": "clock"}}])
def test_strict_tools_are_served_where_nothing_or_the_grammar_calls(sapp, choice):  # noqa: F811
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    response = sapp.post("/v1/chat/completions", json=chat(tools=strict, tool_choice=choice))
    assert response.status_code == 200, response.text


def test_named_tool_choice_calls_that_tool(sapp):  # noqa: F811
    choice = {"type": "function", "function": {"name": "clock"}}
    response = sapp.post("/v1/chat/completions", json=chat(tools=TOOLS, tool_choice=choice))
    calls = assert_tool_calls(response, {"clock"})
    assert len(calls) == 1


@pytest.mark.parametrize("choice", ["none", "auto"])
def test_none_and_auto_leave_the_output_free(sapp, choice):  # noqa: F811
    """The tools reach the chat template; a random model writes no <tool_call> block."""
    response = sapp.post("/v1/chat/completions", json=chat(tools=TOOLS, tool_choice=choice))
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert isinstance(message["content"], str) and not message.get("tool_calls")


@pytest.mark.parametrize("fields, param", [
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]),
     "tools.0.function.name"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
     "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", stream=True), "tools"),
    # "auto"'s calls are free text: strict cannot hold (the default choice with tools)
    (dict(tools=[TOOLS[0], {"type": "function", "function": {"name": "f", "strict": True}}]),
     "tools.1.function.strict"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "strict": True}}],
          tool_choice="auto"), "tools.0.function.strict"),
    (dict(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "nosuchtype"}}}], tool_choice="required"),
     "tool_choice"),
])
def test_bad_tools_are_400s_naming_the_field(sapp, fields, param):  # noqa: F811
    response = sapp.post("/v1/chat/completions", json=chat(**fields))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_tools_reach_the_chat_template():
    """The tiny model's template ignores tools: a stub tokenizer records what it was given."""
    seen = {}

    class Tokenizer:
        chat_template = "stub"

        def apply_chat_template(self, messages, **kwargs):
            seen.update(kwargs)
            return "text"

        def encode(self, text, add_special_tokens):
            return [1]

    body = ChatCompletionRequest(**chat(tools=TOOLS, tool_choice="auto"))
    assert chat_prompt(Tokenizer(), body) == [1]
    assert seen["tools"] == TOOLS

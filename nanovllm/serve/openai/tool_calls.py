"""OpenAI's tools and tool_choice: the grammar a forced call follows, and the tool_calls read
back from the output (a forced call's JSON, or Hermes `<tool_call>` blocks for "auto").

    "none"      free text, returned as content
    "auto"      free text; each valid <tool_call>{"name", "arguments"}</tool_call> is a call
    "required"  JSON: [{"name": one of the tools, "parameters": its schema}, ...] (vLLM's shape)
    named       JSON: the named function's arguments

parallel_tool_calls=false keeps one call: "required"'s list holds one, "auto" keeps the first.
"""
import json
import re
from collections.abc import Callable
from functools import partial
from typing import Literal
from uuid import uuid4

from pydantic import BaseModel, ConfigDict

from nanovllm.serve.openai.validation import FieldError

# Strict: no bool for a number, no string for an int (a float field still takes an int). A
# body, and each object in it, keeps the keys no field reads, so that the server can name them
# (validation.unknown_fields, as vLLM). The request models share it.
STRICT = ConfigDict(extra="allow", strict=True)
TOOL_CHOICES = ("none", "auto", "required")
# vLLM's hermes parser: a closed block, or one the output ended inside
HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
ANY_OBJECT = {"type": "object"}  # the arguments of a function that declares no parameters


class FunctionDefinition(BaseModel):
    model_config = STRICT

    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    # a forced call conforms anyway; true with "auto" is refused (nothing makes free text conform)
    strict: bool | None = None


class Tool(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def resolve_tool_choice(tools: list[Tool] | None, choice: ToolChoice | None) -> ToolChoice:
    """The choice in force ("auto" with tools, "none" without: OpenAI's defaults); a choice
    that needs tools, or names one not among them, is a FieldError, as is a strict tool under
    "auto" (its calls are free text, which nothing makes follow the schema)."""
    if choice is None:
        choice = "auto" if tools else "none"
    elif choice != "none" and not tools:
        raise FieldError("tool_choice", f"tool_choice={_describe(choice)} needs `tools`")
    if isinstance(choice, NamedToolChoice) and _function(tools, choice.function.name) is None:
        raise FieldError("tool_choice", f"tool_choice names {choice.function.name!r}, which is "
                                        f"not among the tools")
    strict = next((i for i, t in enumerate(tools or ()) if t.function.strict), None)
    if choice == "auto" and strict is not None:
        raise FieldError(f"tools.{strict}.function.strict", (
            f"tools.{strict}.function.strict=true is enforced only with tool_choice "
            f"\"required\" or a named function; with \"auto\" the calls are free text: set "
            f"strict to false or force the call"))
    return choice


def tool_schema(tools: list[Tool] | None, choice: ToolChoice,
                parallel: bool = True) -> dict | None:
    """The JSON schema a forced call's output follows, None when the output is free; not
    `parallel`, "required"'s list holds one call."""
    if isinstance(choice, NamedToolChoice):
        return _arguments_schema(_function(tools, choice.function.name))
    if choice != "required":
        return None
    calls = [{"type": "object", "properties": {
        "name": {"enum": [tool.function.name]},
        "parameters": _arguments_schema(tool.function)},
        "required": ["name", "parameters"], "additionalProperties": False} for tool in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return schema if parallel else {**schema, "maxItems": 1}


def output_parser(choice: ToolChoice, parallel: bool = True
                  ) -> Callable[[str], tuple[str | None, list[dict]]] | None:
    """text -> (content, tool_calls) for the choice in force, None when there are no tools;
    not `parallel`, the first call alone (vLLM's parallel_tool_calls=false)."""
    if isinstance(choice, NamedToolChoice):
        return partial(parse_named, choice.function.name)
    parse = {"auto": parse_hermes, "required": parse_required}.get(choice)
    return parse if parse is None or parallel else partial(_first_call, parse)


def _first_call(parse: Callable[[str], tuple[str | None, list[dict]]],
                text: str) -> tuple[str | None, list[dict]]:
    content, calls = parse(text)
    return content, calls[:1]


def template_tool(tool: Tool) -> dict:
    """A tool as the chat template reads it: its declared fields, not the unknown ones."""
    function = tool.function.model_dump(include=set(FunctionDefinition.model_fields),
                                        exclude_none=True)
    return {"type": tool.type, "function": function}


def parse_named(name: str, text: str) -> tuple[str | None, list[dict]]:
    """A named call's output is its arguments; text that is not JSON (cut by max_tokens)
    stays content."""
    if _load(text) is None:
        return text, []
    return None, [tool_call(name, text)]


def parse_required(text: str) -> tuple[str | None, list[dict]]:
    """vLLM's "required" output: a JSON list of {"name", "parameters"}."""
    calls = _load(text)
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        return text, []
    return None, [tool_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                  for c in calls]


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """Hermes blocks `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (vLLM's hermes
    parser): each valid one is a call; the text around them, and blocks that are not a JSON
    call, stay content (None when nothing is left)."""
    calls, kept, end = [], [], 0
    for match in HERMES_BLOCK.finditer(text):
        body = _load((match.group(1) or match.group(2) or "").strip())
        if not (isinstance(body, dict) and isinstance(body.get("name"), str)
                and isinstance(body.get("arguments", {}), dict)):
            continue  # not a call: its text stays
        kept.append(text[end:match.start()])
        end = match.end()
        arguments = json.dumps(body.get("arguments", {}), ensure_ascii=False)
        calls.append(tool_call(body["name"], arguments))
    content = ("".join(kept) + text[end:]).strip() if calls else text
    return content or None, calls


def tool_call(name: str, arguments: str) -> dict:
    """OpenAI's tool call object; `arguments` is JSON text."""
    return {"id": f"call_{uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _function(tools: list[Tool] | None, name: str) -> FunctionDefinition | None:
    return next((t.function for t in tools or [] if t.function.name == name), None)


def _arguments_schema(function: FunctionDefinition) -> dict:
    return function.parameters or ANY_OBJECT


def _load(text: str) -> object | None:
    """The JSON value of `text`, None when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def _describe(choice: ToolChoice) -> str:
    return repr(choice) if isinstance(choice, str) else repr(choice.model_dump())

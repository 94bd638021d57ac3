"""response_format and structured_outputs against the in-process app: the output follows the
constraint, and a bad one is a 400 naming its field."""
import json

import jsonschema
import pytest
from fastapi.testclient import TestClient

from nanovllm.serve.async_llm import AsyncLLM
from nanovllm.serve.openai.app import build_app
from tests.serve.conftest import API_KEY

# Every value is bounded, so a random model ends the object within a few tokens.
SCHEMA = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Lima"]}, "sunny": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["city", "sunny", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def sapp(tiny_model):
    """A client of the app over a thread engine with room for JSON."""
    llm = AsyncLLM(tiny_model, engine_process=False, device="cpu", num_kvcache_blocks=16,
                   max_model_len=512)
    with TestClient(build_app(llm, "tiny")) as client:
        yield client


def chat(**fields) -> dict:
    messages = [{"role": "user", "content": "the weather as JSON"}]
    return {"model": "tiny", "messages": messages, "max_tokens": 64, "temperature": 0,
            **fields}


def content(client: TestClient, body: dict) -> str:
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return choice["message"]["content"]


def test_json_schema_output_validates(sapp):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA,
                                                  "strict": True}}
    for seed in range(3):
        text = content(sapp, chat(response_format=fmt, temperature=1.0, seed=seed))
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_output_is_an_object(sapp):
    text = content(sapp, chat(response_format={"type": "json_object"}, max_tokens=200))
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("extra, check", [
    ({"regex": "[ab]{3}"}, lambda t: len(t) == 3 and set(t) <= {"a", "b"}),
    ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"grammar": 'root ::= "x" | "y"'}, lambda t: t in ("x", "y")),
])
def test_structured_outputs_field(sapp, extra, check):
    assert check(content(sapp, chat(structured_outputs=extra)))
    response = sapp.post("/v1/completions", json={
        "model": "tiny", "prompt": "a", "max_tokens": 64, "structured_outputs": extra})
    assert response.status_code == 200 and check(response.json()["choices"][0]["text"])


@pytest.mark.parametrize("fields, param", [
    (dict(response_format={"type": "xml"}), "response_format"),
    (dict(response_format={"type": "json_schema"}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": 3}}),
     "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "w", "schema": {"type": "nosuchtype"}}}), "response_format"),
    (dict(structured_outputs={"regex": "("}), "structured_outputs"),
    (dict(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs"),
    (dict(structured_outputs={"pattern": "a"}), "structured_outputs"),
    (dict(structured_outputs={"regex": "a"}, response_format={"type": "json_object"}),
     "structured_outputs"),
])
def test_bad_constraints_are_400s_naming_the_field(sapp, fields, param):
    response = sapp.post("/v1/chat/completions", json=chat(**fields))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_text_with_structured_outputs_is_fine(sapp):
    body = chat(response_format={"type": "text"}, structured_outputs={"choice": ["z"]})
    assert content(sapp, body) == "z"


def test_the_openai_sdk_parses_into_a_pydantic_model(server):
    """client.chat.completions.parse(response_format=Model) against `python -m nanovllm.serve`
    (the engine in its own process)."""
    openai = pytest.importorskip("openai")
    from pydantic import BaseModel

    class Weather(BaseModel):
        sunny: bool
        rain: bool

    sdk = openai.OpenAI(base_url=f"{server[0]}/v1", api_key=API_KEY, max_retries=0)
    answer = sdk.chat.completions.parse(model="tiny", messages=[
        {"role": "user", "content": "weather?"}], response_format=Weather, max_tokens=32,
        temperature=0)
    assert isinstance(answer.choices[0].message.parsed, Weather)
    tools = [{"type": "function", "function": {"name": "weather",
                                               "parameters": Weather.model_json_schema()}}]
    called = sdk.chat.completions.create(model="tiny", messages=[
        {"role": "user", "content": "weather?"}], tools=tools, tool_choice="required",
        temperature=0, max_tokens=200)
    call = called.choices[0].message.tool_calls[0]
    assert call.function.name == "weather"
    Weather.model_validate_json(call.function.arguments)
    with pytest.raises(openai.BadRequestError) as bad:  # a 400 from the server process
        sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                    extra_body={"structured_outputs": {"regex": "("}})
    assert bad.value.body["param"] == "structured_outputs"

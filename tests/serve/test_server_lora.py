"""LoRA over HTTP: --lora-modules, the request's `model` picks the adapter, /v1/models lists
adapters with their parent, vLLM's load/unload routes (FastAPI's TestClient, in-thread engine)."""
import logging

import pytest
from fastapi.testclient import TestClient

from nanovllm import LLM, SamplingParams
from nanovllm.lora import LoRARequest
from nanovllm.serve.__main__ import parse_args
from nanovllm.serve.async_llm import AsyncLLM
from nanovllm.serve.openai.app import build_app
from nanovllm.serve.openai.lora_modules import parse_lora_modules
from tests.lora.conftest import adapters  # noqa: F401 (the session's adapters fixture)

PROMPT = [5, 17, 23, 42, 99]


@pytest.fixture(scope="module")
def expected(tiny_model, adapters) -> dict[str, str]:  # noqa: F811
    """Offline greedy texts: the base and two adapters."""
    llm = LLM(tiny_model, enable_lora=True, max_loras=2, max_lora_rank=8, num_kvcache_blocks=8)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    try:
        return {name: llm.generate([PROMPT], params, use_tqdm=False, lora_request=None if name
                                   == "tiny" else LoRARequest(name, i + 1, adapters[name]))
                [0]["text"] for i, name in enumerate(["tiny", "all_r4", "mlp_r4"])}
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def client(tiny_model, adapters):  # noqa: F811
    llm = AsyncLLM(tiny_model, engine_process=False, device="cpu", num_kvcache_blocks=8,
                   enable_lora=True, max_loras=2, max_lora_rank=8)
    with TestClient(build_app(llm, "tiny", lora_modules={"all_r4": adapters["all_r4"]})) as c:
        yield c


def complete(client: TestClient, model: str) -> tuple[int, dict]:
    response = client.post("/v1/completions", json=dict(
        model=model, prompt=PROMPT, max_tokens=5, temperature=0, ignore_eos=True))
    return response.status_code, response.json()


def text(body: dict) -> str:
    return body["choices"][0]["text"]


def test_model_selects_the_adapter_and_models_lists_it(client, expected):
    assert len(set(expected.values())) == 3  # each adapter changes the text: checks have teeth
    cards = client.get("/v1/models").json()["data"]
    assert [(c["id"], c.get("parent")) for c in cards] == [("tiny", None), ("all_r4", "tiny")]
    assert client.get("/v1/models/all_r4").json()["parent"] == "tiny"
    for model in ("tiny", "all_r4"):
        status, body = complete(client, model)
        assert status == 200 and text(body) == expected[model], model
    status, body = complete(client, "nope")
    assert status == 404 and body["error"]["param"] == "model"


def test_load_and_unload_at_run_time(client, adapters, expected, tmp_path):  # noqa: F811
    load = client.post("/v1/load_lora_adapter",
                       json={"lora_name": "mlp_r4", "lora_path": adapters["mlp_r4"]})
    assert load.status_code == 200, load.text
    status, body = complete(client, "mlp_r4")
    assert status == 200 and text(body) == expected["mlp_r4"]
    again = client.post("/v1/load_lora_adapter",
                        json={"lora_name": "mlp_r4", "lora_path": adapters["mlp_r4"]})
    assert again.status_code == 400 and "already served" in again.json()["error"]["message"]
    bad = client.post("/v1/load_lora_adapter",
                      json={"lora_name": "x", "lora_path": str(tmp_path / "missing")})
    assert bad.status_code == 400 and "does not exist" in bad.json()["error"]["message"]
    big = client.post("/v1/load_lora_adapter",
                      json={"lora_name": "big", "lora_path": adapters["attn_r8"]})
    assert big.status_code == 200  # rank 8 = max_lora_rank
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "mlp_r4"}).status_code == 200
    assert complete(client, "mlp_r4")[0] == 404
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "mlp_r4"}).status_code == 404


def test_unknown_fields_of_the_adapter_routes_are_named_in_the_log(client, caplog):
    """As on the generation routes: a field the route does not read is named in the log."""
    with caplog.at_level(logging.WARNING, logger="nanovllm.serve.openai.serving"):
        response = client.post("/v1/unload_lora_adapter",
                               json={"lora_name": "nope", "lora_path": "/x"})
    assert response.status_code == 404
    assert "present in the request but ignored: ['lora_path']" in caplog.text


def test_lora_options_parse(tmp_path):
    args = parse_args(["/m", "--enable-lora", "--max-loras", "3", "--lora-modules",
                       f"a={tmp_path}", f"b={tmp_path}"])
    assert args.enable_lora and args.max_loras == 3
    assert parse_lora_modules(args.lora_modules) == {"a": str(tmp_path), "b": str(tmp_path)}
    with pytest.raises(ValueError, match="expected name=path"):
        parse_lora_modules(["novalue"])

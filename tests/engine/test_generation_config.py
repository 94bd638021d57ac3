"""generation_config.json's sampling fields as the defaults of requests that leave them unset
(vLLM's generation_config="auto"), offline and on the server."""
import json
import shutil

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.utils.generation_config import sampling_defaults

PROMPTS = ["the quick brown", [5, 6, 7, 8]]


@pytest.fixture(scope="module")
def model_with_defaults(tiny_model, tmp_path_factory) -> str:
    """The tiny checkpoint with top_k=1 (greedy whatever the temperature) in its
    generation_config.json, beside what the file already held."""
    path = tmp_path_factory.mktemp("generation_config") / "model"
    shutil.copytree(tiny_model, path)
    file = path / "generation_config.json"
    held = json.loads(file.read_text()) if file.exists() else {}
    file.write_text(json.dumps({**held, "do_sample": True, "temperature": 0.7, "top_k": 1,
                                "max_new_tokens": 3}))
    return str(path)


def test_sampling_defaults_read_the_sampling_fields_only(model_with_defaults, tiny_model,
                                                         tmp_path):
    assert sampling_defaults(model_with_defaults, "auto") == {"temperature": 0.7, "top_k": 1}
    assert sampling_defaults(model_with_defaults, "vllm") == {}
    assert sampling_defaults(tiny_model, model_with_defaults) == {"temperature": 0.7, "top_k": 1}
    for bad in (str(tmp_path), 3):  # a folder without the file; not a name
        with pytest.raises(ValueError, match="^generation_config=.* is invalid"):
            sampling_defaults(tiny_model, bad)


def test_a_bad_default_is_refused_before_loading(model_with_defaults, tmp_path):
    path = tmp_path / "bad"
    shutil.copytree(model_with_defaults, path)
    (path / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    with pytest.raises(ValueError, match="generation_config.json's sampling defaults: top_p"):
        LLM(str(path), num_kvcache_blocks=16)


def _tokens(outputs) -> list[list[int]]:
    return [out["token_ids"] for out in outputs]


def test_generate_without_params_takes_the_models_defaults(model_with_defaults):
    """Without SamplingParams: top_k=1 from the file makes sampling at temperature 0.7 greedy;
    generation_config="vllm" leaves SamplingParams' own defaults."""
    llm = LLM(model_with_defaults, num_kvcache_blocks=16)
    try:
        params = llm.get_default_sampling_params()
        assert (params.temperature, params.top_k, params.max_tokens) == (0.7, 1, 64)
        greedy = SamplingParams(temperature=0, max_tokens=64)
        assert _tokens(llm.generate(PROMPTS, use_tqdm=False)) == \
            _tokens(llm.generate(PROMPTS, greedy, use_tqdm=False))
    finally:
        llm.shutdown()
    llm = LLM(model_with_defaults, num_kvcache_blocks=16, generation_config="vllm")
    try:
        assert vars(llm.get_default_sampling_params()) == vars(SamplingParams())
    finally:
        llm.shutdown()

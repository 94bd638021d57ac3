"""LoRA on CPU, float32: greedy tokens equal transformers + peft, alone and in mixed batches."""
import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.lora import LoRARequest
from tests.lora.helpers import build_adapter, peft_greedy
from tests.reference import ids, token_prompts

NUM_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
PROMPTS = token_prompts(0, (5, 17, 40))


def lora(adapters: dict[str, str], name: str) -> LoRARequest:
    return LoRARequest(name, list(adapters).index(name) + 1, adapters[name])


@pytest.fixture(scope="module")
def references(tiny_model, adapters) -> dict[str | None, list[list[int]]]:
    """adapter name (None: the base) -> peft's greedy tokens for PROMPTS."""
    names = [None, *adapters]
    return {name: peft_greedy(tiny_model, adapters.get(name), PROMPTS, NUM_TOKENS)
            for name in names}


@pytest.fixture(scope="module")
def llm(tiny_model):
    engine = LLM(tiny_model, enable_lora=True, max_loras=2, max_lora_rank=8,
                 num_kvcache_blocks=32)
    yield engine
    engine.shutdown()


def test_each_adapter_equals_peft(llm, adapters, references):
    for name in adapters:
        out = ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                               lora_request=lora(adapters, name)))
        assert out == references[name], name
        assert out != references[None]  # the adapter changes the tokens: the check has teeth


def test_mixed_batch_of_three_adapters_and_the_base_equals_each_alone(tiny_model, adapters,
                                                                      references):
    names = [None, "all_r4", "qv_rslora", "attn_r8"]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [None if n is None else lora(adapters, n) for _ in PROMPTS for n in names]
    llm = LLM(tiny_model, enable_lora=True, max_loras=3, max_lora_rank=8,
              num_kvcache_blocks=32)
    try:
        out = ids(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    finally:
        llm.shutdown()
    expected = [references[n][i] for i in range(len(PROMPTS)) for n in names]
    assert out == expected


def test_more_adapters_than_slots_and_host_cache(llm, adapters, references):
    # 4 adapters through 2 slots and a host cache of 2: swapped in LRU order, read again
    names = list(adapters) * 2
    out = ids(llm.generate([PROMPTS[1]] * len(names), GREEDY, use_tqdm=False,
                           lora_request=[lora(adapters, n) for n in names]))
    assert out == [references[n][1] for n in names]
    manager = llm.model_runner.lora_manager
    assert len(manager.slots) == 2 and len(manager.host) <= 2


def test_prefix_cache_is_keyed_by_adapter(llm, adapters, tiny_model):
    prompt = token_prompts(5, (300,))[0]  # one full 256-token block to share
    expected = {n: peft_greedy(tiny_model, adapters.get(n), [prompt], NUM_TOKENS)[0]
                for n in (None, "all_r4", "mlp_r4")}
    llm.reset_prefix_cache()
    llm.reset_stats()
    for name in (None, "all_r4", "mlp_r4", "all_r4"):
        adapter = None if name is None else lora(adapters, name)
        assert ids(llm.generate([prompt], GREEDY, use_tqdm=False,
                                lora_request=adapter)) == [expected[name]], name
    assert llm.stats()["cache_hit_blocks"] == 1  # only the second all_r4 run hits


@pytest.mark.parametrize("family,fixture,name", [("Llama", "family_checkpoints", "llama_linear"),
                                                 ("Qwen3Moe", "moe_checkpoints",
                                                  "moe_norm_dense")])
def test_other_families_equal_peft(family, fixture, name, request, tmp_path):
    base = request.getfixturevalue(fixture)[name]
    # Qwen3-MoE: attention and the dense layer's MLP; peft does not target experts this way
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    adapter = build_adapter(base, str(tmp_path / "a"), seed=7, r=4, target_modules=targets)
    expected = peft_greedy(base, adapter, PROMPTS, NUM_TOKENS)
    llm = LLM(base, enable_lora=True, max_lora_rank=4, num_kvcache_blocks=32)
    try:
        out = ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                               lora_request=LoRARequest("a", 1, adapter)))
    finally:
        llm.shutdown()
    assert out == expected

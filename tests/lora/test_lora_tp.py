"""LoRA with tensor parallelism on CPU (gloo, 2 spawned ranks): A and B sharded as their base
layer, the in-memory adapter broadcast from rank 0; tokens equal transformers + peft."""
from nanovllm import LLM, SamplingParams
from nanovllm.lora import LoRARequest
from tests.lora.helpers import peft_greedy
from tests.lora.test_lora_api import in_memory
from tests.reference import ids, token_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = token_prompts(2, (7, 33))


def test_tp2_mixed_batch_equals_peft(tiny_model, adapters):
    names = [None, "all_r4", "qv_rslora", "attn_r8"]
    expected = {n: peft_greedy(tiny_model, adapters.get(n), PROMPTS, 8) for n in names}
    loras = {None: None, "all_r4": LoRARequest("all_r4", 1, adapters["all_r4"]),
             "qv_rslora": in_memory(adapters["qv_rslora"], 2),
             "attn_r8": LoRARequest("attn_r8", 3, adapters["attn_r8"])}
    llm = LLM(tiny_model, tensor_parallel_size=2, enable_lora=True, max_loras=2,
              max_lora_rank=8, num_kvcache_blocks=16)
    try:
        out = ids(llm.generate([p for p in PROMPTS for _ in names], GREEDY, use_tqdm=False,
                               lora_request=[loras[n] for _ in PROMPTS for n in names]))
    finally:
        llm.shutdown()
    assert out == [expected[n][i] for i in range(len(PROMPTS)) for n in names]

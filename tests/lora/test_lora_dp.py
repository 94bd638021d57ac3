"""LoRA with data parallelism: two CPU replicas on a local Ray cluster equal one engine."""
import importlib.util

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.lora import LoRARequest
from tests.lora.test_lora_api import in_memory
from tests.reference import ids, token_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed")
@pytest.mark.slow
def test_two_replicas_pass_each_prompts_adapter(tiny_model, adapters):
    prompts = token_prompts(4, (5, 9, 13, 17, 21, 25))
    loras = [None, LoRARequest("a", 1, adapters["all_r4"]), in_memory(adapters["mlp_r4"], 2)] * 2
    kwargs = dict(enable_lora=True, max_loras=2, max_lora_rank=4, num_kvcache_blocks=16)
    single = LLM(tiny_model, **kwargs)
    expected = ids(single.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    single.shutdown()
    llm = LLM(tiny_model, data_parallel_size=2, **kwargs)
    try:
        with pytest.raises(ValueError, match="exceeds max_lora_rank=4"):
            llm.generate(prompts, GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("big", 9, adapters["attn_r8"]))
        assert ids(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)) == expected
    finally:
        llm.shutdown()

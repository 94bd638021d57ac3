"""RL features on CUDA with CUDA graphs: logprobs and penalties against transformers (float32,
Triton attention), sleep/wake memory and identical outputs, update_weights."""
import random

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.engine.test_rl_outputs import check_entry, penalised_greedy
from tests.reference import hf_greedy, load_hf

pytestmark = pytest.mark.gpu
NUM_TOKENS = 16


def prompts() -> list[list[int]]:
    rng = random.Random(2)
    return [[rng.randrange(1, 400) for _ in range(n)] for n in (7, 300, 45)]


@pytest.fixture()
def llm(tiny_model):
    engine = LLM(tiny_model, attention_backend="triton", dtype="float32", max_num_seqs=16,
                 max_model_len=1024, num_kvcache_blocks=64)
    yield engine
    engine.shutdown()


def test_logprobs_penalties_and_n_match_transformers_with_graphs(llm, tiny_model):
    hf = load_hf(tiny_model, torch.float32, "cuda")
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=4,
                            prompt_logprobs=1, n=2)
    outs = llm.generate(prompts(), params, use_tqdm=False)
    for prompt, out in zip(prompts(), outs):
        tokens = prompt + out["token_ids"]
        assert [c["token_ids"] for c in out["outputs"]] == [hf_greedy(hf, prompt, NUM_TOKENS)] * 2
        with torch.inference_mode():
            reference = torch.log_softmax(
                hf(torch.tensor([tokens], device="cuda")).logits[0].double(), -1).cpu()
        for j, entry in enumerate(out["logprobs"]):
            check_entry(entry, reference[len(prompt) + j - 1], tokens[len(prompt) + j], 4)
        for p, entry in enumerate(out["prompt_logprobs"][1:], start=1):
            check_entry(entry, reference[p - 1], prompt[p], 1)
    penalised = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True,
                               repetition_penalty=1.5, presence_penalty=0.5,
                               frequency_penalty=0.3)
    got = [o["token_ids"] for o in llm.generate(prompts(), penalised, use_tqdm=False)]
    hf_cpu = load_hf(tiny_model)
    assert got == [penalised_greedy(hf_cpu, p, penalised) for p in prompts()]


def test_sleep_frees_memory_and_wake_up_restores_the_outputs(llm, tiny_model):
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    before = [o["token_ids"] for o in llm.generate(prompts(), greedy, use_tqdm=False)]
    runner = llm.model_runner
    kv_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    awake = torch.cuda.memory_allocated()
    llm.sleep(1)
    assert torch.cuda.memory_allocated() <= awake - kv_bytes - weight_bytes
    llm.wake_up()
    assert [o["token_ids"] for o in llm.generate(prompts(), greedy, use_tqdm=False)] == before
    llm.sleep(2)
    llm.wake_up()
    llm.update_weights((name, t.cuda()) for name, t in load_hf(tiny_model).state_dict().items())
    assert [o["token_ids"] for o in llm.generate(prompts(), greedy, use_tqdm=False)] == before

"""LoRA's API on CPU: errors before anything is queued, in-memory adapters, and LoRA with
chunked prefill, preemption, n, logprobs, sleep and update_weights."""
import json
import os
import random

import pytest
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams
from nanovllm.lora import LoRARequest
from tests.reference import ids, load_hf, token_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = token_prompts(1, (6, 30))


@pytest.fixture(scope="module")
def llm(tiny_model):
    engine = LLM(tiny_model, enable_lora=True, max_loras=2, max_lora_rank=4,
                 num_kvcache_blocks=32)
    yield engine
    engine.shutdown()


def in_memory(path: str, lora_int_id: int) -> LoRARequest:
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    return LoRARequest("mem", lora_int_id, lora_tensors=tensors, peft_config=config)


def copy_adapter(src: str, dst: str, config_edit: dict | None = None,
                 tensor_edit=None) -> str:
    """A copy of adapter `src` with its config updated and its tensors passed through."""
    os.makedirs(dst)
    with open(os.path.join(src, "adapter_config.json")) as f:
        config = {**json.load(f), **(config_edit or {})}
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    tensors = load_file(os.path.join(src, "adapter_model.safetensors"))
    save_file(tensor_edit(tensors) if tensor_edit else tensors,
              os.path.join(dst, "adapter_model.safetensors"))
    return dst


def test_in_memory_adapter_equals_the_same_from_files(llm, adapters):
    path = adapters["all_r4"]
    from_files = ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                                  lora_request=LoRARequest("f", 11, path)))
    from_memory = ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                                   lora_request=in_memory(path, 12)))
    assert from_memory == from_files
    assert from_files != ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


def test_an_in_memory_adapter_is_what_was_registered_after_eviction(tiny_model, adapters):
    """The caller's tensors change in place after registration (an RL trainer's live state
    dict): an id evicted from the host cache and sent again is still the adapter it was."""
    engine = LLM(tiny_model, enable_lora=True, max_loras=1, max_lora_rank=4, max_cpu_loras=1,
                 num_kvcache_blocks=32)
    try:
        path = adapters["all_r4"]
        first = in_memory(path, 1)
        before = ids(engine.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=first))
        for tensor in first.lora_tensors.values():
            tensor.mul_(-1.5)
        engine.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=in_memory(path, 2))
        again = ids(engine.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=first))
        assert again == before
    finally:
        engine.shutdown()


def test_an_id_is_one_adapter_until_removed(llm, adapters):
    first = LoRARequest("a", 21, adapters["all_r4"])
    out = ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=first))
    with pytest.raises(ValueError, match="lora_int_id=21 is already the adapter 'a'"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=in_memory(
            adapters["mlp_r4"], 21))
    assert llm.remove_lora(21) and 21 not in llm.list_loras()
    # the same id, other weights: no slot, host copy or cached prefix of the old one is used
    other = ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                             lora_request=in_memory(adapters["mlp_r4"], 21)))
    assert other == ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                                     lora_request=LoRARequest("m", 22, adapters["mlp_r4"])))
    assert other != out


def bad_adapters(adapters: dict[str, str], root) -> dict[str, tuple[object, type, str]]:
    """case -> (lora_request argument, error type, message pattern)."""
    good = adapters["all_r4"]

    def renamed(tensors, old, new):
        return {k.replace(old, new): v for k, v in tensors.items()}

    cases = {
        "rank": (LoRARequest("big", 31, adapters["attn_r8"]), ValueError,
                 r"rank r=8 exceeds max_lora_rank=4"),
        "missing": (LoRARequest("gone", 32, str(root / "nope")), FileNotFoundError,
                    "does not exist"),
        "no_weights": (LoRARequest("empty", 33, str(root)), FileNotFoundError,
                       "has no adapter_config.json"),
        "json": (LoRARequest("json", 34, copy_adapter(good, str(root / "json"),
                                                      {"r": "four"})), ValueError, "r='four'"),
        "target": (LoRARequest("head", 35, copy_adapter(
            good, str(root / "head"), {"target_modules": ["q_proj", "lm_head"]})),
            ValueError, r"unsupported target module\(s\) \['lm_head'\]"),
        "experts": (LoRARequest("experts", 36, copy_adapter(
            good, str(root / "experts"), tensor_edit=lambda t: renamed(
                t, "mlp.down_proj", "mlp.experts.0.down_proj"))), ValueError,
            "targets experts"),
        "shape": (LoRARequest("shape", 37, copy_adapter(
            good, str(root / "shape"), tensor_edit=lambda t: renamed(
                t, "self_attn.q_proj", "self_attn.k_proj"))), ValueError, "do not match"),
        "wrong_length": ([LoRARequest("a", 38, good)] * 3, ValueError,
                         "got 3 lora_request entries for 2 prompts"),
        "type": ("all_r4", ValueError, "must be a LoRARequest or None"),
    }
    return cases


def test_errors_name_the_problem_and_queue_nothing(llm, adapters, tmp_path):
    registered = llm.list_loras()
    for case, (lora, error, pattern) in bad_adapters(adapters, tmp_path).items():
        with pytest.raises(error, match=pattern):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)
        assert llm.is_finished() and llm.list_loras() == registered, case
    with pytest.raises(ValueError, match="lora_int_id=0 is invalid"):
        LoRARequest("zero", 0, adapters["all_r4"])


def test_lora_not_enabled(tiny_model, adapters):
    plain = LLM(tiny_model, num_kvcache_blocks=8)
    try:
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            plain.generate(PROMPTS, GREEDY, use_tqdm=False,
                           lora_request=LoRARequest("a", 1, adapters["all_r4"]))
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            plain.add_request(PROMPTS[0], GREEDY, LoRARequest("a", 1, adapters["all_r4"]))
        assert plain.is_finished()
    finally:
        plain.shutdown()


def test_chunked_prefill_preemption_n_and_logprobs(tiny_model, adapters, llm):
    rng = random.Random(3)
    batch = [[rng.randrange(1, 500) for _ in range(240 + 20 * i)] for i in range(4)]
    loras = [LoRARequest(n, 41 + i % 2, adapters[n])
             for i, n in enumerate(["all_r4", "mlp_r4"] * 2)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2, n=2)
    expected = llm.generate(batch, params, use_tqdm=False, lora_request=loras)
    # 4 x 2 completions of 2 blocks each and 9 blocks; prompts in 100-token chunks
    small = LLM(tiny_model, enable_lora=True, max_loras=2, max_lora_rank=4,
                num_kvcache_blocks=9, max_num_batched_tokens=100)
    try:
        outs = small.generate(batch, params, use_tqdm=False, lora_request=loras)
        assert small.scheduler.num_preemptions > 0
    finally:
        small.shutdown()
    for got, want in zip(outs, expected):
        assert got["token_ids"] == want["token_ids"]
        for a, b in zip(got["logprobs"], want["logprobs"]):
            assert a.keys() == b.keys()
            assert all(abs(a[k] - b[k]) < 1e-4 for k in a)


def test_adapters_survive_sleep_and_update_weights(llm, adapters, tiny_model):
    lora = LoRARequest("a", 51, adapters["qv_rslora"])
    before = ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora))
    llm.sleep(1)
    llm.wake_up()
    assert ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)) == before
    llm.sleep(2)
    llm.wake_up()
    llm.update_weights(load_hf(tiny_model).state_dict().items())
    assert ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)) == before


def test_add_request_and_chat_take_lora_request(llm, adapters):
    lora = LoRARequest("a", 61, adapters["all_r4"])
    expected = ids(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=lora))
    request_id = llm.add_request(PROMPTS[0], GREEDY, lora_request=lora)
    done = []
    while not llm.is_finished():
        done += llm.step()[0]
    assert [o["token_ids"] for o in done] == expected and done[0]["request_id"] == request_id
    messages = [{"role": "user", "content": "hello world"}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False, lora_request=lora)
    assert chat[0]["token_ids"] != llm.chat(messages, GREEDY, use_tqdm=False)[0]["token_ids"]

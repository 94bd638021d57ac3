"""LoRA on the GPU (`python -m benchmarks.lora`): the standard workload with 4 rank-16 adapters
mixed round-robin vs the base model, batch-1 TPOT with an adapter vs the base, and greedy
agreement with transformers + peft in bf16. Qwen3-0.6B's shape, random weights and adapters
written to the temp directory; base and LoRA runs alternate, medians of --rounds."""
import argparse
import json
import os
import statistics
import tempfile
from time import perf_counter

import torch
from safetensors.torch import save_file

from benchmarks.random_checkpoints import build_checkpoint, qwen3_0_6b_random
from benchmarks.workloads import max_token_id, sizes, standard
from nanovllm import LLM, SamplingParams
from nanovllm.lora import LoRARequest

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(base: str, path: str, rank: int, seed: int) -> str:
    """A random PEFT adapter on every projection: A ~ U(+-1/sqrt(in)) (PEFT's init), B small."""
    if os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        return path
    with open(os.path.join(base, "config.json")) as f:
        cfg = json.load(f)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module in MODULES:
            fan_in, fan_out = shapes[module]
            block = "self_attn" if module in MODULES[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            a = (torch.rand(rank, fan_in, generator=g) * 2 - 1) / fan_in ** 0.5
            tensors[f"{prefix}.lora_A.weight"] = a.bfloat16()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g)
                                                  * 0.02).bfloat16()
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(dict(peft_type="LORA", r=rank, lora_alpha=2 * rank,
                       target_modules=list(MODULES), bias="none",
                       base_model_name_or_path=base), f)
    return path


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(llm: LLM, prompts, params, loras) -> tuple[float, list[dict]]:
    llm.reset_prefix_cache()
    sync()
    t = perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    sync()
    return perf_counter() - t, outs


def tpot_ms(outs: list[dict]) -> float:
    m, n = outs[0]["metrics"], len(outs[0]["token_ids"])
    return 1e3 * (m["latency_s"] - m["ttft_s"]) / (n - 1)


def agreement(base: str, adapter: str, llm: LLM, lora: LoRARequest, num_tokens: int) -> float:
    """Share of greedy tokens equal to peft's in bf16 (float32 on CPU), up to each prompt's
    first divergence."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    device = "cuda" if torch.cuda.is_available() else "cpu"
    max_id = max_token_id(base)
    prompts = [[(97 * i + 13 * j) % max_id + 1 for j in range(32 + 16 * i)] for i in range(8)]
    ours = [o["token_ids"] for o in llm.generate(prompts, SamplingParams(
        temperature=0, max_tokens=num_tokens, ignore_eos=True), use_tqdm=False,
        lora_request=lora)]
    model = AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.bfloat16 if device == "cuda" else torch.float32).to(device)
    model = PeftModel.from_pretrained(model, adapter).eval()
    same = 0
    with torch.inference_mode():
        for prompt, mine in zip(prompts, ours):
            out = model.generate(torch.tensor([prompt], device=device), do_sample=False,
                                 max_new_tokens=num_tokens, min_new_tokens=num_tokens)
            theirs = out[0, len(prompt):].tolist()
            same += next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), num_tokens)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return same / (num_tokens * len(prompts))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tiny", action="store_true", help="a CPU smoke run on a tiny random model")
    args = p.parse_args()
    base = (build_checkpoint(tempfile.mkdtemp(prefix="nanovllm-tiny-")) if args.tiny
            else qwen3_0_6b_random())
    root = tempfile.mkdtemp() if args.tiny else os.path.join(tempfile.gettempdir(),
                                                              "nanovllm-lora-adapters")
    paths = [write_adapter(base, os.path.join(root, f"r{args.rank}-{i}"), args.rank, i)
             for i in range(args.num_adapters)]
    loras = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(paths)]
    prompts, params = standard(**sizes("throughput", args.tiny), max_id=max_token_id(base),
                               seed=0)
    mixed = [loras[i % len(loras)] for i in range(len(prompts))]
    # the second fraction counts what the first engine holds: 0.8 leaves it as much again
    memory = [dict(num_kvcache_blocks=64)] * 2 if args.tiny else [
        dict(gpu_memory_utilization=0.4), dict(gpu_memory_utilization=0.8)]
    plain = LLM(base, max_model_len=4096, **memory[0])
    with_lora = LLM(base, max_model_len=4096, enable_lora=True, max_loras=args.num_adapters,
                    max_lora_rank=args.rank, **memory[1])
    one = ([[7] * 128], SamplingParams(temperature=0, max_tokens=16 if args.tiny else 256,
                                       ignore_eos=True))
    runs = {k: [] for k in ("base_tok_s", "lora_tok_s", "base_tpot_ms", "lora_tpot_ms")}
    tokens = sum(sp.max_tokens for sp in params)
    for _ in range(args.rounds):  # alternated, so that drift hits both sides alike
        runs["base_tok_s"].append(tokens / timed(plain, prompts, params, None)[0])
        runs["lora_tok_s"].append(tokens / timed(with_lora, prompts, params, mixed)[0])
        runs["base_tpot_ms"].append(tpot_ms(timed(plain, *one, None)[1]))
        runs["lora_tpot_ms"].append(tpot_ms(timed(with_lora, *one, loras[0])[1]))
    plain.shutdown()
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"standard workload ({len(prompts)} seqs, {tokens} output tokens), medians of "
          f"{args.rounds}: base {med['base_tok_s']:.0f} tok/s, {args.num_adapters} rank-"
          f"{args.rank} adapters round-robin {med['lora_tok_s']:.0f} tok/s = "
          f"{med['lora_tok_s'] / med['base_tok_s']:.1%} of base")
    print(f"batch-1 TPOT: base {med['base_tpot_ms']:.2f} ms, with an adapter "
          f"{med['lora_tpot_ms']:.2f} ms = {med['lora_tpot_ms'] / med['base_tpot_ms']:.2f}x")
    num_tokens = 8 if args.tiny else 64
    share = agreement(base, paths[0], with_lora, loras[0], num_tokens)
    print(f"greedy agreement with transformers + peft ({'float32' if args.tiny else 'bf16'}, "
          f"8 prompts x {num_tokens} tokens, up to the first divergence): {share:.1%}")
    with_lora.shutdown()


if __name__ == "__main__":
    main()

"""Lower bound on the standard throughput workload's time per model shape, to quote beside
bench.py's figures (same method as the Qwen3-0.6B floor in BENCHMARK.md).

Prefill is bounded by the matmul rate; each decode step by reading the weights once plus every
live sequence's K/V once (only the window's K/V with a sliding window). Weights read per step
exclude an untied input embedding (a lookup touches a few rows). All 256 requests fit at once
on one H200 for these shapes, so every sequence is live from the first decode step.

    python -m benchmarks.floor                       # every shape, H200 figures
    python -m benchmarks.floor llama-3.1-8b --bandwidth 4.27e12 --flops 793e12
"""
import argparse
import random

from benchmarks.shapes import SHAPES

BYTES = 2  # bf16 weights and K/V


def workload(seed: int = 0) -> tuple[list[int], list[int]]:
    """Prompt lengths and max_tokens of bench.py's standard workload (upstream's)."""
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))]
               for _ in range(256)]
    return [len(p) for p in prompts], [random.randint(100, 1024) for _ in range(256)]


def matmul_params(shape: dict) -> int:
    """Weights every decode step reads: layers, final norm and LM head."""
    hidden, heads = shape["hidden_size"], shape["num_attention_heads"]
    head_dim = shape.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, shape["num_key_value_heads"] * head_dim
    attn = hidden * (q + 2 * kv) + q * hidden
    if shape["architectures"][0] == "Qwen2ForCausalLM":
        attn += q + 2 * kv  # q/k/v biases
    mlp = 3 * hidden * shape["intermediate_size"]
    norms = 2 * hidden + (2 * head_dim if shape["architectures"][0] == "Qwen3ForCausalLM" else 0)
    return shape["num_hidden_layers"] * (attn + mlp + norms) + hidden + shape["vocab_size"] * hidden


def floor(shape: dict, bandwidth: float, flops: float) -> dict:
    """Seconds and tok/s bounds of the workload for one shape."""
    prompt_lens, outputs = workload()
    heads = shape["num_attention_heads"]
    head_dim = shape.get("head_dim") or shape["hidden_size"] // heads
    layers, params = shape["num_hidden_layers"], matmul_params(shape)
    window = shape.get("sliding_window") if shape["architectures"][0] == "MistralForCausalLM" \
        else None
    kv_per_token = layers * 2 * shape["num_key_value_heads"] * head_dim * BYTES
    prefill_flops = sum(2 * params * n + 2 * layers * heads * head_dim * n * n
                        for n in prompt_lens)
    t_decode = 0.0
    for step in range(max(outputs)):
        live = [n for n, m in zip(prompt_lens, outputs) if m > step + 1]
        if not live:
            break
        kv_tokens = sum(min(n + step, window or n + step) for n in live)
        step_bytes = params * BYTES + kv_tokens * kv_per_token
        t_decode += max(step_bytes / bandwidth, 2 * params * len(live) / flops)
    t_prefill = prefill_flops / flops
    total = sum(outputs)
    return dict(params=params, prefill_s=t_prefill, decode_s=t_decode,
                tok_s=total / (t_prefill + t_decode), output_tokens=total)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shapes", nargs="*", metavar="SHAPE", help=f"default: all of {list(SHAPES)}")
    p.add_argument("--bandwidth", type=float, default=4.27e12, help="bytes/s (H200 copy)")
    p.add_argument("--flops", type=float, default=793e12, help="bf16 FLOP/s (H200 matmul)")
    args = p.parse_args()
    unknown = sorted(set(args.shapes) - set(SHAPES))
    if unknown:
        p.error(f"unknown shape(s) {unknown}; choose from {list(SHAPES)}")
    print("| shape | weights read/step (GB) | prefill >= s | decode >= s | floor tok/s |")
    print("|---|---|---|---|---|")
    for name in args.shapes or list(SHAPES):
        f = floor(SHAPES[name], args.bandwidth, args.flops)
        print(f"| {name} | {f['params'] * BYTES / 1e9:.2f} | {f['prefill_s']:.3f} | "
              f"{f['decode_s']:.3f} | {f['tok_s']:,.0f} |")


if __name__ == "__main__":
    main()

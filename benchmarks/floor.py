"""Lower bound on the standard throughput workload's time per model shape, to quote beside
bench.py's figures (same method as the Qwen3-0.6B floor in BENCHMARK.md).

Prefill is bounded by the matmul rate; each decode step by reading the weights once plus every
live sequence's K/V once (only the window's K/V with a sliding window). Weights read per step
exclude an untied input embedding (a lookup touches a few rows). All 256 requests fit at once
on one H200 for these shapes, so every sequence is live from the first decode step.

Mixture-of-experts shapes read only the experts a step routes to: with B tokens each picking
K of E experts, E * (1 - (1 - K/E)^B) experts per sparse layer on average (uniform routing,
which dummy weights give); the matmul bound counts the K experts of each token.

With `--weight-format fp8` the layers' weights are one byte (the LM head stays bf16) and their
prefill matmuls run at twice the FLOP rate (FP8 MMAs); the K/V and attention stay bf16.

    python -m benchmarks.floor                       # every shape, H200 figures
    python -m benchmarks.floor llama-3.1-8b --bandwidth 4.27e12 --flops 793e12
    python -m benchmarks.floor llama-3.1-8b qwen3-30b-a3b --weight-format fp8
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


def sparse_layers(shape: dict) -> int:
    """How many layers are mixtures of experts (Qwen3MoeDecoderLayer's rule); 0 if dense."""
    if "moe_intermediate_size" not in shape:
        return 0
    step, mlp_only = shape.get("decoder_sparse_step", 1), shape.get("mlp_only_layers") or []
    return sum(i not in mlp_only and (i + 1) % step == 0
               for i in range(shape["num_hidden_layers"]))


def expert_params(shape: dict) -> int:
    """One expert's weights (gate, up, down)."""
    return 3 * shape["hidden_size"] * shape.get("moe_intermediate_size", 0)


def experts_touched(shape: dict, tokens: int) -> float:
    """Expected experts per sparse layer that `tokens` tokens route to (uniform routing)."""
    experts, top_k = shape.get("num_experts", 0), shape.get("num_experts_per_tok", 0)
    return experts * (1 - (1 - top_k / experts) ** tokens) if experts else 0.0


def step_params(shape: dict, tokens: int) -> float:
    """Weights a decode step of `tokens` sequences reads: all but the experts none routed to."""
    idle = shape.get("num_experts", 0) - experts_touched(shape, tokens)
    return matmul_params(shape) - sparse_layers(shape) * idle * expert_params(shape)


def active_params(shape: dict) -> int:
    """Weights one token multiplies by: its top-k experts only in sparse layers."""
    idle = shape.get("num_experts", 0) - shape.get("num_experts_per_tok", 0)
    return matmul_params(shape) - sparse_layers(shape) * idle * expert_params(shape)


def matmul_params(shape: dict) -> int:
    """Every weight but an untied input embedding: layers, final norm and LM head."""
    hidden, heads = shape["hidden_size"], shape["num_attention_heads"]
    head_dim = shape.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, shape["num_key_value_heads"] * head_dim
    attn = hidden * (q + 2 * kv) + q * hidden
    if shape["architectures"][0] == "Qwen2ForCausalLM":
        attn += q + 2 * kv  # q/k/v biases
    layers, sparse = shape["num_hidden_layers"], sparse_layers(shape)
    mlp = (layers - sparse) * 3 * hidden * shape["intermediate_size"]
    mlp += sparse * shape.get("num_experts", 0) * (hidden + expert_params(shape))  # router too
    qk_norm = shape["architectures"][0] in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    norms = 2 * hidden + (2 * head_dim if qk_norm else 0)
    return layers * (attn + norms) + mlp + hidden + shape["vocab_size"] * hidden


def weight_bytes(shape: dict, tokens: int, weight_itemsize: int = BYTES) -> float:
    """Bytes of weights a decode step of `tokens` sequences reads: the layers' at
    weight_itemsize (1 for FP8 weights), the LM head's always in bf16."""
    lm_head = shape["vocab_size"] * shape["hidden_size"]
    return (step_params(shape, tokens) - lm_head) * weight_itemsize + lm_head * BYTES


def head_dim(shape: dict) -> int:
    return shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]


def kv_bytes_per_token(shape: dict, kv_itemsize: int = BYTES) -> int:
    """K and V of one token across all layers (kv_itemsize 1 for an FP8 cache)."""
    per_layer = 2 * shape["num_key_value_heads"] * head_dim(shape) * kv_itemsize
    return shape["num_hidden_layers"] * per_layer


def attention_flops(shape: dict, num_new: int, num_cached: int = 0) -> float:
    """QK^T and PV FLOPs of num_new causal queries after num_cached keys, all layers."""
    pairs = num_new * num_cached + num_new * num_new / 2
    return 4 * shape["num_hidden_layers"] * shape["num_attention_heads"] * head_dim(shape) * pairs


def step_seconds(shape: dict, tokens: int, kv_tokens: int, attn_flops: float,
                 bandwidth: float, flops: float, kv_itemsize: int = BYTES,
                 weight_itemsize: int = BYTES) -> float:
    """Floor of one step computing `tokens` tokens whose queries read `kv_tokens` tokens' K/V:
    (weights + K/V bytes) / bandwidth or matmul FLOPs / FLOP rate, whichever is larger."""
    read = weight_bytes(shape, tokens, weight_itemsize) \
        + kv_tokens * kv_bytes_per_token(shape, kv_itemsize)
    work = 2 * active_params(shape) * tokens + attn_flops
    return max(read / bandwidth, work / flops)


def floor(shape: dict, bandwidth: float, flops: float, weight_itemsize: int = BYTES) -> dict:
    """Seconds and tok/s bounds of the workload for one shape; FP8 weights (weight_itemsize 1)
    run their matmuls at twice flops."""
    prompt_lens, outputs = workload()
    params = active_params(shape)
    window = shape.get("sliding_window") if shape["architectures"][0] == "MistralForCausalLM" \
        else None
    matmul_rate = flops * BYTES / weight_itemsize
    t_prefill = sum(2 * params * n / matmul_rate + attention_flops(shape, n) / flops
                    for n in prompt_lens)
    t_decode = 0.0
    for step in range(max(outputs)):
        live = [n for n, m in zip(prompt_lens, outputs) if m > step + 1]
        if not live:
            break
        kv_tokens = sum(min(n + step, window or n + step) for n in live)
        t_decode += step_seconds(shape, len(live), kv_tokens, 0.0, bandwidth, matmul_rate,
                                 weight_itemsize=weight_itemsize)
    total = sum(outputs)
    return dict(weight_gb=weight_bytes(shape, 256, weight_itemsize) / 1e9, prefill_s=t_prefill,
                decode_s=t_decode,
                tok_s=total / (t_prefill + t_decode), output_tokens=total)


def step_floor(shape: dict, batch: int, context_len: int, bandwidth: float,
               weight_itemsize: int = BYTES) -> dict:
    """Bandwidth bound of one decode step of `batch` sequences of `context_len` tokens each."""
    kv_bytes = batch * context_len * kv_bytes_per_token(shape)
    weights = weight_bytes(shape, batch, weight_itemsize)
    return dict(weight_gb=weights / 1e9, kv_gb=kv_bytes / 1e9,
                ms=(weights + kv_bytes) / bandwidth * 1e3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shapes", nargs="*", metavar="SHAPE", help=f"default: all of {list(SHAPES)}")
    p.add_argument("--bandwidth", type=float, default=4.27e12, help="bytes/s (H200 copy)")
    p.add_argument("--flops", type=float, default=793e12, help="bf16 FLOP/s (H200 matmul)")
    p.add_argument("--steps", type=int, nargs="*", metavar="BATCH",
                   help="also print one decode step's floor at these batch sizes")
    p.add_argument("--context", type=int, default=1024, help="tokens per sequence for --steps")
    p.add_argument("--weight-format", choices=["bf16", "fp8"], default="bf16",
                   help="fp8: the layers' weights one byte each")
    args = p.parse_args()
    unknown = sorted(set(args.shapes) - set(SHAPES))
    if unknown:
        p.error(f"unknown shape(s) {unknown}; choose from {list(SHAPES)}")
    itemsize = 1 if args.weight_format == "fp8" else BYTES
    print("| shape | weights read/step (GB) | prefill >= s | decode >= s | floor tok/s |")
    print("|---|---|---|---|---|")
    for name in args.shapes or list(SHAPES):
        f = floor(SHAPES[name], args.bandwidth, args.flops, itemsize)
        print(f"| {name} | {f['weight_gb']:.2f} | {f['prefill_s']:.3f} | "
              f"{f['decode_s']:.3f} | {f['tok_s']:,.0f} |")
    if args.steps:
        print(f"\n| shape | batch | weights read (GB) | K/V read (GB) | step >= ms |"
              f"  (context {args.context})")
        print("|---|---|---|---|---|")
        for name in args.shapes or list(SHAPES):
            for batch in args.steps:
                f = step_floor(SHAPES[name], batch, args.context, args.bandwidth, itemsize)
                print(f"| {name} | {batch} | {f['weight_gb']:.2f} | {f['kv_gb']:.2f} | "
                      f"{f['ms']:.3f} |")


if __name__ == "__main__":
    main()

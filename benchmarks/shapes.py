"""Named model shapes (the real checkpoints' config.json fields) for dummy-weight benchmarks.

`write_shape` writes only config.json and a small tokenizer: with load_format="dummy" the engine
draws random weights of that shape, and with ignore_eos speed does not depend on the weights.
"""
import json
import os

_LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
SHAPES: dict[str, dict] = {
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        tie_word_embeddings=False, max_position_embeddings=40960, rope_theta=1000000.0,
        rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=None),
    "qwen2.5-7b": dict(
        architectures=["Qwen2ForCausalLM"], hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        tie_word_embeddings=False, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=131072,
        max_window_layers=28),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=131072,
        rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, rms_norm_eps=1e-5),
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072,
        rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE, factor=32.0), rms_norm_eps=1e-5),
    "mistral-7b": dict(  # v0.1: the 4096-token sliding window
        architectures=["MistralForCausalLM"], hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        tie_word_embeddings=False, max_position_embeddings=32768, rope_theta=10000.0,
        sliding_window=4096, rms_norm_eps=1e-5),
}


# Weight formats a shape's dummy weights can take: the quantization_config the released FP8
# checkpoints carry (Qwen's block-scaled "fp8"; llm-compressor's per-channel FP8_DYNAMIC).
_FP8_CHANNEL = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                "strategy": "channel"}
_FP8_TOKEN = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
              "strategy": "token"}
WEIGHT_FORMATS: dict[str, dict | None] = {
    "bf16": None,
    "fp8-block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128]},
    "fp8-channel": {"quant_method": "compressed-tensors", "format": "float-quantized",
                    "ignore": ["lm_head"], "config_groups": {"group_0": {
                        "targets": ["Linear"], "weights": _FP8_CHANNEL,
                        "input_activations": _FP8_TOKEN}}},
}


def write_shape(name: str, path: str, weight_format: str = "bf16") -> str:
    """config.json (bf16, or FP8 weights of `weight_format`) of shape `name` and a small BPE
    tokenizer in `path`; returns `path`."""
    from benchmarks.random_checkpoints import build_tokenizer
    os.makedirs(path, exist_ok=True)
    tokenizer = build_tokenizer(path)
    config = dict(SHAPES[name], dtype="bfloat16", hidden_act="silu",
                  eos_token_id=tokenizer.eos_token_id)
    if WEIGHT_FORMATS[weight_format] is not None:
        config["quantization_config"] = WEIGHT_FORMATS[weight_format]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return path


# Shapes the fused-limits A/B alternates, with prompts per timed run: the standard workload for
# the 0.6B shape, fewer for the large ones so that 3 rounds fit in ~8 minutes on an H200.
AB_SHAPES = {"qwen3-0.6b": 256, "llama-3.1-8b": 128, "qwen3-30b-a3b": 64}
AB_MODES = ("measured", "fixed")  # NANOVLLM_FUSED_LIMITS: start-up measures them, or not


def _tok_s(path: str, num_seqs: int, tiny: bool) -> float:
    """Output tok/s of one timed standard-workload run on a fresh engine (one untimed request
    first, as bench.py)."""
    from benchmarks import workloads
    from benchmarks.runs import measure
    from nanovllm import LLM, SamplingParams
    size = dict(workloads.sizes("throughput", tiny), num_seqs=num_seqs)
    prompts, params = workloads.standard(**size, max_id=workloads.max_token_id(path), seed=0)
    llm = LLM(path, max_model_len=4096, load_format="auto" if tiny else "dummy")
    try:
        llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
        return measure(llm, prompts, params)["output_tok_s"]
    finally:
        llm.shutdown()


def fused_limits_ab(rounds: int, tiny: bool = False) -> dict[tuple[str, str], list[float]]:
    """tok/s per (shape, mode) over `rounds` rounds, the modes' order alternating by round."""
    import tempfile

    from benchmarks.random_checkpoints import build_checkpoint
    root = tempfile.mkdtemp(prefix="nanovllm-shapes-")
    shapes = {"tiny": 4} if tiny else AB_SHAPES
    paths = {name: build_checkpoint(os.path.join(root, name)) if tiny
             else write_shape(name, os.path.join(root, name)) for name in shapes}
    results: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds):
        for name, num_seqs in shapes.items():
            for mode in AB_MODES if r % 2 == 0 else AB_MODES[::-1]:
                os.environ["NANOVLLM_FUSED_LIMITS"] = mode
                tok_s = _tok_s(paths[name], num_seqs, tiny)
                results.setdefault((name, mode), []).append(tok_s)
                print(f"round {r + 1} {name} {mode}: {tok_s:,.0f} tok/s", flush=True)
    return results


def main() -> None:
    """python -m benchmarks.shapes [--rounds 3]: fused-projection limits measured at start-up
    against the fixed ones, alternated on each A/B shape; prints the medians."""
    import argparse
    import statistics
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a tiny random model (CPU smoke test)")
    args = p.parse_args()
    results = fused_limits_ab(args.rounds, args.tiny)
    print("| shape | measured limits tok/s | fixed limits tok/s | measured / fixed |")
    print("|---|---|---|---|")
    for name in dict.fromkeys(name for name, _ in results):
        on, off = (statistics.median(results[(name, mode)]) for mode in AB_MODES)
        print(f"| {name} | {on:,.0f} | {off:,.0f} | {on / off:.3f} |")


if __name__ == "__main__":
    main()

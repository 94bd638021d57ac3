"""FP8 KV cache accuracy: teacher-forced logits of an FP8 cache against the model-dtype cache;
with --weights, of FP8 weights (quantization="fp8", W8A8 per channel) against the bf16 weights.

For each checkpoint (two tiny random ones, and a random bf16 checkpoint of Qwen3-0.6B's shape),
each attention backend available (torch on CPU; triton on CUDA) and both scale policies (1.0,
and calculated from the warm-up): the model runs in bf16 with a bf16 cache, greedily, for
NUM_TOKENS tokens per prompt; the FP8 runs are fed those same tokens step by step (prefill, then
paged decode) and their logits compared with the bf16 run's at every step: argmax agreement,
max and mean |logit error|.

    python -m tests.accuracy.fp8_accuracy [--checkpoints tiny qwen3-0.6b] [--num-prompts 8]
                                          [--backends triton] [--weights] [--json FILE]
"""
import argparse
import json
import os
import random
import tempfile
import time

import torch

from nanovllm.runner.step_inputs import prepare_prefill
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence
from nanovllm.utils.context import Context, forward_context

NUM_TOKENS = 64
LENGTHS = (5, 40, 255, 256, 300, 511, 700, 1000)
TINY = {"tiny_gqa2_d16": {}, "tiny_mha_d32": dict(num_attention_heads=4, num_key_value_heads=4,
                                                  head_dim=32, hidden_size=96)}
POLICIES = {"scale 1.0": False, "calculated": True}  # name -> calculate_kv_scales
_GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def checkpoint(name: str) -> str:
    from benchmarks.random_checkpoints import build_checkpoint, qwen3_0_6b_random
    if name == "qwen3-0.6b":
        return qwen3_0_6b_random()
    path = os.path.join(tempfile.gettempdir(), f"nanovllm-fp8-{name}")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        build_checkpoint(path, seed=1, dtype="bfloat16", **TINY[name])
    return path


def prompts(vocab: int, num: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in LENGTHS[:num]]


def step_logits(runner, input_ids: torch.Tensor, positions: torch.Tensor,
                context: Context) -> torch.Tensor:
    """One step's logits (float32): the runner's forward, then the LM head."""
    hidden = runner.forward(input_ids, positions, context)
    with forward_context(context):
        return runner.model.compute_logits(hidden).float()


@torch.inference_mode()
def teacher_forced(llm, batch: list[list[int]], forced: list[list[int]] | None
                   ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill `batch`, then NUM_TOKENS - 1 decode steps fed `forced` (None: the argmax).
    Returns the fed tokens and each step's logits [B, vocab] (float32, on the device)."""
    runner = llm.model_runner
    block_size, next_block = runner.block_size, iter(range(runner.num_kvcache_blocks))
    seqs = [Sequence(p, _GREEDY, block_size) for p in batch]
    for seq in seqs:
        seq.block_table = [next(next_block) for _ in range(seq.num_blocks)]
        seq.num_scheduled_tokens = len(seq)
    logits = [step_logits(runner, *prepare_prefill(seqs, block_size, runner.device))]
    tokens = [[] for _ in batch]
    for step in range(NUM_TOKENS):
        chosen = (logits[-1][:len(seqs)].argmax(-1).tolist() if forced is None
                  else [f[step] for f in forced])
        for seq, token, out in zip(seqs, chosen, tokens):
            out.append(token)
            seq.append_pending_token()
            seq.commit_pending_token(token)
            if len(seq.block_table) < seq.num_blocks:
                seq.block_table.append(next(next_block))
        if step + 1 < NUM_TOKENS:
            logits.append(step_logits(runner, *runner.prepare_decode(seqs))[:len(seqs)])
            # prepare_decode packs into two alternating pinned buffers, which is safe only once
            # the step before last has run (the engine waits on every step's ids; a forced
            # run reads none, so it must wait here).
            runner.wait_idle()
    return tokens, logits


def engine(path: str, backend: str, kv_cache_dtype: str, calculate: bool = False, **overrides):
    from nanovllm import LLM
    kwargs = dict(dtype="bfloat16", attention_backend=backend, kv_cache_dtype=kv_cache_dtype,
                  max_model_len=2048, num_kvcache_blocks=64, max_num_seqs=16,
                  max_num_batched_tokens=4096)
    if kv_cache_dtype == "fp8":  # the engine refuses the flag for a 16-bit cache
        kwargs["calculate_kv_scales"] = calculate
    return LLM(path, **{**kwargs, **overrides})


def compare(ref_tokens: list[list[int]], ref: list[torch.Tensor], fp8: list[torch.Tensor]
            ) -> dict:
    """Argmax agreement with the bf16 run's tokens and |logit error|, over every step."""
    agree = total = 0
    max_err, err_sum, count = 0.0, 0.0, 0
    for step, (a, b) in enumerate(zip(ref, fp8)):
        chosen = torch.tensor([t[step] for t in ref_tokens], device=b.device)
        agree += int((b.argmax(-1) == chosen).sum())
        total += len(chosen)
        err = (a - b).abs()
        max_err = max(max_err, float(err.max()))
        err_sum, count = err_sum + float(err.sum()), count + err.numel()
    return {"agree": agree, "total": total, "pct": 100 * agree / total, "max_err": max_err,
            "mean_err": err_sum / count}


def measure(name: str, backend: str, num_prompts: int, weights: bool = False) -> list[dict]:
    """The bf16 run, then both FP8-cache policies (or, with `weights`, FP8 weights quantized at
    load) teacher-forced along its tokens."""
    path = checkpoint(name)
    llm = engine(path, backend, "auto")
    batch = prompts(llm.config.hf_config.vocab_size, num_prompts)
    ref_tokens, ref = teacher_forced(llm, batch, None)
    llm.shutdown()
    rows = []
    runs = {"fp8 weights": ("auto", False, "fp8")} if weights else \
        {policy: ("fp8", calculate, None) for policy, calculate in POLICIES.items()}
    for policy, (kv_cache_dtype, calculate, quantization) in runs.items():
        t0 = time.perf_counter()
        llm = engine(path, backend, kv_cache_dtype, calculate, quantization=quantization)
        scales = [(a.k_scale, a.v_scale) for a in llm.model_runner.attn_layers]
        _, fp8 = teacher_forced(llm, batch, ref_tokens)
        llm.shutdown()
        row = {"checkpoint": name, "backend": backend, "policy": policy,
               "prompts": len(batch), **compare(ref_tokens, ref, fp8),
               "k_scale_range": [min(s[0] for s in scales), max(s[0] for s in scales)],
               "v_scale_range": [min(s[1] for s in scales), max(s[1] for s in scales)],
               "seconds": time.perf_counter() - t0}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", nargs="+", default=[*TINY, "qwen3-0.6b"])
    parser.add_argument("--backends", nargs="+",
                        default=["triton"] if torch.cuda.is_available() else ["torch"])
    parser.add_argument("--num-prompts", type=int, default=8, choices=range(1, 9))
    parser.add_argument("--weights", action="store_true",
                        help="FP8 weights (quantization='fp8') instead of an FP8 KV cache")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    rows = [row for name in args.checkpoints for backend in args.backends
            for row in measure(name, backend, args.num_prompts, args.weights)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    what = "FP8 weights vs bf16 weights" if args.weights else "FP8 KV vs bf16 KV"
    print(f"\n{what}, teacher-forced, {NUM_TOKENS} tokens per prompt")
    print(f"{'checkpoint':<15} {'backend':<7} {'policy':<10} {'prompts':>7} {'agree':>8} "
          f"{'max|err|':>9} {'mean|err|':>10}")
    for r in rows:
        print(f"{r['checkpoint']:<15} {r['backend']:<7} {r['policy']:<10} {r['prompts']:>7} "
              f"{r['pct']:>7.1f}% {r['max_err']:>9.4f} {r['mean_err']:>10.5f}")


if __name__ == "__main__":
    main()

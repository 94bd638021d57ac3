"""bf16 at scale: how often each attention backend's greedy token is transformers' float32 argmax.

On a random bf16 checkpoint of Qwen3-0.6B's shape, every backend (flash-attn when importable,
Triton, and the torch reference in eager mode), eager and with CUDA graphs, generates 8 prompts
x 64 tokens greedily; transformers in float32 is then teacher-forced along our tokens and we
count the positions where its argmax is the token we chose.

    python -m tests.accuracy.bf16_agreement [--json FILE]
"""
import argparse
import importlib.util
import json
import random
import time

import torch

from benchmarks import runs

RUNS = [("flash-attn", True), ("flash-attn", False), ("triton", True), ("triton", False),
        ("torch", True)]
NUM_PROMPTS, NUM_TOKENS = 8, 64


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = (5, 40, 255, 256, 300, 511, 700, 1000)[:NUM_PROMPTS]
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


def generate(path: str, backend: str, eager: bool, batch: list[list[int]]) -> list[list[int]]:
    from nanovllm import LLM, SamplingParams
    llm = LLM(path, attention_backend=backend, enforce_eager=eager, max_model_len=2048,
              num_kvcache_blocks=64, max_num_seqs=16)
    try:
        outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=NUM_TOKENS,
                                                  ignore_eos=True), use_tqdm=False)
        return [o["token_ids"] for o in outs]
    finally:
        llm.shutdown()
        torch.cuda.empty_cache()


@torch.inference_mode()
def agreement(hf, batch: list[list[int]], outputs: list[list[int]]) -> dict:
    """Share of our tokens that are transformers' argmax, teacher-forced; and the worst gap."""
    agree, worst = 0, 0.0
    device = next(hf.parameters()).device
    for prompt, tokens in zip(batch, outputs):
        ids = torch.tensor([prompt + tokens], device=device)
        logits = hf(ids).logits[0, len(prompt) - 1:-1].float()  # row i predicts tokens[i]
        chosen = torch.tensor(tokens, device=device)
        agree += int((logits.argmax(-1) == chosen).sum())
        gap = (logits.max(-1).values - logits.gather(-1, chosen[:, None])[:, 0])
        worst = max(worst, float((gap / logits.abs().max(-1).values).max()))
    total = sum(len(t) for t in outputs)
    return {"agree": agree, "total": total, "pct": 100 * agree / total, "worst_rel_gap": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every figure with its conditions here")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from benchmarks.random_checkpoints import qwen3_0_6b_random

    path = qwen3_0_6b_random()
    batch = prompts(151936)
    has_flash = importlib.util.find_spec("flash_attn") is not None
    results = []
    for backend, eager in RUNS:
        if backend == "flash-attn" and not has_flash:
            continue
        t0 = time.perf_counter()
        outputs = generate(path, backend, eager, batch)
        results.append({"backend": backend, "mode": "eager" if eager else "graphs",
                        "outputs": outputs, "run_s": time.perf_counter() - t0})
    # Loaded once the engines are gone, so it never shares the GPU with one.
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    for r in results:
        r.update(agreement(hf, batch, r.pop("outputs")))
    commit = runs.commit()
    conditions = {"gpu": torch.cuda.get_device_name(), "commit": commit,
                  "torch": torch.__version__, "prompts": NUM_PROMPTS, "tokens": NUM_TOKENS,
                  "checkpoint": "random bf16 Qwen3-0.6B shape", "reference": "transformers fp32"}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"conditions": conditions, "runs": results}, f, indent=1)
    print(f"bf16 argmax agreement with transformers float32, teacher-forced, {NUM_PROMPTS} "
          f"prompts x {NUM_TOKENS} tokens ({conditions['gpu']}, {commit})")
    print(f"{'backend':<11} {'mode':<7} {'agree':>9} {'%':>7} {'worst gap':>10} {'run s':>6}")
    for r in results:
        print(f"{r['backend']:<11} {r['mode']:<7} {r['agree']:>4}/{r['total']:<4} "
              f"{r['pct']:>7.2f} {r['worst_rel_gap']:>10.2e} {r['run_s']:>6.1f}")
    pct = {(r["backend"], r["mode"]): r["pct"] for r in results}
    for mode in ("eager", "graphs"):
        if ("flash-attn", mode) in pct:
            print(f"flash-attn - triton ({mode}): "
                  f"{pct['flash-attn', mode] - pct['triton', mode]:+.2f} points")


if __name__ == "__main__":
    main()

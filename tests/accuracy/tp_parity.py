"""TP=N vs TP=1 on one checkpoint: greedy token agreement, the largest logit difference, and a
clean exit (no worker process or shared-memory segment left). Issue 5's first and third checks:

    python -m tests.accuracy.tp_parity --random-weights --tp 2     # Qwen3-0.6B shape, bf16, GPUs
    python -m tests.accuracy.tp_parity --tiny --tp 2               # tiny model on CPU (gloo)
"""
import argparse
import glob
import json
import multiprocessing
import random
import tempfile

import torch


class LogitsProbe:
    """Wraps rank 0's sampler to keep every step's logits (float32, on the host)."""

    def __init__(self, runner):
        self.steps: list[torch.Tensor] = []
        self.runner, self.sampler = runner, runner.sampler
        runner.sampler = self

    def __call__(self, logits, *args, **kwargs):
        self.steps.append(logits.float().cpu())
        return self.sampler(logits, *args, **kwargs)


def greedy_run(path: str, tp: int, prompts: list[list[int]], max_tokens: int,
               device_kwargs: dict) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy completions and the logits of every step, from a fresh engine of size `tp`."""
    from nanovllm import LLM, SamplingParams
    llm = LLM(path, tensor_parallel_size=tp, **device_kwargs)
    try:
        probe = LogitsProbe(llm.model_runner)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [o["token_ids"] for o in outs], probe.steps


def compare(base: tuple, other: tuple) -> dict:
    """Token agreement per position, and the max |logit difference| over the steps where every
    sequence still agrees (afterwards the two runs condition on different tokens)."""
    (tokens_a, logits_a), (tokens_b, logits_b) = base, other
    equal = sum(x == y for a, b in zip(tokens_a, tokens_b) for x, y in zip(a, b))
    total = sum(len(a) for a in tokens_a)
    first_diff = min((next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                      for a, b in zip(tokens_a, tokens_b)), default=0)
    # Step 0 is the prefill (one row per prompt); step s > 0 samples token s of every sequence.
    steps = list(zip(logits_a, logits_b))[:first_diff + 1]
    max_err = max((float((a - b).abs().max()) for a, b in steps), default=0.0)
    scale = max((float(a.abs().max()) for a, _ in steps), default=1.0)
    return dict(tokens_equal=equal, tokens=total, agreement=equal / max(total, 1),
                steps_compared=len(steps), max_abs_logit_diff=max_err,
                max_rel_logit_diff=max_err / scale if scale else max_err,
                distinct_tokens=len({t for seq in tokens_a for t in seq}))


def leftovers() -> dict:
    """Child processes and nanovllm shared-memory segments still alive."""
    return dict(children=len(multiprocessing.active_children()),
                shm_segments=len(glob.glob("/dev/shm/nanovllm-*")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--random-weights", action="store_true", help="Qwen3-0.6B shape, bf16")
    p.add_argument("--tiny", action="store_true", help="tiny random model (CPU smoke run)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from benchmarks.random_checkpoints import build_checkpoint, qwen3_0_6b_random
    if args.tiny:
        path = build_checkpoint(tempfile.mkdtemp(prefix="nanovllm-tiny-"))
    elif args.random_weights:
        path = qwen3_0_6b_random()
    elif args.model:
        path = args.model
    else:
        raise SystemExit("pass --model DIR, --random-weights or --tiny")
    rng = random.Random(0)
    prompts = [[rng.randint(1, 400) for _ in range(rng.randint(16, 200))]
               for _ in range(args.num_prompts)]
    device_kwargs = {} if torch.cuda.is_available() else dict(num_kvcache_blocks=64)
    base = greedy_run(path, 1, prompts, args.max_tokens, device_kwargs)
    other = greedy_run(path, args.tp, prompts, args.max_tokens, device_kwargs)
    result = dict(compare(base, other), tp=args.tp, prompts=args.num_prompts,
                  max_tokens=args.max_tokens, model=path, after_shutdown=leftovers())
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

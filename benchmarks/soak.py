"""Soak: many generate() calls of small random requests, some interrupted mid-call, in a small
KV pool; after every call the engine must be idle with every block free (cached prefixes live in
free blocks), and host (and GPU) memory must stay flat.

    python -m benchmarks.soak --minutes 5 --random-weights   # H200: Qwen3-0.6B shape
    python -m benchmarks.soak --tiny --calls 30              # CPU: a tiny checkpoint

Prints one line per 10% of the run and a summary table last; --json writes the summary.
"""
import argparse
import gc
import json
import os
import random
import resource
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch

from nanovllm import LLM, SamplingParams


@dataclass
class SoakReport:
    """What a soak run did and what it left behind."""

    calls: int = 0
    interrupted_calls: int = 0
    requests: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    cache_hit_blocks: int = 0
    leaked_blocks: int = 0  # max over calls of blocks not free after the call
    seconds: float = 0.0
    host_rss_mib: list[float] = field(default_factory=list)  # after each call
    python_objects: list[float] = field(default_factory=list)  # gc-tracked, after each call
    gpu_allocated_mib: list[float] = field(default_factory=list)

    def slope(self, samples: list[float]) -> float:
        """Least-squares MiB per call over the second half (the first warms caches up)."""
        ys = samples[len(samples) // 2:]
        if len(ys) < 2:
            return 0.0
        mean_x, mean_y = (len(ys) - 1) / 2, sum(ys) / len(ys)
        cov = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(ys))
        return cov / sum((x - mean_x) ** 2 for x in range(len(ys)))

    def summary(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if not isinstance(v, list)}
        out["host_rss_slope_kib_per_call"] = 1024 * self.slope(self.host_rss_mib)
        out["gpu_slope_kib_per_call"] = 1024 * self.slope(self.gpu_allocated_mib)
        out["python_objects_slope_per_call"] = self.slope(self.python_objects)
        out["host_rss_mib_first_last"] = (self.host_rss_mib[:1] + self.host_rss_mib[-1:])
        return out


def host_rss_mib() -> float:
    """Resident set size now (not the peak), from /proc."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def random_params(rng: random.Random, max_tokens: int) -> SamplingParams:
    """Greedy or sampled, with or without filters, seeds and stop conditions."""
    kw = dict(max_tokens=rng.randint(1, max_tokens), ignore_eos=rng.random() < 0.7)
    if rng.random() < 0.7:
        kw.update(temperature=rng.choice([0.3, 0.7, 1.0]))
        if rng.random() < 0.5:
            kw.update(top_k=rng.choice([-1, 1, 5, 50]), top_p=rng.choice([0.5, 0.9, 1.0]),
                      min_p=rng.choice([0.0, 0.05]))
        if rng.random() < 0.3:
            kw.update(seed=rng.randrange(2**63))
    else:
        kw.update(temperature=0.0)
    if rng.random() < 0.2:
        kw.update(stop=["the", "a"], stop_token_ids=[rng.randrange(1, 200)])
    return SamplingParams(**kw)


def random_prompts(rng: random.Random, n: int, max_len: int, vocab: int,
                   prefixes: list[list[int]]) -> list[list[int]]:
    """Random token ids; one in ten starts with a shared full-block prefix, so the prefix
    cache is exercised."""
    block = len(prefixes[0])
    prompts = []
    for _ in range(n):
        kind = rng.random()
        # a few end just short of a block, so they need a new block while decoding: preemption
        length = block - rng.randint(1, 3) if kind < 0.05 else rng.randint(1, max_len)
        tail = [rng.randrange(vocab) for _ in range(length)]
        prompts.append(rng.choice(prefixes) + tail if kind > 0.9 else tail)
    return prompts


def leaked_blocks(llm: LLM) -> int:
    """Blocks not back in the free pool (a cached prefix sits in a free block, revivable)."""
    bm = llm.scheduler.block_manager
    held = sum(block.ref_count != 0 for block in bm.blocks)
    return max(len(bm.blocks) - len(set(bm.free_block_ids)), len(bm.used_block_ids), held)


def check_idle(llm: LLM, call: int) -> None:
    """Nothing queued and every block free, or an AssertionError naming the call."""
    assert llm.is_finished(), f"call {call}: requests left queued"
    assert leaked_blocks(llm) == 0, f"call {call}: {leaked_blocks(llm)} KV blocks not freed"


def check_counters(llm: LLM, prompts: list[list[int]], outputs: list[dict]) -> None:
    """The call's step counters against its requests: every prompt token is prefilled once
    unless cached (recomputes only add), and every output token after a request's first comes
    from a decode row (a preempted request's recompute prefill samples one too)."""
    stats, block = llm.stats(), llm.config.kvcache_block_size
    prompt_tokens = sum(map(len, prompts)) - stats["cache_hit_blocks"] * block
    if stats["preemptions"] == 0:
        assert stats["prefill_tokens"] == prompt_tokens, (stats, prompt_tokens)
    else:
        assert stats["prefill_tokens"] >= prompt_tokens, (stats, prompt_tokens)
    later_tokens = sum(len(out["token_ids"]) - 1 for out in outputs)
    assert stats["decode_tokens"] >= later_tokens - stats["preemptions"], stats
    assert stats["prefill_steps"] + stats["decode_steps"] >= 1


def interrupt_at(llm: LLM, nth: int) -> None:
    """Make the engine's nth step from now raise KeyboardInterrupt, as Ctrl-C would (through
    the private `_step` that generate() loops over)."""
    original, count = type(llm)._step, [0]

    def interrupting_step():
        count[0] += 1
        if count[0] == nth:
            raise KeyboardInterrupt
        return original(llm)

    llm._step = interrupting_step


def soak_call(llm: LLM, rng: random.Random, report: SoakReport, requests_per_call: int,
              max_prompt_len: int, max_tokens: int, prefixes: list[list[int]]) -> None:
    """One generate() call of random requests, interrupted at a random step one time in five."""
    vocab = llm.config.hf_config.vocab_size
    n = rng.randint(1, requests_per_call)
    prompts = random_prompts(rng, n, max_prompt_len, vocab, prefixes)
    params = [random_params(rng, max_tokens) for _ in prompts]
    interrupted = rng.random() < 0.2
    llm.reset_stats()
    if interrupted:
        interrupt_at(llm, rng.randint(1, 2 * max_tokens))
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        interrupted = False  # finished before the interrupt's step
    except KeyboardInterrupt:
        outputs = []
        assert interrupted, "KeyboardInterrupt without an injected interrupt"
    finally:
        llm.__dict__.pop("_step", None)
    for out, p in zip(outputs, params):
        assert 1 <= len(out["token_ids"]) <= p.max_tokens
        assert out["metrics"]["ttft_s"] <= out["metrics"]["latency_s"]
    if outputs:
        check_counters(llm, prompts, outputs)
    report.calls += 1
    report.interrupted_calls += interrupted
    report.requests += n
    report.output_tokens += sum(len(out["token_ids"]) for out in outputs)


def soak(llm: LLM, *, calls: int | None = None, minutes: float | None = None, seed: int = 0,
         requests_per_call: int = 32, max_prompt_len: int = 32, max_tokens: int = 8,
         log=print) -> SoakReport:
    """Run calls until `calls` or `minutes` is reached, checking the engine after each."""
    rng = random.Random(seed)
    vocab = llm.config.hf_config.vocab_size
    block = llm.config.kvcache_block_size
    prefixes = [[rng.randrange(vocab) for _ in range(block)] for _ in range(3)]
    report, start = SoakReport(), time.perf_counter()
    preemptions = cache_hit_blocks = 0
    next_log_s = 0.0
    while True:
        elapsed = time.perf_counter() - start
        if (calls is not None and report.calls >= calls) or (minutes is not None
                                                             and elapsed >= 60 * minutes):
            break
        soak_call(llm, rng, report, requests_per_call, max_prompt_len, max_tokens, prefixes)
        check_idle(llm, report.calls)
        report.leaked_blocks = max(report.leaked_blocks, leaked_blocks(llm))
        gc.collect()
        stats = llm.stats()  # of this call alone: soak_call reset them
        preemptions += stats["preemptions"]
        cache_hit_blocks += stats["cache_hit_blocks"]
        report.host_rss_mib.append(host_rss_mib())
        report.python_objects.append(len(gc.get_objects()))
        if torch.cuda.is_available() and llm.config.device == "cuda":
            report.gpu_allocated_mib.append(torch.cuda.memory_allocated() / 2**20)
        if log and (report.calls % max(1, (calls or 0) // 10) == 0 if calls
                    else elapsed >= next_log_s):
            next_log_s = elapsed + 30.0
            log(f"{elapsed:7.1f} s  calls {report.calls}  requests {report.requests}  "
                f"rss {report.host_rss_mib[-1]:.1f} MiB")
    report.preemptions, report.cache_hit_blocks = preemptions, cache_hit_blocks
    report.seconds = time.perf_counter() - start
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.expanduser("~/huggingface/Qwen3-0.6B"))
    p.add_argument("--random-weights", action="store_true", help="Qwen3-0.6B shape, random")
    p.add_argument("--tiny", action="store_true", help="a tiny random checkpoint (CPU)")
    p.add_argument("--minutes", type=float, default=None)
    p.add_argument("--calls", type=int, default=None)
    p.add_argument("--num-kvcache-blocks", type=int, default=8, help="a small pool: preemption")
    p.add_argument("--json", default=None, help="write the summary here")
    args = p.parse_args()
    if args.minutes is None and args.calls is None:
        args.minutes = 1.0
    from benchmarks.random_checkpoints import build_checkpoint, qwen3_0_6b_random
    model = args.model
    if args.tiny:
        model = build_checkpoint(tempfile.mkdtemp(prefix="nanovllm-soak-"))
    elif args.random_weights and not os.path.isdir(model):
        model = qwen3_0_6b_random()
    llm = LLM(model, num_kvcache_blocks=args.num_kvcache_blocks, max_model_len=1024,
              max_num_batched_tokens=4096)
    report = soak(llm, calls=args.calls, minutes=args.minutes)
    summary = report.summary()
    llm.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    width = max(map(len, summary))
    for key, value in summary.items():
        print(f"{key:<{width}}  {value:.3f}" if isinstance(value, float)
              else f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()

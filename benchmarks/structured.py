"""What a JSON schema on every request costs: the standard workload with ignore_eos off, each
request constrained by SCHEMA, against the same requests unconstrained, alternated on one
engine and compared per output token; and the host time filling the token bitmasks per step.

The checkpoint's tokenizer is swapped for a synthetic one as wide as Qwen3's (masks cost per
token of the vocabulary); the weights, and so the step times, are the checkpoint's.
"""
import argparse
import os
import statistics
import tempfile
from dataclasses import replace
from time import perf_counter

from benchmarks import workloads
from benchmarks.cli import standard_size
from benchmarks.rl import timed
from benchmarks.runs import engine_env, open_engine

# Strings and arrays, so a random model's output can run as long as max_tokens allows.
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "score": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "score", "tags"]}
WIDE_VOCAB = 151643  # Qwen3's tokenizer


class FillTimer:
    """Wraps the runner's bitmask fill to time it (host seconds and calls)."""

    def __init__(self):
        import nanovllm.runner.sample_inputs as model_runner
        self.module, self.fill = model_runner, model_runner.fill_token_bitmask
        self.seconds, self.calls = 0.0, 0

        def timed_fill(matchers, *args, **kwargs):
            if all(m is None for m in matchers):  # nothing to fill: not a constrained step
                return self.fill(matchers, *args, **kwargs)
            t = perf_counter()
            try:
                return self.fill(matchers, *args, **kwargs)
            finally:
                self.seconds += perf_counter() - t
                self.calls += 1
        model_runner.fill_token_bitmask = timed_fill

    def take(self) -> dict:
        """Mean ms per filled step since the last take, and the number of such steps."""
        out = dict(mask_fill_ms_per_step=1e3 * self.seconds / max(self.calls, 1),
                   mask_filled_steps=self.calls)
        self.seconds, self.calls = 0.0, 0
        return out

    def remove(self) -> None:
        self.module.fill_token_bitmask = self.fill


def wide_tokenizer_copy(path: str, vocab_size: int) -> str:
    """A directory with `path`'s weights and config (linked) and a wide synthetic tokenizer."""
    from benchmarks.random_checkpoints import build_wide_tokenizer
    out = tempfile.mkdtemp(prefix="nanovllm-wide-tokenizer-")
    for name in os.listdir(path):
        if name.endswith((".safetensors", ".json")) and "tokenizer" not in name:
            os.symlink(os.path.join(path, name), os.path.join(out, name))
    build_wide_tokenizer(out, vocab_size)
    return out


def structured(args: argparse.Namespace, path: str) -> dict:
    """Alternated rounds of unconstrained and JSON-schema runs; medians per output token."""
    from nanovllm.sampling_params import StructuredOutputsParams
    size = standard_size(args)
    prompts, params = workloads.standard(**size, max_id=workloads.max_token_id(path),
                                         seed=args.seed)
    free = [replace(p, ignore_eos=False) for p in params]
    schema = StructuredOutputsParams(json=SCHEMA)
    variants = {"unconstrained": free,
                "json schema": [replace(p, structured_outputs=schema) for p in free]}
    wide = wide_tokenizer_copy(path, 1000 if args.tiny else WIDE_VOCAB)
    runs = {label: [] for label in variants}
    with open_engine(wide, args) as (llm, startup_s):
        timer = FillTimer()
        try:
            for _ in range(args.structured_rounds):
                for label, ps in variants.items():
                    timer.take()
                    runs[label].append(dict(timed(llm, prompts, ps), **timer.take()))
        finally:
            timer.remove()
        env = engine_env(llm, startup_s)
    rows = {label: dict(runs=rs, output_tok_s=statistics.median(r["output_tok_s"] for r in rs),
                        output_tokens=statistics.median(r["output_tokens"] for r in rs),
                        mask_fill_ms_per_step=statistics.median(
                            r["mask_fill_ms_per_step"] for r in rs))
            for label, rs in runs.items()}
    ratio = rows["json schema"]["output_tok_s"] / rows["unconstrained"]["output_tok_s"]
    return dict(workload=size, runs=rows, ratio=ratio, engine=env)

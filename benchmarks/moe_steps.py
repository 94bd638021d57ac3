"""Decode step time beside its bandwidth floor at several batch sizes, for one model shape with
dummy weights (the mixture-of-experts floor counts only the experts a step routes to).

    python -m benchmarks.moe_steps --shape qwen3-30b-a3b --batches 1 16 64 256

Each batch runs `batch` prompts of --input-len random tokens together for --output-len tokens
(ignore_eos); the step time is the TPOT of the sequence prefilled last, whose decode steps all
run with the whole batch live (earlier ones also wait through the later prefills).
"""
import argparse
import random
import tempfile

from benchmarks.floor import step_floor
from benchmarks.shapes import SHAPES, write_shape
from nanovllm import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--bandwidth", type=float, default=4.27e12, help="bytes/s (H200 copy)")
    args = p.parse_args()
    path = write_shape(args.shape, tempfile.mkdtemp(prefix=f"nanovllm-{args.shape}-"))
    llm = LLM(path, load_format="dummy", attention_backend=args.attention_backend,
              max_num_seqs=max(args.batches), max_model_len=args.input_len + args.output_len)
    # sampled, as the standard workload: random tokens keep the routing spread over the experts
    # (greedy tokens from dummy weights can repeat, routing every sequence to the same experts)
    params = SamplingParams(temperature=0.6, max_tokens=args.output_len, ignore_eos=True)
    rng, rows = random.Random(0), []
    try:
        llm.generate([[1] * args.input_len], params, use_tqdm=False)  # warm-up
        for batch in args.batches:
            prompts = [[rng.randrange(1, 10000) for _ in range(args.input_len)]
                       for _ in range(batch)]
            outputs = llm.generate(prompts, params, use_tqdm=False)
            last = max(outputs, key=lambda o: o["metrics"]["ttft_s"])["metrics"]
            tpot = (last["latency_s"] - last["ttft_s"]) / (args.output_len - 1)
            bound = step_floor(SHAPES[args.shape], batch, args.input_len + args.output_len // 2,
                               args.bandwidth)
            rows.append((batch, tpot * 1e3, bound["ms"], bound["weight_gb"]))
    finally:
        llm.shutdown()
    print(f"| {args.shape} batch | decode step ms (TPOT) | floor ms | of floor | "
          f"weights read GB |")
    print("|---|---|---|---|---|")
    for batch, ms, floor_ms, gb in rows:
        print(f"| {batch} | {ms:.2f} | {floor_ms:.2f} | {ms / floor_ms:.2f}x | {gb:.1f} |")


if __name__ == "__main__":
    main()

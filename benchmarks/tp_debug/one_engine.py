"""One TP=2 engine on the Qwen3-0.6B-shape random checkpoint: start, 8 x 16 greedy tokens,
shut down, printing the time of each stage. `python benchmarks/tp_debug/one_engine.py eager`."""
import sys
import time

from nanovllm import LLM, SamplingParams
from nanovllm.utils.checkpoint import qwen3_0_6b_random

T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


if __name__ == "__main__":
    path = qwen3_0_6b_random()
    say(f"checkpoint {path}")
    llm = LLM(path, tensor_parallel_size=2, enforce_eager=sys.argv[1] == "eager")
    say("LLM() done")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([[i + 1] * 20 for i in range(8)], params, use_tqdm=False)
    say(f"generate done {outs[0]['token_ids'][:8]}")
    llm.shutdown()
    say("shutdown done")

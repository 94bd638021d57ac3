"""Smoke test: chat with a checkpoint (or a tiny random demo model when none is present)."""
import argparse
import os
import tempfile

from nanovllm import LLM, SamplingParams

DEFAULT_MODEL = "~/huggingface/Qwen3-0.6B"


def demo_checkpoint() -> str:
    """Build (once) a tiny random Qwen3 so the pipeline runs anywhere."""
    from benchmarks.random_checkpoints import build_checkpoint
    path = os.path.join(tempfile.gettempdir(), "nanovllm-demo-random")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        build_checkpoint(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    args = parser.parse_args()
    path = os.path.expanduser(args.model)
    if not os.path.isdir(path):
        print(f"No checkpoint at {path}. To use a real model, download one, e.g.\n"
              f"  huggingface-cli download Qwen/Qwen3-0.6B --local-dir {DEFAULT_MODEL}\n"
              "Running a tiny RANDOM demo model instead: its text is gibberish.\n")
        path = demo_checkpoint()
    llm = LLM(path, enforce_eager=True)
    tokenizer = llm.tokenizer
    prompts = ["introduce yourself", "list all prime numbers within 100"]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True)
               for p in prompts]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.6, max_tokens=256))
    for prompt, output in zip(prompts, outputs):
        print(f"\nPrompt: {prompt!r}\nCompletion: {output['text']!r}")
    llm.shutdown()


if __name__ == "__main__":
    main()

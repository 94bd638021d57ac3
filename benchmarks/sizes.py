"""The scenarios' request-set sizes, importable without nanovllm (bench.py checks its flags
against them before the timed import)."""

# Sizes per scenario: "full" for the GPU runs, "tiny" for the CPU smoke run in CI.
SIZES = {
    # Upstream nano-vLLM's bench.py: 142,827 prompt and 133,966 output tokens at full size.
    "throughput": dict(
        full=dict(num_seqs=256, input_len=(100, 1024), output_len=(100, 1024)),
        tiny=dict(num_seqs=16, input_len=(100, 300), output_len=(16, 64))),
    # Short prompts, long outputs: nearly every step is a decode step.
    "graphs": dict(
        full=dict(num_seqs=128, input_len=(64, 256), output_len=(1024, 1024)),
        tiny=dict(num_seqs=8, input_len=(16, 64), output_len=(48, 48))),
    # One whole-block system prompt before each user suffix; few output tokens.
    "prefix-cache": dict(
        full=dict(num_seqs=512, prefix_blocks=4, suffix_len=(32, 512), output_len=32),
        tiny=dict(num_seqs=12, prefix_blocks=2, suffix_len=(8, 64), output_len=4)),
    # Sequences that grow across block boundaries after admission, in a pool holding
    # pool_fraction of their peak need: the scheduler must preempt.
    "kv-pressure": dict(
        full=dict(num_seqs=128, input_len=1024, output_len=1024, pool_fraction=0.5),
        tiny=dict(num_seqs=8, input_len=200, output_len=120, pool_fraction=0.5)),
    # The standard requests, then a few long prompts arriving after them, prefilled while the
    # standard ones decode; `budget` is the chunked run's max_num_batched_tokens.
    "long-context": dict(
        full=dict(num_seqs=256, input_len=(100, 1024), output_len=(100, 1024), num_long=4,
                  long_input_len=32768, long_output_len=128, budget=16384),
        tiny=dict(num_seqs=8, input_len=(16, 64), output_len=(16, 48), num_long=2,
                  long_input_len=1000, long_output_len=8, budget=256)),
}


def sizes(name: str, tiny: bool) -> dict:
    return dict(SIZES[name]["tiny" if tiny else "full"])

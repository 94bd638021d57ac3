"""The scenarios' request sets, at full size (H200) or shrunk for the CPU smoke run (--tiny)."""
import json
import os
import random

from benchmarks.sizes import SIZES, sizes  # noqa: F401 (re-exported)
from nanovllm import SamplingParams


def max_token_id(model: str) -> int:
    """Largest prompt token id: 10,000 as upstream, or less for a tiny vocabulary."""
    with open(os.path.join(model, "config.json")) as f:
        return min(10000, json.load(f)["vocab_size"] - 1)


def standard(num_seqs: int, input_len: tuple[int, int], output_len: tuple[int, int],
             max_id: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Random prompts and lengths drawn exactly as upstream's bench.py (global random, seed 0):
    all prompts first, then all max_tokens."""
    random.seed(seed)
    prompts = [[random.randint(0, max_id) for _ in range(random.randint(*input_len))]
               for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True,
                             max_tokens=random.randint(*output_len))
              for _ in range(num_seqs)]
    return prompts, params


def shared_prefix(num_seqs: int, prefix_blocks: int, suffix_len: tuple[int, int],
                  output_len: int, block_size: int, max_id: int, seed: int,
                  shared: bool) -> tuple[list[list[int]], list[SamplingParams]]:
    """Each request: a prefix of whole blocks + its own suffix. shared=True gives every request
    the same prefix; shared=False a distinct one of the same length, with the same suffixes."""
    rng = random.Random(seed)
    suffixes = [[rng.randint(0, max_id) for _ in range(rng.randint(*suffix_len))]
                for _ in range(num_seqs)]
    prefix_len = prefix_blocks * block_size
    rng = random.Random(seed + 1)
    prefixes = [[rng.randint(0, max_id) for _ in range(prefix_len)]
                for _ in range(1 if shared else num_seqs)]
    prompts = [prefixes[0 if shared else i] + suffix for i, suffix in enumerate(suffixes)]
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=output_len)
    return prompts, [params] * num_seqs


def fixed_lengths(num_seqs: int, input_len: int, output_len: int, max_id: int,
                  seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """num_seqs random prompts of input_len tokens, each generating exactly output_len."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, max_id) for _ in range(input_len)] for _ in range(num_seqs)]
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=output_len)
    return prompts, [params] * num_seqs


def long_context(num_seqs: int, input_len: tuple[int, int], output_len: tuple[int, int],
                 num_long: int, long_input_len: int, long_output_len: int, max_id: int,
                 seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """The standard requests followed by num_long random prompts of long_input_len tokens."""
    prompts, params = standard(num_seqs, input_len, output_len, max_id, seed)
    rng = random.Random(seed + 1)
    prompts += [[rng.randint(0, max_id) for _ in range(long_input_len)] for _ in range(num_long)]
    params += [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=long_output_len)
               ] * num_long
    return prompts, params


def peak_blocks(num_tokens: int, block_size: int) -> int:
    """KV blocks a sequence holds at its end: the last sampled token is never fed back."""
    return -(-(num_tokens - 1) // block_size)


def head_counts(model: str) -> tuple[int, int]:
    """(attention heads, KV heads): a tensor-parallel size must divide both."""
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    return config["num_attention_heads"], config["num_key_value_heads"]

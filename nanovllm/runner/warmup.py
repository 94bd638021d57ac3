"""Compile-ahead warm-up: every kind of step a run can reach, run once at start-up, so that
Triton compiles each kernel variant then and never inside a user's timed run.

A kernel compiles once per specialisation: its constexprs (tile sizes picked from the step's
shape, paged or dense, sliding or not, FP8 or not), its argument dtypes, and the alignment of
its pointers and integers. Step sizes only pick among a few of them, so a handful of steps
reaches them all:

    prefill:  one sequence of n new tokens, n = 16, 32, 64, ... up to the token budget (tiles for
              long prompts, MoE block sizes), without a cached prefix (dense) and, for the
              smallest and the largest n, after one (paged: prefix hits, later chunks);
    decode:   each eager batch size of the ladder 1, 2, 3, 4, 6, 8, ... max_num_seqs, with block
              tables one and two blocks wide (one split, several); CUDA graphs cover their sizes
              when they are captured;
    sampler:  the fused draw on logits in the model dtype and in float32 (after penalties).

With LoRA the prefill and decode steps run twice: with no adapter, and with every row in slot 0
(whatever it holds: its delta goes to blocks no sequence owns), which launches the LoRA ops.

With compile threads (kernels.compile_ahead), the steps first run once with every launch only
compiling its kernel, all on threads at once, then for real.

The steps write K/V into blocks no sequence owns yet: the block manager hands them out later,
and a sequence never reads a slot before writing it. tests/runner/test_warmup_variants.py
checks that a varied workload launches no variant these steps did not.
"""
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from functools import partial
from typing import Protocol

import torch

from nanovllm.config import Config
from nanovllm.kernels.compile_ahead import compile_in_parallel
from nanovllm.kernels.compile_workers import CompileWorkers
from nanovllm.layers.attention import Attention, kv_scale_calibration
from nanovllm.layers.sampling.sampler import Sampler
from nanovllm.lora.manager import WARM_UP_LORA_ID
from nanovllm.runner.cuda_graphs import BATCH_LADDER
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence


class ModelRunner(Protocol):
    """What the warm-up reads from runner.model_runner.ModelRunner (no import cycle)."""

    config: Config
    rank: int
    device: torch.device
    block_size: int
    max_num_blocks: int
    num_kvcache_blocks: int
    attn_layers: list[Attention]
    sampler: Sampler
    compile_threads: int
    compile_workers: CompileWorkers | None

    def run(self, seqs: list[Sequence], is_prefill: bool) -> object: ...

_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)
# Interpreted kernels (CPU) compile nothing: there the warm-up would only cost time. Tests turn
# it on to check what it covers (tests/runner/test_warmup_variants.py).
WARM_UP_INTERPRETED = False
_SMALLEST_PREFILL = 16
CPU_PEAK_TOKENS = 1024  # CPU runs warm up only to calibrate FP8 KV scales: 4 x 256 tokens


def warm_up_peak(runner: ModelRunner, calibrate: bool = False) -> None:
    """Run the largest prefill step once, so the activation peak is known before sizing KV."""
    # The whole token budget over as many sequences as a step may hold (each samples, so the
    # LM head's rows peak too). Its random ids, the same on every rank, also calibrate FP8
    # KV scales (on CPU with a small batch). No KV pool yet: nothing is written or read back.
    config, cuda = runner.config, runner.device.type == "cuda"
    budget, num_seqs = config.max_num_batched_tokens, config.max_num_seqs
    if not cuda:
        budget, num_seqs = min(budget, CPU_PEAK_TOKENS), 4
    num_seqs = min(budget, num_seqs)
    length = min(budget // num_seqs, config.max_model_len)
    ids = torch.randint(config.hf_config.vocab_size, (num_seqs, length),
                        generator=torch.Generator().manual_seed(0)).tolist()
    seqs = [Sequence(row, _PARAMS, runner.block_size) for row in ids]
    for seq in seqs:
        seq.num_scheduled_tokens = len(seq)
    # kernels compile on threads first; before the peak is reset, outside FP8 calibration: in
    # this pass no kernel runs (kernels.compile_ahead)
    if runner.compile_threads:
        compile_in_parallel([partial(runner.run, seqs, True)], runner.compile_threads,
                            workers=runner.compile_workers)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with kv_scale_calibration(runner.attn_layers, runner.device) if calibrate else nullcontext():
        runner.run(seqs, True)
    if cuda:
        torch.cuda.empty_cache()


def prefill_lengths(longest: int) -> list[int]:
    """New tokens of the warm-up's prefill steps: 16, 32, 64, ... below `longest`, and it."""
    lengths, n = [], _SMALLEST_PREFILL
    while n < longest:
        lengths.append(n)
        n *= 2
    return lengths + [longest]


def eager_decode_sizes(max_num_seqs: int, graph_sizes: list[int]) -> list[int]:
    """Decode batch sizes the warm-up runs eagerly: 1, the ladder and max_num_seqs, less those
    a CUDA graph runs (every size up to the largest graph, padded to the next one)."""
    covered = max(graph_sizes, default=0)
    sizes = {b for b in BATCH_LADDER if b <= max_num_seqs} | {1, max_num_seqs}
    return sorted(b for b in sizes if b > covered)


def _sequence(num_tokens: int, block_table: list[int], block_size: int,
              lora_int_id: int) -> Sequence:
    """A sequence of num_tokens tokens over block_table (token ids are arbitrary)."""
    seq = Sequence([i % 2 for i in range(num_tokens)], _PARAMS, block_size,
                   lora_int_id=lora_int_id)
    seq.block_table = block_table
    return seq


def _prefill(runner: ModelRunner, cached: int, new: int, lora_int_id: int = 0) -> None:
    """One prefill step of a sequence with `cached` tokens in the cache and `new` to compute."""
    block_size = runner.block_size
    seq = _sequence(cached + new, list(range(-(-(cached + new) // block_size))), block_size,
                    lora_int_id)
    seq.num_cached_tokens, seq.num_scheduled_tokens = cached, new
    runner.run([seq], True)


def _decode(runner: ModelRunner, batch: int, width: int, lora_int_id: int = 0) -> None:
    """One eager decode step of `batch` sequences whose block tables are `width` blocks wide."""
    # All sequences share the blocks: they only read them, and write garbage to one slot.
    block_size = runner.block_size
    seqs = [_sequence((width - 1) * block_size + 1, list(range(width)), block_size,
                      lora_int_id) for _ in range(batch)]
    runner.run(seqs, False)


def needs_kernel_warmup(device: str, runs_triton: bool) -> bool:
    """Whether start-up runs warm_up_kernels: Triton kernels that compile (CUDA)."""
    return runs_triton and (device == "cuda" or WARM_UP_INTERPRETED)


def warm_up_steps(runner: ModelRunner, graph_sizes: list[int]) -> list[Callable[[], object]]:
    """The steps of the module docstring on the allocated KV pool (every rank alike)."""
    config, block_size = runner.config, runner.block_size
    num_blocks = runner.num_kvcache_blocks
    fits = min(config.max_model_len, num_blocks * block_size)  # one sequence's tokens at most
    budget = config.max_num_batched_tokens
    prefills = [(0, new) for new in prefill_lengths(min(budget, fits))]
    if fits > block_size:  # else no prefix fits, and no step is paged
        longest = min(budget, fits - block_size)
        prefills += [(block_size, new)
                     for new in sorted({min(_SMALLEST_PREFILL, longest), longest})]
    widths = [1, 2] if min(runner.max_num_blocks, num_blocks) >= 2 else [1]
    decodes = [(batch, width) for batch in eager_decode_sizes(config.max_num_seqs, graph_sizes)
               for width in widths]
    steps = []
    for lora_int_id in ((0, WARM_UP_LORA_ID) if config.enable_lora else (0,)):
        steps += [partial(_prefill, runner, *step, lora_int_id) for step in prefills]
        steps += [partial(_decode, runner, *step, lora_int_id) for step in decodes]
    if runner.rank == 0:
        vocab = config.hf_config.vocab_size
        steps += [partial(runner.sampler.race,
                          torch.zeros(2, vocab, dtype=dtype, device=runner.device),
                          torch.ones(2, device=runner.device))
                  for dtype in {config.torch_dtype, torch.float32}]
    return steps


def warm_up_kernels(runner: ModelRunner, graph_sizes: list[int],
                    also: Iterable[Callable[[], object]] = ()) -> None:
    """Run warm_up_steps; with compile threads, once compiling only (with `also`, steps run
    later, e.g. the graphs' forwards: one burst of compiles, not two) and then for real."""
    steps = warm_up_steps(runner, graph_sizes)
    if runner.compile_threads:
        compile_in_parallel([*steps, *also], runner.compile_threads,
                            workers=runner.compile_workers)
    for step in steps:
        step()

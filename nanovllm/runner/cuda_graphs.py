"""CUDA graphs for decode: one captured forward per batch size, replayed by the ModelRunner."""
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

from nanovllm.config import Config
from nanovllm.kernels.compile_ahead import compile_in_parallel
from nanovllm.layers.persistent_decode import PersistentDecode, bound_persistent_decode
from nanovllm.runner.step_inputs import DecodeInputs
from nanovllm.utils.context import Context, forward_context

# Powers of two and their midpoints: 1, 2, 3, 4, 6, 8, 12, ... 384, 512
BATCH_LADDER = sorted({b * m // 2 for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) for m in (2, 3)})
# Keys a sequence while a graph's variants are timed: a short chat's decode step, where the
# projections' launches and weights, not K/V, set the time
TIMING_CONTEXT = 512
_TIMED_ROUNDS = 7  # alternated replays of each variant; the median counts
# The persistent graph is kept only this much faster: within noise the per-kernel path (the
# reference) stays, so that close calls do not flip, and bf16 outputs with them, between runs
PERSISTENT_MARGIN = 0.02
_QUEUE_CYCLES = 2_000_000  # ~1 ms of GPU sleep that a timed replay is queued behind


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes with a graph: 2, 3, 4, 6, 8, ... below min(max_num_seqs, 512), and that."""
    # Powers of two and their midpoints: a decode step reads every weight whatever its batch,
    # so padding a batch up costs little, and fewer graphs start faster (upstream captures
    # every 16th). A lone sequence runs in the graph of 2.
    max_bs = min(max_num_seqs, 512)
    return [b for b in BATCH_LADDER if 1 < b < max_bs] + [max_bs]


def _decode_inputs(bs: int, max_num_blocks: int, max_loras: int, device: torch.device
                   ) -> tuple[torch.Tensor, tuple]:
    """(packed buffer, DecodeInputs.unpack's views of it) of the graph of bs sequences."""
    buf = torch.zeros(DecodeInputs.size(bs, max_num_blocks, max_loras), dtype=torch.int32,
                      device=device)
    views = DecodeInputs.unpack(buf, bs, max_num_blocks, max_loras)
    context = views[3]
    context.slot_mapping.fill_(-1)  # capture runs write nothing into the KV cache
    if context.lora_slots is not None:
        context.lora_slots.fill_(-1)
    return buf, views


def _model_inputs(step: tuple[torch.Tensor, tuple]) -> tuple:
    """(input ids, positions, context) of a graph's _decode_inputs."""
    input_ids, positions, _, context = step[1]
    return input_ids, positions, context


def _forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
             context: Context) -> torch.Tensor:
    """The model's hidden states for a decode step's inputs (eager)."""
    with forward_context(context):
        return model(input_ids, positions)


@torch.inference_mode()  # graph input buffers are inference tensors
def capture_decode_graphs(model: nn.Module, config: Config, max_num_blocks: int,
                          num_kv_blocks: int, device: torch.device, compile_threads: int = 0
                          ) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, tuple],
                                     torch.Tensor, dict[int, tuple[float, float]]]:
    """(graphs, input buffers with their unpacked views, output buffer, timed variants) for
    graph_batch_sizes, captured largest first; with compile_threads, every size's kernels
    compile on threads first. A persistent decode layer bound as measured
    (layers.persistent_decode) is captured on and off at each size it takes, and the faster
    graph kept: timed variants {batch size: (persistent ms, per-kernel ms)}."""
    # Each graph reads its own packed input buffer (DecodeInputs); all share one output buffer
    # and memory pool. With LoRA, its kernels are captured too (rows of slot -1: their deltas
    # are zeros).
    graph_bs = graph_batch_sizes(config.max_num_seqs)
    max_loras = config.max_loras if config.enable_lora else 0
    steps = {bs: _decode_inputs(bs, max_num_blocks, max_loras, device) for bs in graph_bs}
    whole = bound_persistent_decode(model)
    timed = whole if whole is not None and whole.measured else None
    if compile_threads:  # kernels.compile_ahead, both variants where capture times two
        forwards = [partial(_forward, model, *_model_inputs(steps[bs])) for bs in graph_bs]
        forwards += [partial(_enabled, timed, forwards[i]) for i, bs in enumerate(graph_bs)
                     if timed is not None and timed.takes(bs)]
        compile_in_parallel(forwards, compile_threads)
    outputs = torch.zeros(graph_bs[-1], config.hf_config.hidden_size, dtype=config.torch_dtype,
                          device=device)
    graphs, inputs, times, pool = {}, {}, {}, None
    for bs in reversed(graph_bs):
        if timed is not None and timed.takes(bs):
            graph, ms = _faster_variant(model, steps[bs], outputs, pool, timed,
                                        (num_kv_blocks, config.kvcache_block_size))
            if ms is not None:
                times[bs] = ms
        else:
            graph = _capture(model, steps[bs], outputs, pool)
        pool = pool or graph.pool()
        graphs[bs], inputs[bs] = graph, steps[bs]
        torch.cuda.synchronize()
    if timed is not None:
        timed.enabled = False  # eager steps run the per-kernel path (none <= 16 with graphs)
    return graphs, inputs, outputs, times


def _capture(model: nn.Module, step: tuple[torch.Tensor, tuple], outputs: torch.Tensor,
             pool: tuple | None) -> torch.cuda.CUDAGraph:
    """The graph of a decode step over step's input buffer, warmed up eagerly first."""
    input_ids, positions, context = _model_inputs(step)
    bs = input_ids.size(0)
    graph = torch.cuda.CUDAGraph()
    with forward_context(context):
        outputs[:bs] = model(input_ids, positions)  # warm up
        with torch.cuda.graph(graph, pool):
            outputs[:bs] = model(input_ids, positions)
    return graph


def _enabled(whole: PersistentDecode, forward: partial) -> object:
    """forward with the persistent decode layer enabled (steps run one at a time)."""
    whole.enabled = True
    try:
        return forward()
    finally:
        whole.enabled = False


def _faster_variant(model: nn.Module, step: tuple[torch.Tensor, tuple], outputs: torch.Tensor,
                    pool: tuple | None, whole: PersistentDecode, kv_blocks: tuple[int, int]
                    ) -> tuple[torch.cuda.CUDAGraph, tuple[float, float] | None]:
    """(the graph kept, (persistent ms, per-kernel ms)): the step captured with the persistent
    decode layer and without, replays alternated with every sequence at TIMING_CONTEXT keys
    (the captured zero lengths would time no attention); the persistent graph is kept when
    PERSISTENT_MARGIN faster. (the graph, None) where the layer declined the step (e.g. an
    FP8 KV cache): one variant, nothing timed."""
    whole.enabled, whole.launches = True, 0
    variants = [_capture(model, step, outputs, pool)]
    if not whole.launches:
        return variants[0], None
    whole.enabled = False
    variants.append(_capture(model, step, outputs, pool or variants[0].pool()))
    with _timing_lengths(_model_inputs(step)[2], *kv_blocks):
        ms = replay_times(variants, _TIMED_ROUNDS)
    return variants[0 if ms[0] < ms[1] * (1 - PERSISTENT_MARGIN) else 1], (ms[0], ms[1])


@contextmanager
def _timing_lengths(context: Context, num_kv_blocks: int, block_size: int) -> Iterator[None]:
    """A graph's context lengths at TIMING_CONTEXT (or its table's width), each sequence over
    blocks of its own (read from HBM, not L2), then zeros again; slots stay -1: no K/V written."""
    rows, width = context.block_tables.shape
    keys = min(TIMING_CONTEXT, width * block_size)
    used = -(-keys // block_size)
    ids = torch.arange(rows * used, dtype=torch.int32, device=context.block_tables.device)
    context.block_tables[:, :used] = (ids % num_kv_blocks).view(rows, used)
    context.context_lens.fill_(keys)
    try:
        yield
    finally:
        context.block_tables.zero_()
        context.context_lens.zero_()


def replay_times(graphs: list[torch.cuda.CUDAGraph], rounds: int) -> list[float]:
    """Milliseconds per replay of each graph on the GPU: the median of `rounds`, replays
    alternated, each queued behind a GPU sleep so that its launch on the host is not timed
    (decode launches a step while the one before runs)."""
    for graph in graphs:
        graph.replay()  # untimed: the first replay uploads the graph
    times: list[list[float]] = [[] for _ in graphs]
    for _ in range(rounds):
        for graph, own in zip(graphs, times):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(_QUEUE_CYCLES)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            own.append(start.elapsed_time(end))
    return [sorted(own)[rounds // 2] for own in times]

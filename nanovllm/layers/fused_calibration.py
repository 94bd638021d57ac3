"""Which decode steps run each fused projection kernel, measured at start-up on the model's own
layers (CUDA): fixed limits tuned on one shape cost another 5-9% (Llama-3.1-8B).

For each projection class (its type and weight shape: qkv_proj, gate_up_proj, o_proj and
down_proj each once) and each decode step size the engine runs (the CUDA-graph batch sizes up
to 256), the fused kernel and the unfused path it replaces are each captured in a CUDA graph
of a few calls (as decode replays them: no launch gaps) and timed by CUDA events. The calls
take the class's first layers in turn and L2 is emptied before each timed replay, so that
each call reads its weights from HBM, as in a decode step, not from L2, where one layer's
weights called 8 times sat after the first. The limit bound is the step size up to which the
fused kernel runs with the least summed time.

    qkv_proj:      qkv_rope_store                  vs  GEMM + q/k norm, RoPE, K/V write
    gate_up_proj:  gate_up_silu                    vs  GEMM + SiLU-and-mul
    o/down_proj:   split_k_linear + partials norm  vs  GEMM + add + RMSNorm

The GEMM is the layer's own (LinearBase.linear): for FP8 weights W8A16 split-K up to 16 tokens,
beyond that W8A8 (activation quantization + FP8 GEMM), against the fused kernels' W8A16, so FP8
models get their own limits.

Their kernels compile on threads first; the captures are what is left (~120 for Qwen3-0.6B).
"""
import functools
import itertools
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.kernels.compile_ahead import compile_in_parallel
from nanovllm.kernels.compile_workers import CompileWorkers
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import LinearBase, RowParallelLinear
from nanovllm.layers.packed_linear import MergedColumnParallelLinear, QKVParallelLinear
from nanovllm.utils.context import Context, forward_context
from nanovllm.utils.graph_capture import keep_caches

CALIBRATION_MAX_TOKENS = 256  # beyond, the GEMMs' own tiles fill the GPU (never measured to win)
_CALLS_PER_STEP, _REPLAYS = 8, 3

LayerClass = tuple[str, tuple[int, ...]]
Step = Callable[[], object]
# (projection, its parent module, step size, fused) -> that decode step's work
StepMaker = Callable[[LinearBase, nn.Module | None, int, bool], Step]
StepTimer = Callable[[list[Step]], list[float]]  # steps -> seconds per call of each


def layer_class(linear: LinearBase) -> LayerClass:
    """Projections of one class share a measured limit: their type and weight shape."""
    return type(linear).__name__, tuple(linear.weight.shape)


def choose_max_tokens(sizes: list[int], fused_s: list[float], unfused_s: list[float]) -> int:
    """The limit t (0 or one of `sizes`, ascending) whose steps, fused up to t and unfused
    above, take the least summed time; ties keep the smaller limit."""
    best, best_total = 0, sum(unfused_s)
    for i, size in enumerate(sizes):
        total = sum(fused_s[:i + 1]) + sum(unfused_s[i + 1:])
        if total < best_total:
            best, best_total = size, total
    return best


def class_layers(model: nn.Module
                 ) -> dict[LayerClass, list[tuple[LinearBase, nn.Module | None]]]:
    """The first _CALLS_PER_STEP projections of each class bound to a fused kernel, each with
    its parent module (a timing graph's calls: with fewer layers some read theirs twice)."""
    parents = {child: parent for parent in model.modules() for child in parent.children()}
    found: dict[LayerClass, list[tuple[LinearBase, nn.Module | None]]] = {}
    for module in model.modules():
        if isinstance(module, LinearBase) and module.fused_decode_max_tokens:
            layers = found.setdefault(layer_class(module), [])
            if len(layers) < _CALLS_PER_STEP:
                layers.append((module, parents.get(module)))
    return found


def rotating(steps: list[Step]) -> Step:
    """One step that runs `steps` in turn, a call each (a graph's calls read different layers)."""
    turn = itertools.cycle(steps)
    return lambda: next(turn)()


def calibrate(model: nn.Module, sizes: list[int], time_steps: StepTimer,
              make_step: StepMaker | None = None) -> dict[LayerClass, int]:
    """{layer class: limit} for the projections bound to a fused kernel: each size's step
    fused and unfused (make_step, default decode_step) over the class's first layers in turn
    (rotating), all timed by one call of time_steps."""
    make_step = make_step or decode_step
    classes = class_layers(model)
    # class-major, then size, fused before unfused: [c0 n0 F, c0 n0 U, c0 n1 F, ...]
    steps = [rotating([make_step(proj, parent, n, fused) for proj, parent in layers])
             for layers in classes.values() for n in sizes for fused in (True, False)]
    if not steps:
        return {}
    try:
        times = time_steps(steps)
    finally:
        _random_input.cache_clear()  # the steps hold what they use
    assert len(times) == len(steps), f"{len(times)} times for {len(steps)} steps"
    per_class = 2 * len(sizes)
    limits = {}
    for i, key in enumerate(classes):
        own = times[i * per_class:(i + 1) * per_class]
        limits[key] = choose_max_tokens(sizes, own[0::2], own[1::2])
    return limits


def _qkv_step(proj: QKVParallelLinear, parent: nn.Module, x: torch.Tensor, fused: bool
              ) -> Step:
    """parent.attend's projection part: q, and K/V into parent.attn's cache."""
    from nanovllm.kernels.linear.fused import qkv_rope_store
    attn, n = parent.attn, x.shape[0]
    # int32 as a decode step's packed inputs; slots of blocks no sequence owns yet
    positions = torch.arange(n, dtype=torch.int32, device=x.device)
    slots = torch.arange(n, dtype=torch.int32, device=x.device)
    norm = attn.q_norm is not None
    if fused:
        return lambda: qkv_rope_store(
            x, proj.weight, proj.bias, attn.num_heads, attn.num_kv_heads, positions,
            attn.q_norm.weight if norm else None, attn.k_norm.weight if norm else None,
            attn.q_norm.eps if norm else 0.0, attn.rotary_emb.cos_sin_cache, attn.k_cache,
            attn.v_cache, slots, (attn.k_scale, attn.v_scale), **proj.fused_scales())
    sizes = [attn.num_heads * attn.head_dim] + 2 * [attn.num_kv_heads * attn.head_dim]

    def unfused() -> object:
        q, k, v = proj.linear(x, proj.bias).split(sizes, dim=-1)
        q, k, v = (t.view(n, -1, attn.head_dim) for t in (q, k, v))
        with forward_context(Context(is_prefill=False, slot_mapping=slots)):
            return attn.backend.rope_and_store(attn, positions, q, k, v)
    return unfused


@functools.cache
def _random_input(n: int, features: int, dtype: torch.dtype, device: torch.device
                  ) -> torch.Tensor:
    """A step's random input of this shape, shared by the class's layers (read only)."""
    return torch.randn(n, features, dtype=dtype, device=device)


def decode_step(proj: LinearBase, parent: nn.Module | None, n: int, fused: bool) -> Step:
    """One decode step's work that the projection's fused kernel replaces, for n tokens."""
    (out_features, in_features), device = proj.weight.shape, proj.weight.device
    dtype = proj.fused_format()[0]  # the activations' (FP8 weights hold codes)
    x = _random_input(n, in_features, dtype, device)
    if isinstance(proj, QKVParallelLinear):
        return _qkv_step(proj, parent, x, fused)
    if isinstance(proj, MergedColumnParallelLinear):
        act = parent.act_fn
        if fused:
            return lambda: proj.gate_up_silu(x)
        return lambda: act(proj.linear(x, proj.bias))
    assert isinstance(proj, RowParallelLinear)
    # the add + RMSNorm after it: the next norm's shape, its weight's values do not matter
    norm = RMSNorm(out_features).to(device, dtype)
    norm.fused = True
    residual = _random_input(n, out_features, dtype, device)
    if fused:
        return lambda: norm.add_partials(proj.split_k_partials(x), residual)
    return lambda: norm(proj.linear(x, proj.bias), residual)


def cuda_graph_times(steps: list[Step], compile_threads: int = 0,
                     workers: CompileWorkers | None = None) -> list[float]:
    """Seconds per call of each step, each from its own CUDA graph of _CALLS_PER_STEP calls
    (the median of _REPLAYS replays); with compile_threads, their kernels compile on threads
    (through workers, if any) first (kernels.compile_ahead)."""
    # One graph per step: timing events recorded between the steps inside one shared graph
    # chose limits that slowed batch-1 decode by 19% on the H200 (2026-12-02).
    if compile_threads:
        compile_in_parallel(steps, compile_threads, workers=workers)
    # ~120 captures for Qwen3-0.6B, in one memory pool: each graph's replays end before the
    # next capture reuses its memory. The graphs live until the last is timed: a dropped
    # graph's pool waits for empty_cache, which the run skips, to be released
    pool, graphs = torch.cuda.graph_pool_handle(), []
    l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    evict = torch.empty(2 * l2_bytes, dtype=torch.uint8, device="cuda")
    with keep_caches():
        return [_graph_time(step, pool, graphs, evict) for step in steps]


def _graph_time(step: Step, pool: tuple, keep: list, evict: torch.Tensor) -> float:
    """Seconds per call of step, from a CUDA graph of _CALLS_PER_STEP calls (captured in pool,
    appended to keep), each timed replay after writing `evict` (twice L2) to empty L2."""
    for _ in range(_CALLS_PER_STEP):  # every layer's kernels loaded (or compiled) outside it
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool):
        for _ in range(_CALLS_PER_STEP):
            step()
    keep.append(graph)
    graph.replay()  # untimed: the first replay uploads the graph
    times = []
    for _ in range(_REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        evict.zero_()  # before the start event: not timed
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / _CALLS_PER_STEP)
    return sorted(times)[len(times) // 2]

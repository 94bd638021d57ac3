"""CUDA graphs for decode: one captured forward per batch size, replayed by the ModelRunner."""
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from nanovllm.config import Config
from nanovllm.kernels.compile_ahead import compile_in_parallel
from nanovllm.kernels.compile_workers import CompileWorkers
from nanovllm.runner.step_inputs import DecodeInputs
from nanovllm.utils.context import Context, forward_context

# Powers of two and their midpoints: 1, 2, 3, 4, 6, 8, 12, ... 384, 512
BATCH_LADDER = sorted({b * m // 2 for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) for m in (2, 3)})


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 3, 4, 6, 8, ... below min(max_num_seqs, 512), and that."""
    # Powers of two and their midpoints: a decode step reads every weight whatever its batch,
    # so padding a batch up costs little, and fewer graphs start faster (upstream captures
    # every 16th). A lone sequence has its own: its projections run kernels.linear.gemv.
    max_bs = min(max_num_seqs, 512)
    return [b for b in BATCH_LADDER if b < max_bs] + [max_bs]


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


@torch.inference_mode()
def _forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
             context: Context) -> torch.Tensor:
    """The model's hidden states for a decode step's inputs (eager)."""
    with forward_context(context):
        return model(input_ids, positions)


@torch.inference_mode()  # graph input buffers are inference tensors
def graph_inputs(config: Config, max_num_blocks: int, device: torch.device
                 ) -> dict[int, tuple[torch.Tensor, tuple]]:
    """Each graph's packed input buffer with DecodeInputs.unpack's views, by batch size."""
    max_loras = config.max_loras if config.enable_lora else 0
    return {bs: _decode_inputs(bs, max_num_blocks, max_loras, device)
            for bs in graph_batch_sizes(config.max_num_seqs)}


def graph_forwards(model: nn.Module, inputs: dict[int, tuple]) -> list[Callable[[], object]]:
    """Each graph's forward, eager, on its inputs: what a compile-only pass runs."""
    return [partial(_forward, model, *_model_inputs(step)) for step in inputs.values()]


@torch.inference_mode()
def capture_decode_graphs(model: nn.Module, config: Config, max_num_blocks: int,
                          device: torch.device, compile_threads: int = 0,
                          workers: CompileWorkers | None = None,
                          compiled: dict[int, tuple] | None = None
                          ) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, tuple],
                                     torch.Tensor]:
    """(graphs, input buffers with their unpacked views, output buffer) for
    graph_batch_sizes, captured largest first; with compile_threads, every size's kernels
    compile on threads (through workers, if any) first, unless `compiled` gives graph_inputs
    whose forwards a compile pass ran already."""
    # Each graph reads its own packed input buffer (DecodeInputs); all share one output buffer
    # and memory pool. With LoRA, its kernels are captured too (rows of slot -1: their deltas
    # are zeros).
    graph_bs = graph_batch_sizes(config.max_num_seqs)
    steps = compiled or graph_inputs(config, max_num_blocks, device)
    if compile_threads and compiled is None:  # kernels.compile_ahead
        compile_in_parallel(graph_forwards(model, steps), compile_threads, workers=workers)
    outputs = torch.zeros(graph_bs[-1], config.hf_config.hidden_size, dtype=config.torch_dtype,
                          device=device)
    graphs, inputs, pool = {}, {}, None
    for bs in reversed(graph_bs):
        input_ids, positions, context = _model_inputs(steps[bs])
        graph = torch.cuda.CUDAGraph()
        with forward_context(context):
            # An eager run first loads what the capture launches. The compile-ahead pass
            # loaded every Triton variant already, so only the first graph and the lone
            # token's (its own GEMV path) warm up then.
            if not compile_threads or pool is None or bs == 1:
                outputs[:bs] = model(input_ids, positions)
            with torch.cuda.graph(graph, pool):
                outputs[:bs] = model(input_ids, positions)
        pool = pool or graph.pool()
        graphs[bs], inputs[bs] = graph, steps[bs]
        torch.cuda.synchronize()
    return graphs, inputs, outputs

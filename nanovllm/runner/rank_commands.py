"""The commands every rank obeys besides "run": sleep, wake_up, update_weights and the LoRA
adapters' add_lora and remove_lora.

Sleep frees the KV pool and CUDA graphs, and moves the weights to pinned host memory (level 1)
or drops them, keeping each parameter's shape and strides (level 2: update_weights refills
them); buffers go to host. Parameters keep their identity (only `.data` moves), so weight
loaders, tied weights and references stay valid; wake_up allocates the same number of KV blocks,
so block ids keep their meaning.

Weight updates go through the loaders. With tensor parallelism every rank needs every full
tensor (each loader cuts its shard): names, shapes and dtypes go through the command channel,
and rank 0 broadcasts the tensors one by one over the process group. Adapters travel the same
way (rank 0 read and checked them); every rank keeps its own host copy, and LoRA slots, being
buffers, sleep and wake with the weights.
"""
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from nanovllm.lora.adapter import LoRAAdapter, lora_tensors
from nanovllm.runner.model_runner import ModelRunner
from nanovllm.utils.loader import load_weights

WeightSpec = tuple[str, tuple[int, ...], torch.dtype]  # name, shape, dtype


def sleep(runner: ModelRunner, level: int) -> None:
    """Free this rank's KV pool and graphs; move (level 1) or drop (level 2) its weights."""
    runner.wait_idle()
    runner.free_kv_cache_and_graphs()
    runner.token_counts.clear()
    for param in runner.model.parameters():
        if level == 1:
            param.data = _to_host(param.data)
        else:
            param.dropped_layout = param.shape, param.stride()  # k-major weights keep theirs
            param.data = param.data.new_empty(0)
    _move_buffers(runner, _to_host)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
        torch.cuda.empty_cache()
    all_ranks_done(runner)


def wake_up(runner: ModelRunner) -> None:
    """Bring weights (or, after level 2, room for them), the KV pool and the graphs back."""
    device = runner.device
    for param in runner.model.parameters():
        layout = getattr(param, "dropped_layout", None)
        if layout is not None:
            param.data = param.data.new_empty_strided(*layout, device=device)
            del param.dropped_layout
        else:
            param.data = param.data.to(device, non_blocking=True)
    _move_buffers(runner, lambda t: t.to(device, non_blocking=True))
    runner.create_kv_cache(runner.num_kvcache_blocks)
    if runner.use_cuda_graph:
        runner.capture_cudagraph()
    all_ranks_done(runner)


def all_ranks_done(runner: ModelRunner) -> None:
    """A barrier: rank 0 writes no command before every worker has read this one."""
    if runner.world_size > 1:
        dist.barrier()
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy, pinned when it comes from the GPU so that wake_up copies back fast."""
    if not tensor.is_cuda:
        return tensor
    return torch.empty_like(tensor, device="cpu", pin_memory=True).copy_(tensor)


def _move_buffers(runner: ModelRunner, move) -> None:
    for module in runner.model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, move(buffer))


@torch.no_grad()
def update_weights(runner: ModelRunner, specs: list[WeightSpec],
                   weights: list[torch.Tensor] | None = None) -> None:
    """Load the named tensors; `weights` (rank 0 only) are on any device, in `specs`' order."""
    load_weights(runner.model, _received(runner, specs, weights))
    all_ranks_done(runner)


def _received(runner: ModelRunner, specs: list[WeightSpec],
              weights: list[torch.Tensor] | None) -> Iterator[tuple[str, torch.Tensor]]:
    for i, (name, shape, dtype) in enumerate(specs):
        if runner.world_size == 1:
            yield name, weights[i]
            continue
        if runner.rank == 0:
            tensor = weights[i].to(runner.device).contiguous()
        else:
            tensor = torch.empty(shape, dtype=dtype, device=runner.device)
        dist.broadcast(tensor, src=0)
        yield name, tensor


def add_lora(runner: ModelRunner, header: tuple[int, int, float], specs: list[WeightSpec],
             adapter: LoRAAdapter | None = None) -> None:
    """Keep an adapter (id, rank, scaling; tensors by spec) in this rank's host cache; rank 0
    is given it, the others receive its tensors."""
    if runner.world_size > 1:
        tensors = None if adapter is None else lora_tensors(adapter)
        received = [t.cpu() for _, t in _received(runner, specs, tensors)]
    if adapter is None:
        weights = {}
        for (name, _, _), tensor in zip(specs, received):
            layer, module, ab = name.split(".")
            weights.setdefault((int(layer), module), []).append(tensor)
        adapter = LoRAAdapter(*header, {key: tuple(pair) for key, pair in weights.items()})
    runner.lora_manager.add(adapter)
    all_ranks_done(runner)


def remove_lora(runner: ModelRunner, lora_int_id: int) -> None:
    runner.lora_manager.remove(lora_int_id)


# The fixed set of commands a rank obeys (an executor adds "shutdown", which ends a worker).
RANK_COMMANDS: dict[str, Callable] = {"run": ModelRunner.run, "sleep": sleep,
                                      "wake_up": wake_up, "update_weights": update_weights,
                                      "add_lora": add_lora, "remove_lora": remove_lora}

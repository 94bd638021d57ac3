"""In-place weight updates of one rank, through the same per-parameter loaders as loading.

With tensor parallelism every rank needs every full tensor (each loader cuts its own shard):
the engine sends the names, shapes and dtypes through the command channel, and rank 0
broadcasts the tensors themselves, one by one, over the process group.
"""
from collections.abc import Iterator

import torch
import torch.distributed as dist

from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.sleep_mode import all_ranks_done
from nanovllm.utils.loader import load_weights

WeightSpec = tuple[str, tuple[int, ...], torch.dtype]  # name, shape, dtype


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

"""The float32 partial rows a lone token's one-kernel MLP (kernels.linear.gemv_mlp) adds down_proj
into. Atomics need rows that start at zero, and no launch clears them: a model's layers take
turns on two pairs of rows, and each layer's kernel clears the pair the next layer adds into,
whose last reader (this layer's qkv_proj) finished before the kernel's PDL wait. That holds when
every layer of a step takes its turn and the layer count is even, so that a step leaves its
last layer's pair for the next step's first layer to clear. No Triton here: the decoder holds
one MlpPartials per model.
"""
import torch

SPLITS = 6  # partial rows of a pair (down_proj's split-K count, which qkv_proj's norm sums)


class MlpPartials:
    """Two pairs of zeroed float32 rows [2, SPLITS, 1, N] for one model, made at first use (a
    CUDA graph's capture runs an eager forward first, so they are never made inside one)."""

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None

    def pair(self, parity: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the pair layer `parity` adds into, the pair it clears) for like's device and width."""
        width = like.shape[-1]
        if self.rows is None or self.rows.device != like.device or self.rows.shape[-1] != width:
            self.rows = torch.zeros(2, SPLITS, 1, width, dtype=torch.float32, device=like.device)
        return self.rows[parity], self.rows[1 - parity]

    def reset(self) -> None:
        """Zero both pairs: after a step that stopped between layers, or whose layers did not
        all take their turn."""
        if self.rows is not None:
            self.rows.zero_()

"""The per-step forward context: the one piece of global state, set by a `with` block."""
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class Context:
    """What attention layers need to know about the current step's batch."""

    is_prefill: bool = False
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    slot_mapping: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    prefix_cached: bool = False  # prefill whose keys include blocks already in the cache
    logits_indices: torch.Tensor | None = None  # prefill rows that sample; None: no row does


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


@contextmanager
def forward_context(context: Context):
    """Make `context` current for the duration of one forward pass."""
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, context
    try:
        yield context
    finally:
        _CONTEXT = previous


def reset_context() -> None:
    global _CONTEXT
    _CONTEXT = Context()

"""The per-step forward context: set by a `with` block around each forward pass, per thread."""
import threading
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
    # [tokens] int32: each row's adapter slot (-1: none); None: no row runs through an adapter
    lora_slots: torch.Tensor | None = None


_EMPTY = Context()  # what a thread without a forward pass reads
# Per thread: an engine's step sets and reads it on one thread, and a step left running on
# another thread (see Rank0Thread) must not change what a second engine's layers read.
_local = threading.local()


def get_context() -> Context:
    return getattr(_local, "context", _EMPTY)


@contextmanager
def forward_context(context: Context):
    """Make `context` current for the duration of one forward pass on this thread."""
    previous, _local.context = get_context(), context
    try:
        yield context
    finally:
        _local.context = previous


def reset_context() -> None:
    _local.context = Context()

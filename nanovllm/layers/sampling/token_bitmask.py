"""Per-row token bitmasks of structured outputs: filled on the host, applied before sampling.

    bitmask [B, ceil(V / 32)] int32: bit j of word w (w * 32 + j = token id) set = allowed
"""
import functools

import torch


def fill_token_bitmask(matchers: list, vocab_size: int,
                       device: torch.device) -> torch.Tensor | None:
    """Each row's allowed next tokens from its xgrammar GrammarMatcher (None: every token), on
    `device`; None when no row has a matcher."""
    if all(matcher is None for matcher in matchers):
        return None
    # pinned on CUDA so the copy is asynchronous; empty, not full: a parallel fill of the
    # whole mask would leave torch's OpenMP threads spinning on the cores xgrammar fills on
    bitmask = torch.empty((len(matchers), -(-vocab_size // 32)), dtype=torch.int32,
                          pin_memory=device.type == "cuda")
    rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
    free = [row for row, matcher in enumerate(matchers) if matcher is None]
    if free:
        bitmask[free] = -1  # every bit set: any token
    # xgrammar fills the rows on its own threads (a large batch's rows take ~10 us each)
    _batch_matcher().batch_fill_next_token_bitmask([matchers[r] for r in rows], bitmask, rows)
    return bitmask.to(device, non_blocking=True)


@functools.cache
def _batch_matcher() -> object:
    """xgrammar's thread pool for batched fills; built on first use (matchers exist only once
    xgrammar is imported)."""
    import xgrammar
    return xgrammar.BatchGrammarMatcher()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with -inf where the row's bit is clear (out of place: raw logits stay)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [B, 32 * words]
    return logits.masked_fill(~allowed[:, :logits.size(1)], float("-inf"))

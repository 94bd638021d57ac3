"""Logit steering on the device: allowed_token_ids, bad_words, min_tokens and logit_bias.

Built each step, on the host, for the rows that ask for one (SamplingParams.steers) as sparse
index tensors, and applied to float32 logits in vLLM V1's order, before the penalties:

    allowed_token_ids  -inf outside the set            (row, token) pairs kept
    bad_words          -inf on a word's last token      (row, token) pairs banned
    min_tokens         -inf on EOS and stop_token_ids   (row, token) pairs banned
    logit_bias         + bias                           (row, token, bias), added

A bias is added (never written), so a banned or disallowed token stays -inf under it.
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanovllm.sequence import Sequence


def banned_tokens(seq: Sequence, length: int | None = None) -> list[int]:
    """The row's tokens set to -inf: min_tokens' stop ids while the completion is shorter, and
    the last token of each bad word whose other tokens end the completion (vLLM's rule).
    `length`: the sequence's length when its step was launched (default len(seq))."""
    params = seq.sampling_params
    banned = []
    # the length counts a pending token (pipelined): the completion's length at this draw
    length = len(seq) if length is None else length
    if length - seq.num_prompt_tokens < params.min_tokens:
        banned += params._min_tokens_stop_ids
    words = params._bad_words_token_ids
    if words:
        # The engine samples a bad_words row once the previous step is committed: ids on host.
        assert seq.token_offset + len(seq.token_ids) == length, \
            "bad_words need the whole completion on the host"
        longest = max(map(len, words))
        start = max(seq.num_prompt_tokens, len(seq.token_ids) - longest + 1)
        tail = seq.token_ids[start:]  # the completion's last (longest - 1) tokens at most
        for word in words:
            prefix = word[:-1]
            if len(prefix) <= len(tail) and tail[len(tail) - len(prefix):] == prefix:
                banned.append(word[-1])
    return banned


@dataclass
class Steering:
    """A batch's steering as index tensors on the device (rows index the batch)."""

    allowed_rows: torch.Tensor  # [R] int64: rows restricted to an allowed set
    allowed: torch.Tensor  # [2, A] int64: (row, token) pairs those rows keep
    banned: torch.Tensor  # [2, N] int64: (row, token) pairs set to -inf
    bias: torch.Tensor  # [2, K] int64: (row, token) pairs that get a bias
    bias_values: torch.Tensor  # [K] float32

    @staticmethod
    def build(seqs: list[Sequence], to_device: Callable[[list, torch.dtype], torch.Tensor],
              lengths: list[int] | None = None) -> "Steering | None":
        """The rows' steering, or None when no row steers; `to_device(rows, dtype)` copies;
        `lengths`: the sequences' lengths at their step's launch (default len(seq))."""
        allowed_rows, allowed, banned, bias, values = [], ([], []), ([], []), ([], []), []
        for row, seq in enumerate(seqs):
            params = seq.sampling_params
            if not params.steers:
                continue
            if params.allowed_token_ids is not None:
                allowed_rows.append(row)
                _extend(allowed, row, params.allowed_token_ids)
            _extend(banned, row, banned_tokens(seq, lengths[row] if lengths else None))
            if params.logit_bias:
                _extend(bias, row, list(params.logit_bias))
                values += params.logit_bias.values()
        if not (allowed_rows or banned[0] or bias[0]):
            return None
        parts = [allowed_rows, *allowed, *banned, *bias]
        flat = to_device([i for part in parts for i in part], torch.int64)  # one copy
        rows, *pairs = flat.split([len(part) for part in parts])
        return Steering(rows, torch.stack(pairs[0:2]), torch.stack(pairs[2:4]),
                        torch.stack(pairs[4:6]), to_device(values, torch.float32))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 logits [B, V] steered; a copy, so raw logprobs still see the model's."""
        logits = logits.to(torch.float32, copy=True)
        if self.allowed_rows.numel():
            kept = logits[self.allowed[0], self.allowed[1]]
            logits[self.allowed_rows] = float("-inf")
            logits[self.allowed[0], self.allowed[1]] = kept
        if self.banned.size(1):
            logits[self.banned[0], self.banned[1]] = float("-inf")
        if self.bias.size(1):
            logits.index_put_((self.bias[0], self.bias[1]), self.bias_values, accumulate=True)
        return logits


def _extend(pairs: tuple[list[int], list[int]], row: int, tokens: list[int]) -> None:
    pairs[0].extend([row] * len(tokens))
    pairs[1].extend(tokens)

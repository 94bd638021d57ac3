"""Prompt logprobs: log_softmax of the raw logits at each prompt position but the last, at the
next prompt token and the top k.

They need every prompt position's hidden state, so a sequence that asks gets no prefix-cache
hits (as in vLLM): simpler than keeping logprobs per cached block. Each prefill chunk scores its
own positions, CHUNK at a time through the LM head, so the logits never exceed CHUNK rows.
"""
import torch

from nanovllm.layers.sampling.sampler import LogprobsTensors, compute_logprobs
from nanovllm.sequence import Sequence
from nanovllm.utils.context import Context, forward_context

CHUNK = 512


def wants_prompt_logprobs(seqs: list[Sequence]) -> bool:
    return any(seq.num_prompt_logprobs is not None for seq in seqs)


def prompt_logprobs(model: torch.nn.Module, hidden: torch.Tensor, seqs: list[Sequence]
                    ) -> list[tuple[int, int, LogprobsTensors]]:
    """(row, first position, [positions, 1 + k] logprobs) per sequence of the step that asks.
    Every rank calls this (the LM head gathers its shards); rank 0 alone gets results."""
    results, start = [], 0
    for row, seq in enumerate(seqs):
        num_new = seq.num_scheduled_tokens
        if seq.num_prompt_logprobs is not None:
            first = seq.num_cached_tokens
            num_scored = min(num_new, len(seq) - 1 - first)  # len(seq): the prompt, here
            logprobs = _one(model, hidden[start:start + num_scored], seq, first)
            if logprobs is not None:
                results.append((row, first, logprobs))
        start += num_new
    return results


def _one(model: torch.nn.Module, hidden: torch.Tensor, seq: Sequence,
         first: int) -> LogprobsTensors | None:
    """Position first + i's logits scored at token first + i + 1, CHUNK positions at a time."""
    ids, values = [], []
    for begin in range(0, hidden.size(0), CHUNK):
        with forward_context(Context()):  # not prefill: the head keeps every row
            logits = model.compute_logits(hidden[begin:begin + CHUNK])
        if logits is None:  # ranks > 0
            continue
        lo = first + 1 + begin  # rank 0 holds every token id (token_offset 0)
        targets = torch.tensor(seq.token_ids[lo:lo + logits.size(0)], dtype=torch.int64)
        part = compute_logprobs(logits, targets.to(logits.device, non_blocking=True),
                                seq.num_prompt_logprobs)
        ids.append(part.token_ids)
        values.append(part.logprobs)
    if not ids:
        return None
    return LogprobsTensors(torch.cat(ids), torch.cat(values))

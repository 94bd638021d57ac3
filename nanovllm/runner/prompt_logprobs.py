"""Prompt logprobs: log_softmax of the model's logits at each prompt position but the last, at
the prompt's next token and at the top k (raw logits: no sampling parameter applies).

They need the hidden state of every prompt position, so a sequence that asks for them gets no
prefix-cache hits (as vLLM does), which is simpler than keeping logprobs per cached block and
right whatever the cache holds. Its own blocks still enter the cache for later requests. Each
prefill chunk scores its own positions; the LM head runs over CHUNK positions at a time, so the
[positions, V] logits never exceed CHUNK rows.
"""
import torch

from nanovllm.layers.sampler import LogprobsTensors, compute_logprobs
from nanovllm.sequence import Sequence
from nanovllm.utils.context import Context, forward_context

CHUNK = 512


def wants_prompt_logprobs(seqs: list[Sequence]) -> bool:
    return any(seq.num_prompt_logprobs is not None for seq in seqs)


def prompt_logprobs(model: torch.nn.Module, hidden: torch.Tensor, seqs: list[Sequence]
                    ) -> list[tuple[int, int, LogprobsTensors]]:
    """(row, first position, [positions, 1 + k] logprobs) for each sequence of a prefill step
    that asks and has a position to score in this step's chunk. `hidden` [tokens, H] holds the
    step's chunks, sequence after sequence. A chunk scores each of its positions at the next
    prompt token; the prompt's last position is not scored. Every rank calls this (the LM head
    gathers its vocabulary shards); rank 0 alone gets results."""
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

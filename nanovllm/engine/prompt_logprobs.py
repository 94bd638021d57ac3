"""Prompt logprobs: log_softmax of the model's logits at each prompt position but the last, at
the prompt's next token and at the top k (raw logits: no sampling parameter applies).

They need the hidden state of every prompt position, so a sequence that asks for them is
prefilled whole: the block manager gives it no prefix-cache hits (as vLLM does), which is
simpler than keeping logprobs per cached block and right whatever the cache holds. Its own
blocks still enter the cache for later requests. The LM head runs over chunks of positions,
so the [positions, V] logits never exceed CHUNK rows.
"""
import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import LogprobsTensors, compute_logprobs
from nanovllm.utils.context import Context, forward_context

CHUNK = 512


def wants_prompt_logprobs(seqs: list[Sequence]) -> bool:
    return any(seq.num_prompt_logprobs is not None for seq in seqs)


def prompt_logprobs(model: torch.nn.Module, hidden: torch.Tensor, seqs: list[Sequence]
                    ) -> list[tuple[int, LogprobsTensors]]:
    """(row, [prompt_len - 1, 1 + k] logprobs) for each sequence of a prefill that asks.

    `hidden` [tokens, H] holds the step's new tokens, sequence after sequence. Every rank
    calls this (the LM head gathers its vocabulary shards); rank 0 alone gets results.
    """
    results, start = [], 0
    for row, seq in enumerate(seqs):
        num_new = len(seq) - seq.num_cached_tokens
        if seq.num_prompt_logprobs is not None:
            assert seq.num_cached_tokens == 0, "prompt logprobs need the whole prompt computed"
            logprobs = _one(model, hidden[start:start + num_new - 1], seq)
            if logprobs is not None:
                results.append((row, logprobs))
        start += num_new
    return results


def _one(model: torch.nn.Module, hidden: torch.Tensor, seq: Sequence) -> LogprobsTensors | None:
    """Position p's logits scored at token p + 1, CHUNK positions at a time."""
    targets = torch.tensor(seq.token_ids[1:len(seq)], dtype=torch.int64)
    ids, values = [], []
    for begin in range(0, hidden.size(0), CHUNK):
        with forward_context(Context()):  # not prefill: the head keeps every row
            logits = model.compute_logits(hidden[begin:begin + CHUNK])
        if logits is None:  # ranks > 0
            continue
        chunk = targets[begin:begin + CHUNK].to(logits.device, non_blocking=True)
        part = compute_logprobs(logits, chunk, seq.num_prompt_logprobs)
        ids.append(part.token_ids)
        values.append(part.logprobs)
    if not ids:
        return None
    return LogprobsTensors(torch.cat(ids), torch.cat(values))

"""The sampler's per-step inputs, built on the host from the rows' sampling params."""
from functools import partial

import torch

from nanovllm.layers.sampling.penalties import Penalties, TokenCounts
from nanovllm.layers.sampling.sampler import SamplingTensors
from nanovllm.layers.sampling.steering import Steering
from nanovllm.layers.sampling.token_bitmask import fill_token_bitmask
from nanovllm.runner.step_inputs import to_device
from nanovllm.sequence import Sequence


def prepare_sample(seqs: list[Sequence], lengths: list[int], token_counts: TokenCounts,
                   vocab_size: int, device: torch.device,
                   temperatures: dict[tuple, torch.Tensor] | None = None,
                   generator: torch.Generator | None = None) -> tuple[
        torch.Tensor | SamplingTensors, Penalties | None, int | None, torch.Tensor | None]:
    """(temperatures or SamplingTensors, penalties, number of top logprobs, token bitmask of
    structured outputs) for the sampler; `lengths`: len(seq) at the step's launch;
    `temperatures`: the caller's cache of uploaded temperature rows, which the sampler only
    reads (a batch that decodes on keeps its rows: no copy per step); `generator`: the
    sampler's, for the seeds of unseeded rows."""
    params = [seq.sampling_params for seq in seqs]
    upload = partial(to_device, device=device)
    if all(p.simple for p in params):  # no row steers either: nothing more is built
        key = tuple(p.temperature for p in params)
        sample_params = None if temperatures is None else temperatures.get(key)
        if sample_params is None:
            sample_params = upload(list(key), torch.float32)
            if temperatures is not None:
                if len(temperatures) >= 64:  # batches change as requests come and go
                    temperatures.clear()
                temperatures[key] = sample_params
    else:
        # seeded noise is keyed by the index the new token will have in its sequence
        sample_params = SamplingTensors.build(params, lengths, upload,
                                              Steering.build(seqs, upload, lengths), generator)
    penalties = None
    if any(p.uses_penalties for p in params):
        # a sequence finished by the commit before a deferred sample has released its row:
        # its dropped token takes the zero row, not a new one that nothing would release
        rows = [token_counts.slot(seq.seq_id, seq.token_ids[:seq.num_prompt_tokens],
                                  seq.completion_token_ids)
                if p.uses_penalties and not seq.is_finished else 0
                for seq, p in zip(seqs, params)]
        penalties = Penalties.build(token_counts, rows, params, upload)
    ks = [p.logprobs for p in params if p.logprobs is not None]
    # grammars are at their sequences' committed tokens: the engine defers the sampling of
    # their steps until the previous step is committed (one that just terminated its grammar
    # has finished: its new token is dropped)
    bitmask = fill_token_bitmask([seq.grammar if seq.grammar is not None
                                  and not seq.grammar.is_terminated() else None
                                  for seq in seqs], vocab_size, device)
    return sample_params, penalties, max(ks) if ks else None, bitmask

"""What a request returns: its completions' text, tokens and logprobs (n sequences for n)."""
from copy import copy

from nanovllm.layers.sampling.sampler import LogprobsTensors, derive_seed
from nanovllm.runner.sampled_ids import SampledIds
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence


class RequestTable:
    """Queued requests: request id -> its completions, until every one of them finished."""

    def __init__(self):
        self.groups: dict[int, list[Sequence]] = {}

    def add(self, token_ids: list[int], params: SamplingParams, block_size: int,
            lora_int_id: int = 0) -> list[Sequence]:
        """A request's completions; its id is the first completion's sequence id."""
        seqs = [Sequence(token_ids, p, block_size, lora_int_id)
                for p in completion_params(params)]
        for seq in seqs:
            seq.request_id = seqs[0].seq_id
        self.groups[seqs[0].seq_id] = seqs
        return seqs

    def finished(self, seqs: list[Sequence]) -> list[list[Sequence]]:
        """The requests whose last unfinished completion is among `seqs`, now dequeued."""
        done = []
        for seq in seqs:
            group = self.groups.get(seq.request_id)
            if group is not None and all(s.is_finished for s in group):
                done.append(self.groups.pop(seq.request_id))
        return done

    def drop(self, request_id: int) -> None:
        self.groups.pop(request_id, None)


def completion_params(params: SamplingParams) -> list[SamplingParams]:
    """One SamplingParams per completion: completion i draws from (seed, i) when seeded."""
    # Only the first computes the prompt logprobs: the others share its cached blocks.
    # Copies, not replace(): a copy keeps what request validation resolved (bad words' ids).
    if params.n == 1:
        return [params]
    completions = []
    for i in range(params.n):
        p = copy(params)
        p.n, p.prompt_logprobs = 1, params.prompt_logprobs if i == 0 else None
        p.seed = None if params.seed is None else derive_seed(params.seed, i)
        completions.append(p)
    return completions


def record_logprobs(seqs: list[Sequence], rows: list[tuple[int, Sequence]],
                    sampled: SampledIds) -> None:
    """Attach a committed step's logprobs to `rows` and its prompt logprobs to `seqs`."""
    logprobs = sampled.logprobs()
    if logprobs is not None:
        ks = [0] * len(logprobs.token_ids)
        for row, seq in rows:
            ks[row] = seq.sampling_params.logprobs or 0
        dicts = logprobs.to_dicts(ks)
        for row, seq in rows:
            if seq.logprobs is not None:
                seq.logprobs.append(dicts[row])
    if sampled.is_prefill:
        prompt = sampled.prompt_logprobs()
        for row, seq in enumerate(seqs):
            if seq.num_prompt_logprobs is not None:
                _record_prompt_chunk(seq, prompt.get(row))


def _record_prompt_chunk(seq: Sequence, chunk: tuple[int, LogprobsTensors] | None) -> None:
    """Extend a sequence's prompt logprobs by one chunk's; a chunk at position 0 restarts."""
    if chunk is not None:
        first, found = chunk
        if first == 0 or seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]
        seq.prompt_logprobs += found.to_dicts([seq.num_prompt_logprobs] * len(found.token_ids))
    elif seq.prompt_logprobs is None:
        seq.prompt_logprobs = [None]  # a one-token prompt has no position to score
    if seq.num_cached_tokens >= seq.num_prompt_tokens:  # the prompt is done
        seq.num_prompt_logprobs = None


def request_output(seqs: list[Sequence], decode) -> dict:
    """One request's output dict: the first completion's fields on top, all under "outputs"."""
    completions = [{"text": completion_text(seq, decode),
                    "token_ids": seq.completion_token_ids, "finish_reason": seq.finish_reason,
                    "logprobs": seq.logprobs} for seq in seqs]
    first = seqs[0]
    metrics = {"ttft_s": first.first_token_time - first.arrival_time,
               "latency_s": first.finish_time - first.arrival_time}
    return {"request_id": first.request_id, **completions[0],
            "prompt_logprobs": first.prompt_logprobs, "outputs": completions, "metrics": metrics}


def completion_text(seq: Sequence, decode) -> str:
    """The text: cut before a stop string, else without the stop token (EOS or one of
    stop_token_ids) that ended it, as vLLM; token_ids keep that token."""
    if seq.text is not None:
        return seq.text
    if not seq.sampling_params.detokenize:
        return ""
    token_ids = seq.completion_token_ids
    if seq.finish_reason == "stop":  # stopped by a token: a stop string sets seq.text
        token_ids = token_ids[:-1]
    return decode(token_ids, skip_special_tokens=seq.sampling_params.skip_special_tokens)

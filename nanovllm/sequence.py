"""Per-request state: tokens, how many are cached, the block table, the status."""
from copy import copy
from enum import Enum, auto
from itertools import count
from time import perf_counter

from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    """Where a sequence is in its life."""

    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request: prompt plus generated tokens, and where its KV lives."""

    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, block_size: int,
                 lora_int_id: int = 0):
        self.seq_id = next(Sequence._ids)
        self.lora_int_id = lora_int_id  # its LoRA adapter's id; 0: the base model
        self.request_id = self.seq_id  # of its request's first completion (SamplingParams.n)
        self.status = SequenceStatus.WAITING
        self.token_ids = copy(token_ids)
        self.token_offset = 0  # index of token_ids[0] in the sequence (> 0 on worker copies)
        self.last_token = token_ids[-1]
        self.num_tokens = len(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_cached_tokens = 0  # tokens whose K/V are already in the paged cache
        self.num_scheduled_tokens = 1  # tokens the next step computes: a prompt chunk, or 1
        self.block_table: list[int] = []
        self.block_size = block_size
        self.sampling_params = sampling_params
        self.finish_reason: str | None = None
        self.text: str | None = None  # completion text cut before a stop string, when one hit
        # a structured output's xgrammar GrammarMatcher, at the committed completion tokens
        # (set by the engine: engine.structured_outputs); None when unconstrained
        self.grammar: object | None = None
        # {token_id: logprob} per generated token, when asked
        self.logprobs: list[dict[int, float]] | None = (
            None if sampling_params.logprobs is None else [])
        self.prompt_logprobs: list[dict[int, float] | None] | None = None  # first entry None
        # k while the prompt logprobs are still to compute: every prompt position is then
        # computed (none read from the prefix cache); None once they are known or not asked
        self.num_prompt_logprobs = sampling_params.prompt_logprobs
        self.arrival_time = perf_counter()
        self.first_token_time = self.finish_time = 0.0  # set by the scheduler

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def chunk_token_ids(self) -> list[int]:
        """The tokens the next step feeds the model: num_scheduled_tokens after the cached."""
        start = self.num_cached_tokens - self.token_offset
        return self.token_ids[start:start + self.num_scheduled_tokens]

    @property
    def samples_next(self) -> bool:
        """Whether the next step's chunk reaches the end, so its last row samples a token."""
        return self.num_cached_tokens + self.num_scheduled_tokens == self.num_tokens

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    def block(self, i: int) -> list[int]:
        """Token ids of logical block i."""
        assert 0 <= i < self.num_blocks, f"block {i} out of range {self.num_blocks}"
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens counted in len(self) whose ids a launched step is still sampling (0 or 1)."""
        return self.num_tokens - self.token_offset - len(self.token_ids)

    def append_pending_token(self) -> None:
        """Count the token a launched step is sampling, before its id is known."""
        self.num_cached_tokens = self.num_tokens
        self.num_tokens += 1

    def commit_pending_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token = token_id

    def drop_pending_token(self) -> bool:
        """Undo an aborted step's append_pending_token, even a half-run one; True if any."""
        had = self.num_pending_tokens > 0
        self.num_tokens = self.token_offset + len(self.token_ids)
        return had

    def __getstate__(self) -> tuple:
        # What a tensor-parallel worker needs to build its step inputs, and no more: the
        # step's tokens (a prompt chunk in prefill, one token in decode), the lengths, the
        # block table, the k of prompt logprobs still due (every rank joins their LM head) and
        # the adapter. Sampling happens on rank 0 only.
        return (self.seq_id, self.num_tokens, self.num_cached_tokens, self.num_scheduled_tokens,
                self.block_size, self.block_table, self.chunk_token_ids, self.num_prompt_logprobs,
                self.lora_int_id)

    def __setstate__(self, state: tuple) -> None:
        (self.seq_id, self.num_tokens, self.num_cached_tokens, self.num_scheduled_tokens,
         self.block_size, self.block_table, self.token_ids, self.num_prompt_logprobs,
         self.lora_int_id) = state
        self.token_offset = self.num_cached_tokens
        self.last_token = self.token_ids[-1]

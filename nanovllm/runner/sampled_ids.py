"""A launched step's results as rank 0 sees them: sampled ids, and logprobs when asked."""
import threading
import time
from dataclasses import dataclass, field

import torch

from nanovllm.layers.sampling.sampler import LogprobsTensors
from nanovllm.sequence import Sequence


class SampledIds:
    """A step's sampled ids (and logprobs, when asked): on the device for the next step's
    inputs, and copied to pinned host memory as soon as the sampler is done."""
    # A plain .tolist() would wait behind the next step, which the pipelined engine has queued.

    def __init__(self, ids: torch.Tensor, logprobs: LogprobsTensors | None = None,
                 prompt_logprobs: list[tuple[int, int, LogprobsTensors]] = (),
                 is_prefill: bool = False):
        self.device, self.is_prefill = ids, is_prefill
        self.has_logprobs = logprobs is not None
        self.prompt_rows = [(row, first) for row, first, _ in prompt_logprobs]
        tensors = [ids]
        for lp in [logprobs] * self.has_logprobs + [lp for *_, lp in prompt_logprobs]:
            tensors += [lp.token_ids, lp.logprobs]
        self.host, self.ready = tensors, None
        if ids.is_cuda:
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, t in zip(self.host, tensors):
                host.copy_(t, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()

    def wait(self, give_up: threading.Event | None = None) -> None:
        """Wait for this step only; with `give_up`, poll and raise once it is set (dead peer)."""
        if self.ready is None:
            return
        if give_up is None:
            self.ready.synchronize()
            return
        while not self.ready.query():
            if give_up.is_set():
                raise RuntimeError("step abandoned: a tensor-parallel peer died during it")
            time.sleep(0)  # lets the watchdog thread run

    def tolist(self) -> list[int]:
        self.wait()
        return self.host[0].tolist()

    def logprobs(self) -> LogprobsTensors | None:
        """The sampled tokens' logprobs (host tensors); call after tolist()."""
        return LogprobsTensors(*self.host[1:3]) if self.has_logprobs else None

    def prompt_logprobs(self) -> dict[int, tuple[int, LogprobsTensors]]:
        """Row -> (first position, its chunk's prompt logprobs); call after tolist()."""
        at = 3 if self.has_logprobs else 1
        return {row: (first, LogprobsTensors(*self.host[at + 2 * i:at + 2 * i + 2]))
                for i, (row, first) in enumerate(self.prompt_rows)}


@dataclass
class StepLogits:
    """A launched step's logits, not sampled yet (ModelRunner.launch with defer_sample)."""

    seqs: list[Sequence]  # the rows that sample
    logits: torch.Tensor
    prompt_logprobs: list[tuple[int, int, LogprobsTensors]]
    is_prefill: bool
    # len(seq) at the launch: the index the new token takes (its seeded noise, min_tokens), on
    # which a deferred sample must agree with one at the launch
    lengths: list[int]


@dataclass
class InFlightStep:
    """A launched step whose sampled ids the host has not read yet."""

    seqs: list[Sequence]
    sampled: SampledIds  # StepLogits between a deferred-sample launch and its sample
    # per sequence of a prefill step: whether its row samples (its chunk ends the prompt);
    # None for a decode step, where every row samples
    samples: list[bool] | None = None
    # (row, seq) of each sequence given a pending token for this step's sample (by advance)
    advanced: list[tuple[int, Sequence]] = field(default_factory=list)

    def source_rows(self, seqs: list[Sequence]) -> list[int]:
        """Per sequence of `seqs`: the row of this step's ids holding its pending token, or -1."""
        rows = {seq.seq_id: row for row, seq in self.advanced}
        return [rows.get(seq.seq_id, -1) for seq in seqs]

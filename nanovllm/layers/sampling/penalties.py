"""Per-sequence token counts on the device, for the repetition/presence/frequency penalties.

Each sequence that asks for a penalty holds a slot, one row of two [S, V] tensors:

    output_counts[slot, v]  int32  times token v was generated
    prompt_mask[slot, v]    bool   token v is in the prompt

Row 0 is all zero and never written: rows that ask for no penalty point there, so one batched
pass serves a mixed batch. Counts are updated on the device from the sampled ids (the host never
reads them). Slots live until `release`, so preempted sequences keep their counts.
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanovllm.sampling_params import SamplingParams


class TokenCounts:
    """Slots of generated-token counts and prompt-token masks, grown by doubling."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self.clear()

    def clear(self) -> None:
        """Forget every slot and shrink back to the zero row."""
        self.output_counts = torch.zeros(1, self.vocab_size, dtype=torch.int32,
                                         device=self.device)
        self.prompt_mask = torch.zeros(1, self.vocab_size, dtype=torch.bool, device=self.device)
        self.slots: dict[int, int] = {}  # sequence id -> row
        self.free: list[int] = []

    def slot(self, seq_id: int, prompt_token_ids: list[int],
             generated_token_ids: list[int] = ()) -> int:
        """The sequence's row; a new one is filled from its prompt and generated tokens."""
        row = self.slots.get(seq_id)
        if row is not None:
            return row
        if not self.free:
            self._grow()
        row = self.slots[seq_id] = self.free.pop()
        self.output_counts[row].zero_()
        self.prompt_mask[row].zero_()
        prompt = torch.tensor(prompt_token_ids, dtype=torch.int64)
        self.prompt_mask[row, prompt.to(self.device, non_blocking=True)] = True
        if generated_token_ids:
            generated = torch.tensor(generated_token_ids, dtype=torch.int64).to(self.device)
            self.output_counts[row].index_add_(0, generated, torch.ones_like(
                generated, dtype=torch.int32))
        return row

    def release(self, seq_id: int) -> None:
        """Free the sequence's row, if it has one."""
        row = self.slots.pop(seq_id, None)
        if row is not None:
            self.free.append(row)

    def record(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count each row's sampled token; row 0 stays zero (rows sharing it add 0 to 0)."""
        self.output_counts[rows, token_ids] += (rows != 0).to(torch.int32)

    def _grow(self) -> None:
        old = self.output_counts.size(0)
        new = max(2 * old, 8)
        counts = self.output_counts.new_zeros(new, self.output_counts.size(1))
        mask = self.prompt_mask.new_zeros(new, self.prompt_mask.size(1))
        counts[:old], mask[:old] = self.output_counts, self.prompt_mask
        self.output_counts, self.prompt_mask = counts, mask
        self.free.extend(reversed(range(old, new)))  # pop() hands out the lowest first


@dataclass
class Penalties:
    """A batch's penalties: per-row slots and values [B], and the counts they index."""

    rows: torch.Tensor  # int64: slot of each row; 0 = no penalty
    repetition: torch.Tensor  # float32; 1 = off
    presence: torch.Tensor  # float32; 0 = off
    frequency: torch.Tensor  # float32; 0 = off
    counts: TokenCounts

    @staticmethod
    def build(counts: TokenCounts, rows: list[int], params: list[SamplingParams],
              to_device: Callable[[list, torch.dtype], torch.Tensor]) -> "Penalties":
        """Pack the rows; `to_device(rows, dtype)` copies (one float and one int64 copy)."""
        floats = to_device([[p.repetition_penalty for p in params],
                            [p.presence_penalty for p in params],
                            [p.frequency_penalty for p in params]], torch.float32)
        return Penalties(to_device(rows, torch.int64), *floats, counts=counts)

"""Build a step's input tensors (token ids, positions, slots, block tables) from sequences."""
from itertools import chain

import numpy as np
import torch

from nanovllm.sequence import Sequence
from nanovllm.utils.context import Context


def to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host list -> device tensor, through pinned memory on CUDA so the copy is async."""
    pin = device.type == "cuda"
    return torch.tensor(data, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)


def block_table_rows(seqs: list[Sequence]) -> list[list[int]]:
    """Block tables padded with -1 to the longest."""
    width = max(len(seq.block_table) for seq in seqs)
    return [seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs]


def chunk_slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions [start, end): position p goes to slot
    block_table[p // block_size] * block_size + p % block_size.

        positions  |  block 0  |  block 1  |  block 2  |
        chunk            [start ........ end)          start, end need not be block edges
    """
    slots = []
    for i in range(start // block_size, -(-end // block_size)):
        first = i * block_size
        base = block_table[i] * block_size - first
        slots.extend(range(base + max(start, first), base + min(end, first + block_size)))
    return slots


def prepare_prefill(seqs: list[Sequence], block_size: int, device: torch.device,
                    lora_slots: list[int] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, Context]:
    """Inputs for each sequence's chunk: num_scheduled_tokens tokens after its cached ones;
    lora_slots: each sequence's adapter slot (-1: none), when any has one."""
    # Only rows whose chunk ends the sequence get logits (logits_indices).
    input_ids, positions, slot_mapping, logits_indices = [], [], [], []
    cu_seqlens_q, cu_seqlens_k = [0], [0]
    max_seqlen_q = max_seqlen_k = 0
    for seq in seqs:
        start, num_new = seq.num_cached_tokens, seq.num_scheduled_tokens
        end = start + num_new
        input_ids.extend(seq.chunk_token_ids)  # workers receive only these
        positions.extend(range(start, end))
        cu_seqlens_q.append(cu_seqlens_q[-1] + num_new)
        cu_seqlens_k.append(cu_seqlens_k[-1] + end)
        max_seqlen_q = max(max_seqlen_q, num_new)
        max_seqlen_k = max(max_seqlen_k, end)
        if seq.samples_next:
            logits_indices.append(cu_seqlens_q[-1] - 1)
        if seq.block_table:  # empty in warm-up, which runs before the KV pool exists
            slot_mapping.extend(chunk_slots(seq.block_table, start, end, block_size))
    prefix_cached = cu_seqlens_k[-1] > cu_seqlens_q[-1]
    context = Context(
        is_prefill=True,
        cu_seqlens_q=to_device(cu_seqlens_q, torch.int32, device),
        cu_seqlens_k=to_device(cu_seqlens_k, torch.int32, device),
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        slot_mapping=to_device(slot_mapping, torch.int32, device) if slot_mapping else None,
        # also without a cached prefix: an FP8 cache's prefill reads its own K/V back
        block_tables=(to_device(block_table_rows(seqs), torch.int32, device)
                      if slot_mapping else None),
        prefix_cached=prefix_cached,
        logits_indices=(to_device(logits_indices, torch.int64, device) if logits_indices
                        else None),
        lora_slots=_prefill_lora(seqs, lora_slots, device))
    return (to_device(input_ids, torch.int64, device), to_device(positions, torch.int64, device),
            context)


def _prefill_lora(seqs: list[Sequence], lora_slots: list[int] | None,
                  device: torch.device) -> torch.Tensor | None:
    """Each chunk token's adapter slot (its sequence's); None when no sequence has one."""
    if lora_slots is None or max(lora_slots) < 0:
        return None
    token_slots = np.repeat(np.array(lora_slots, np.int32),
                            [seq.num_scheduled_tokens for seq in seqs])
    packed = torch.from_numpy(token_slots)
    packed = packed.pin_memory() if device.type == "cuda" else packed
    return packed.to(device, non_blocking=True)


SMALL_BATCH = 4  # up to this many rows, pack() writes block tables row by row


class DecodeInputs:
    """Packs a decode step's int32 inputs into one buffer, so they travel in one copy.

    Layout for `rows` sequences (the batch padded up to a CUDA-graph size) and `width` blocks:
        [input_ids | positions | slot_mapping | context_lens | source_rows | lora | block_tables]
    block_tables is rows x width; lora (with LoRA enabled only) is each row's adapter slot.
    source_rows[i]: the row of the previous step's sampled ids holding sequence i's input id,
    or -1 (input_ids[i] holds it); that carry writes input_ids only, so kernels may read the
    other sections before their PDL wait (kernels.pdl). Padding rows have slot -1 and context
    length 0. The first five sections take a multiple of 4 entries each, so every section is
    16-byte aligned: Triton specialises kernels on pointer alignment."""

    def __init__(self, max_rows: int, max_width: int, block_size: int, pin: bool,
                 max_loras: int = 0):
        self.max_loras = max_loras
        size = self.size(max_rows, max_width, max_loras)
        # Two staging buffers, alternated: the pipelined engine packs step n+1 while step n may
        # still be queued, but it has waited for step n-1, whose copy read the other buffer.
        self.staging = [torch.empty(size, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.turn = 0
        self.block_size = block_size
        # (turn, rows, width) -> _split's views: splitting costs more than filling a small batch
        self._sections: dict[tuple[int, int, int], tuple] = {}

    @staticmethod
    def size(rows: int, width: int, max_loras: int = 0) -> int:
        """Entries of a packed buffer for `rows` sequences and `width` blocks each."""
        return 5 * _aligned(rows) + _lora_size(rows, max_loras) + rows * width

    def pack(self, seqs: list[Sequence], rows: int, width: int,
             source_rows: list[int] | None = None,
             lora_slots: list[int] | None = None) -> torch.Tensor:
        """Fill a pinned host buffer for `seqs`; returns it (size(rows, width) int32)."""
        n = len(seqs)
        self.turn ^= 1
        key = (self.turn, rows, width)
        if key not in self._sections:
            if len(self._sections) >= 64:  # eager steps' shapes vary: keep the cache small
                self._sections.clear()
            self._sections[key] = self._split(*key)
        buf, (ids, pos, slots, ctx, src, lora, tables) = self._sections[key]
        if self.max_loras:
            lora[:n] = -1 if lora_slots is None else lora_slots
            lora[n:] = -1
        # One pass over the sequences (this runs every decode step): per row its last token,
        # length, last block and block count.
        per_seq = np.fromiter(chain.from_iterable(
            (seq.last_token, seq.num_tokens, seq.block_table[-1], len(seq.block_table))
            for seq in seqs), np.int32, 4 * n).reshape(n, 4)
        ids[:n], ctx[:n] = per_seq[:, 0], per_seq[:, 1]
        np.subtract(per_seq[:, 1], 1, out=pos[:n])
        slots[:n] = per_seq[:, 2] * self.block_size + pos[:n] % self.block_size
        src[:n] = -1 if source_rows is None else source_rows
        if n < rows:
            ids[n:], pos[n:], slots[n:], ctx[n:], src[n:] = 0, 0, -1, 0, -1
        tables.fill(-1)
        if n <= SMALL_BATCH:  # row by row: cheaper than the mask below for a few rows
            for row, seq in zip(tables, seqs):
                row[:len(seq.block_table)] = seq.block_table
        else:
            lens = per_seq[:, 3]
            flat = np.fromiter(chain.from_iterable(seq.block_table for seq in seqs), np.int32,
                               int(lens.sum()))
            tables[:n][np.arange(width) < lens[:, None]] = flat  # row-major, like `flat`
        return buf

    def _split(self, turn: int, rows: int, width: int):
        """(staging buffer `turn`'s first size(rows, width) entries, numpy views of its
        sections: ids, positions, slots, context lens, source rows, lora, tables [rows,
        width])."""
        seg = _aligned(rows)
        buf = self.staging[turn][:self.size(rows, width, self.max_loras)]
        *heads, rest = np.split(buf.numpy(), [seg * i for i in range(1, 6)])
        lora, tables = np.split(rest, [_lora_size(rows, self.max_loras)])
        return buf, (*heads, lora, tables.reshape(rows, width))

    @staticmethod
    def unpack(buf: torch.Tensor, rows: int, width: int, max_loras: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Context]:
        """Views of a packed buffer: input_ids, positions, source_rows, the decode Context."""
        # plain slices: this runs every decode step, and split() costs several times more
        seg, lora_size = _aligned(rows), _lora_size(rows, max_loras)
        ids, pos, slots, ctx, src = (buf[i:i + rows] for i in range(0, 5 * seg, seg))
        context = Context(is_prefill=False, slot_mapping=slots, context_lens=ctx,
                          block_tables=buf[5 * seg + lora_size:].view(rows, width),
                          lora_slots=buf[5 * seg:5 * seg + rows] if max_loras else None)
        return ids, pos, src, context


def _aligned(rows: int) -> int:
    """rows rounded up to a multiple of 4 int32 entries (16 bytes)."""
    return -(-rows // 4) * 4


def _lora_size(rows: int, max_loras: int) -> int:
    """Entries of the lora section: one slot per row, 16-byte aligned; 0 without LoRA."""
    return _aligned(rows) if max_loras else 0

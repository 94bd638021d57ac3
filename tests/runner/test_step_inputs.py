"""DecodeInputs: what pack() writes, unpack() reads back, every section 16-byte aligned."""
import pytest

from nanovllm.runner.step_inputs import DecodeInputs
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence

BLOCK = 4


def _seq(num_tokens: int, blocks: list[int]) -> Sequence:
    seq = Sequence(list(range(1, num_tokens + 1)), SamplingParams(), BLOCK)
    seq.block_table = blocks
    return seq


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 8])
def test_round_trip_and_alignment(rows: int) -> None:
    seqs = [_seq(4 * i + 2, list(range(10 * i, 10 * i + i + 1))) for i in range(min(rows, 3))]
    width = 5
    inputs = DecodeInputs(8, width, BLOCK, pin=False)
    source_rows = [2, -1, 0][:len(seqs)]
    buf = inputs.pack(seqs, rows, width, source_rows).clone()  # as if copied to the device
    assert buf.numel() == DecodeInputs.size(rows, width)
    ids, pos, src, ctx = DecodeInputs.unpack(buf, rows, width)
    parts = (ids, pos, src, ctx.slot_mapping, ctx.context_lens, ctx.block_tables)
    assert all(part.data_ptr() % 16 == 0 for part in parts)  # one Triton variant for all rows
    n = len(seqs)
    assert ids.tolist() == [seq.last_token for seq in seqs] + [0] * (rows - n)
    assert pos.tolist() == [len(seq) - 1 for seq in seqs] + [0] * (rows - n)
    assert ctx.context_lens.tolist() == [len(seq) for seq in seqs] + [0] * (rows - n)
    slots = [seq.block_table[-1] * BLOCK + (len(seq) - 1) % BLOCK for seq in seqs]
    assert ctx.slot_mapping.tolist() == slots + [-1] * (rows - n)
    tables = [seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs]
    assert ctx.block_tables.tolist() == tables + [[-1] * width] * (rows - n)
    assert ctx.block_tables.shape == (rows, width)
    assert src.tolist() == source_rows + [-1] * (rows - n)
    _, _, src, _ = DecodeInputs.unpack(inputs.pack(seqs, rows, width), rows, width)
    assert src.tolist() == [-1] * rows  # no step in flight: every input id is on the host

"""DecodeInputs: what pack() writes, unpack() reads back, every section 16-byte aligned."""
import pytest
import torch

from nanovllm.runner.step_inputs import DecodeInputs
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence

BLOCK = 4


def _seq(num_tokens: int, blocks: list[int]) -> Sequence:
    seq = Sequence(list(range(1, num_tokens + 1)), SamplingParams(), BLOCK)
    seq.block_table = blocks
    return seq


@pytest.mark.parametrize("rows,num_seqs", [(1, 1), (2, 1), (3, 3), (5, 3), (6, 3), (8, 3),
                                           (8, 7), (6, 6)])
def test_round_trip_and_alignment(rows: int, num_seqs: int) -> None:
    """Up to SMALL_BATCH sequences take pack()'s row-by-row tables, more the masked ones."""
    seqs = [_seq(4 * i + 2, list(range(10 * i, 10 * i + i % 5 + 1))) for i in range(num_seqs)]
    width = 5
    inputs = DecodeInputs(8, width, BLOCK, pin=False)
    source_rows = [2, -1, 0, 5, 4, -1, 1][:len(seqs)]
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


def test_reused_buffers_hold_only_the_latest_step() -> None:
    """Each staging buffer's section views are kept between steps: a smaller step written
    after a larger one of the same shape leaves nothing of it behind; eager shapes (any
    width) do not grow the kept views without bound."""
    rows, width = 4, 6
    inputs = DecodeInputs(8, 16, BLOCK, pin=False)
    big = [_seq(20, [1, 2, 3, 4, 5, 6]), _seq(9, [7, 8, 9]), _seq(5, [10, 11])]
    small = [_seq(3, [12])]
    for seqs in (big, big, small, small):  # both buffers, then both again
        buf = inputs.pack(seqs, rows, width, [0] * len(seqs)).clone()
    ids, pos, src, ctx = DecodeInputs.unpack(buf, rows, width)
    assert ctx.block_tables.tolist() == [[12] + [-1] * 5] + [[-1] * width] * 3
    assert ids.tolist() == [3, 0, 0, 0] and src.tolist() == [0, -1, -1, -1]
    assert ctx.slot_mapping.tolist() == [12 * BLOCK + 2, -1, -1, -1]
    for w in range(1, 17):
        for r in range(1, 9):
            inputs.pack(small, r, w)
    assert len(inputs._sections) <= 64


def _view_tensors(views: tuple) -> list:
    """input ids, positions, source rows and the context's tensors of unpack()'s views."""
    context = views[3]
    return [*views[:3], context.slot_mapping, context.context_lens, context.block_tables,
            context.lora_slots]


@pytest.mark.parametrize("max_loras", [0, 4])
def test_graph_inputs_are_the_views_a_step_unpacks(max_loras: int) -> None:
    """A graph step reuses the views its graph was captured with: they must be exactly what
    unpacking its buffer gives (same memory, shapes), the capture's slots and adapters -1."""
    from nanovllm.runner.cuda_graphs import _decode_inputs
    rows, width = 6, 5
    buf, captured = _decode_inputs(rows, width, max_loras, torch.device("cpu"))
    unpacked = DecodeInputs.unpack(buf, rows, width, max_loras)
    for a, b in zip(_view_tensors(captured), _view_tensors(unpacked), strict=True):
        if a is None or b is None:  # lora_slots without LoRA
            assert a is None and b is None and max_loras == 0
        else:
            assert a.data_ptr() == b.data_ptr() and a.shape == b.shape
    assert captured[3].slot_mapping.tolist() == [-1] * rows
    if max_loras:
        assert captured[3].lora_slots.tolist() == [-1] * rows

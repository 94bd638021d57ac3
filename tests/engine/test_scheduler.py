"""Scheduler on tiny pools: prefill-first batching, budgets, preemption order, finishing."""
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

BS = 4
EOS = 0


def make(num_blocks=8, max_num_seqs=4, max_tokens_budget=32, max_model_len=64) -> Scheduler:
    return Scheduler(max_num_seqs, max_tokens_budget, max_model_len, EOS, num_blocks, BS)


def seq(n: int, max_tokens: int = 16, ignore_eos: bool = True, start: int = 1) -> Sequence:
    return Sequence(list(range(start, start + n)),
                    SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos), BS)


def postprocess(s: Scheduler, batch: list[Sequence], token_ids: list[int]) -> list[Sequence]:
    """What the engine does with a step's sampled ids: advance, then commit."""
    return s.commit(s.advance(batch), token_ids)


def test_prefill_first_then_decode():
    s = make()
    a, b = seq(5), seq(3, start=100)
    s.add(a)
    s.add(b)
    batch, is_prefill = s.schedule()
    assert is_prefill and batch == [a, b]
    postprocess(s, batch, [7, 8])
    batch, is_prefill = s.schedule()
    assert not is_prefill and batch == [a, b]
    assert a.block_table == [0, 1] and b.block_table == [2]  # b's 4th token fills block 2


def test_token_budget_and_max_num_seqs():
    s = make(max_num_seqs=2, max_tokens_budget=10)
    seqs = [seq(4, start=10 * i + 1) for i in range(4)]
    for x in seqs:
        s.add(x)
    batch, _ = s.schedule()
    assert batch == seqs[:2]  # max_num_seqs
    s2 = make(max_num_seqs=4, max_tokens_budget=10)
    for x in [seq(4, start=1), seq(4, start=20), seq(4, start=40)]:
        s2.add(x)
    batch, _ = s2.schedule()
    assert len(batch) == 2  # 4 + 4 <= 10 < 12


def test_preemption_takes_the_tail_of_running():
    s = make(num_blocks=3, max_num_seqs=3)
    a, b, c = seq(4, start=1), seq(4, start=20), seq(4, start=40)
    for x in (a, b, c):
        s.add(x)
    batch, _ = s.schedule()
    assert batch == [a, b, c]
    postprocess(s, batch, [9, 9, 9])  # every sequence now needs a 2nd block; none is free
    batch, is_prefill = s.schedule()
    assert not is_prefill
    assert c.status == SequenceStatus.WAITING and b.status == SequenceStatus.WAITING
    assert batch == [a] and list(s.waiting) == [b, c]
    assert s.num_preemptions == 2
    assert c.block_table == [] and c.num_cached_tokens == 0
    assert a.block_table == [0, 2]


def test_finish_on_eos_length_and_max_model_len():
    s = make(max_model_len=7)
    a = seq(3, max_tokens=2, ignore_eos=False)
    b = seq(3, max_tokens=10, ignore_eos=False, start=50)
    c = seq(5, max_tokens=10, ignore_eos=True, start=80)
    for x in (a, b, c):
        s.add(x)
    batch, _ = s.schedule()
    finished = postprocess(s, batch, [5, EOS, EOS])
    assert finished == [b] and b.finish_reason == "stop"
    batch, _ = s.schedule()
    finished = postprocess(s, batch, [6, 6])
    assert a.finish_reason == "length" and c.finish_reason == "length"  # max_tokens, len 7
    assert set(finished) == {a, c} and s.is_finished()
    assert s.block_manager.num_free_blocks == 8

"""Scheduler on tiny pools: prefill-first batching, budgets, preemption order, finishing."""
import random

from nanovllm.engine.scheduler import Scheduler
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence, SequenceStatus

BS = 4
EOS = 0


def make(num_blocks=8, max_num_seqs=4, max_tokens_budget=32, max_model_len=64) -> Scheduler:
    return Scheduler(max_num_seqs, max_tokens_budget, max_model_len, (EOS,), num_blocks, BS)


def seq(n: int, max_tokens: int = 16, ignore_eos: bool = True, start: int = 1) -> Sequence:
    return Sequence(list(range(start, start + n)),
                    SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos), BS)


def postprocess(s: Scheduler, batch: list[Sequence], token_ids: list[int],
                is_prefill: bool = False) -> list[Sequence]:
    """What the engine does with a step's sampled ids: advance, then commit."""
    samples = [x.samples_next for x in batch] if is_prefill else None
    return s.commit(s.advance(batch, samples), token_ids)


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


def test_longest_first_orders_decode_batches_not_running():
    s = Scheduler(4, 32, 64, (EOS,), 8, BS, longest_first=True)
    a, b, c = seq(3, start=1), seq(6, start=20), seq(4, start=40)
    for x in (a, b, c):
        s.add(x)
    batch, is_prefill = s.schedule()
    assert is_prefill and batch == [a, b, c]  # prefill keeps arrival order
    postprocess(s, batch, [7, 8, 9], is_prefill=True)
    batch, is_prefill = s.schedule()
    assert not is_prefill and batch == [b, c, a]  # 7, 5 and 4 tokens
    assert list(s.running) == [a, b, c]  # preemption still takes the latest arrival


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
    assert len(batch) == 3 and [x.num_scheduled_tokens for x in batch] == [4, 4, 2]
    assert not batch[2].samples_next and s2.waiting[0] is batch[2]  # chunked: 2 tokens left


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


def test_a_shared_first_block_waits_one_step_to_hit_the_cache():
    """Requests whose first block another request computes in this step wait for the next,
    where that block (hashed once its step is launched) is a cache hit."""
    s = make(num_blocks=8)
    a, b, c = seq(6), seq(7), seq(6, start=50)  # a and b share block [1, 2, 3, 4]
    for x in (a, b, c):
        s.add(x)
    batch, _ = s.schedule()
    assert batch == [a]
    postprocess(s, batch, [9], is_prefill=True)
    batch, is_prefill = s.schedule()
    assert is_prefill and batch == [b, c]
    assert b.block_table[0] == a.block_table[0] and b.num_cached_tokens == BS


def test_a_chunk_ending_inside_a_prompt_is_followed_by_decode():
    s = make(max_tokens_budget=5)
    a, b = seq(3), seq(9, start=20)
    s.add(a)
    s.add(b)
    batch, _ = s.schedule()  # a whole (3 tokens), then 2 of b's 9
    assert batch == [a, b] and [x.num_scheduled_tokens for x in batch] == [3, 2]
    postprocess(s, batch, [7], is_prefill=True)
    assert b.num_cached_tokens == 2 and not b.num_pending_tokens and len(a) == 4
    batch, is_prefill = s.schedule()
    assert not is_prefill and batch == [a]  # fairness: a decodes before b's next chunk
    postprocess(s, batch, [7])
    batch, is_prefill = s.schedule()
    assert is_prefill and batch == [b] and b.num_scheduled_tokens == 5
    postprocess(s, batch, [], is_prefill=True)
    batch, is_prefill = s.schedule()
    assert not is_prefill and batch == [a]
    postprocess(s, batch, [7])
    batch, is_prefill = s.schedule()  # b's last 2 tokens: it samples and starts decoding
    assert is_prefill and batch == [b] and b.samples_next
    postprocess(s, batch, [8], is_prefill=True)
    assert list(s.running) == [a, b] and b.completion_token_ids == [8]


def _random_run(rng: random.Random) -> None:
    """One engine-like run (adds between steps, every step committed) on a small pool; every
    scheduled step must carry work while requests are queued."""
    num_blocks, budget = rng.choice([6, 8, 10]), rng.choice([4, 6, 8])
    s = make(num_blocks=num_blocks, max_num_seqs=rng.choice([2, 3, 4]),
             max_tokens_budget=budget, max_model_len=24)
    for _ in range(200):
        prompt_len, max_tokens = rng.randint(1, 23), rng.randint(1, 20)
        if rng.random() < 0.3 and -(-min(prompt_len + max_tokens, 24) // BS) <= num_blocks:
            s.add(Sequence([rng.randint(1, 2) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True), BS))
        if s.is_finished():
            continue
        batch, is_prefill = s.schedule()
        assert batch, "a step with requests queued scheduled nothing"
        postprocess(s, batch, [1] * len(batch), is_prefill)


def test_random_runs_always_progress():
    """Preemption during a chunked prompt never leaves a step empty: a preempted sequence
    queues behind the partly prefilled prompt that holds blocks, not ahead of it."""
    for seed in range(150):
        rng = random.Random(seed)
        for _ in range(10):
            _random_run(rng)

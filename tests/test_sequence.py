"""What a Sequence sends to tensor-parallel workers (only the tokens the next step feeds), and
its pending token (counted before its id is known)."""
import pickle

from nanovllm.engine.block_manager import BlockManager
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence

BS = 4


def worker_copy(seq: Sequence) -> Sequence:
    return pickle.loads(pickle.dumps(seq))


def test_prefill_sends_the_uncached_prompt_and_decode_only_the_last_token():
    bm = BlockManager(8, BS)
    seq = Sequence(list(range(1, 8)), SamplingParams(), BS)
    bm.allocate(seq)
    seq.num_scheduled_tokens = 7  # what the scheduler gives a prompt that fits the budget
    copy = worker_copy(seq)
    assert copy.token_ids == list(range(1, 8)) and copy.chunk_token_ids == list(range(1, 8))
    assert copy.samples_next
    assert (len(copy), copy.block_table, copy.num_cached_tokens) == (7, [0, 1], 0)
    seq.append_pending_token()  # the prefill cached tokens 1..7
    seq.commit_pending_token(42)
    seq.num_scheduled_tokens = 1
    bm.may_append(seq)
    copy = worker_copy(seq)
    assert copy.token_ids == [42] and copy.last_token == 42
    assert (len(copy), copy.block_table, copy.num_blocks) == (8, [0, 1], 2)
    assert not hasattr(copy, "sampling_params")  # rank 0 samples; workers never need it


def test_prefix_cached_prefill_sends_only_the_tail():
    bm = BlockManager(8, BS)
    first = Sequence([1, 2, 3, 4, 5], SamplingParams(), BS)
    bm.allocate(first)
    first.num_cached_tokens = 5  # its prefill ran
    bm.hash_blocks(first)
    second = Sequence([1, 2, 3, 4, 9, 9], SamplingParams(), BS)
    bm.allocate(second)
    assert second.num_cached_tokens == BS
    second.num_scheduled_tokens = 2
    copy = worker_copy(second)
    assert copy.chunk_token_ids == [9, 9] and copy.num_cached_tokens == BS


def test_a_chunk_sends_only_its_tokens():
    seq = Sequence(list(range(1, 11)), SamplingParams(), BS)
    seq.block_table = [0, 1, 2]
    seq.num_cached_tokens, seq.num_scheduled_tokens = 3, 4  # tokens 4..7 of 10
    copy = worker_copy(seq)
    assert copy.chunk_token_ids == [4, 5, 6, 7] and len(copy) == 10
    assert not copy.samples_next  # the chunk ends inside the prompt: no token to sample


def test_recompute_after_preemption_sends_prompt_and_completion():
    bm = BlockManager(8, BS)
    seq = Sequence([1, 2, 3, 4, 5], SamplingParams(), BS)
    bm.allocate(seq)
    for token in (10, 11):
        seq.append_pending_token()
        seq.commit_pending_token(token)
        bm.may_append(seq)
    assert worker_copy(seq).token_ids == [11]
    bm.deallocate(seq)  # preempted: its KV is gone and must be recomputed
    bm.reset()  # and no prefix-cache hit either
    bm.allocate(seq)
    seq.num_scheduled_tokens = 7
    assert seq.num_completion_tokens == 2  # upstream sends only the last token here
    assert worker_copy(seq).chunk_token_ids == [1, 2, 3, 4, 5, 10, 11]


def test_pending_token_counts_before_its_id_is_known():
    seq = Sequence([1, 2, 3], SamplingParams(), BS)
    seq.append_pending_token()
    assert (len(seq), seq.num_pending_tokens, seq.num_cached_tokens) == (4, 1, 3)
    assert seq.token_ids == [1, 2, 3] and seq.last_token == 3
    seq.commit_pending_token(7)
    assert (len(seq), seq.num_pending_tokens, seq.token_ids, seq.last_token) == (
        4, 0, [1, 2, 3, 7], 7)
    assert worker_copy(seq).num_pending_tokens == 0


def test_drop_pending_token_undoes_only_a_pending_one():
    seq = Sequence([1, 2, 3], SamplingParams(), BS)
    seq.append_pending_token()
    assert seq.drop_pending_token() and len(seq) == 3 and seq.num_pending_tokens == 0
    seq.append_pending_token()
    seq.commit_pending_token(5)
    assert not seq.drop_pending_token() and len(seq) == 4 and seq.token_ids == [1, 2, 3, 5]

"""BlockManager on tiny pools: exact block ids, ref counts and hash chains."""
import pytest

from nanovllm.engine.block_manager import BlockManager
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence

BS = 4


def seq(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams(), BS)


def written(bm: BlockManager, s: Sequence, num_tokens: int | None = None) -> None:
    """What a finished step does: the K/V of the first num_tokens (all) tokens is in the cache,
    and the full blocks among them are hashed."""
    s.num_cached_tokens = len(s) if num_tokens is None else num_tokens
    bm.hash_blocks(s)


def test_allocate_fresh_blocks_in_order():
    bm = BlockManager(8, BS)
    s = seq(list(range(10)))  # 2 full blocks + 2 tokens
    bm.allocate(s)
    assert s.block_table == [0, 1, 2]
    assert [bm.blocks[i].ref_count for i in range(3)] == [1, 1, 1]
    assert not bm.hash_to_block_id  # nothing is hashed before its K/V is written
    assert s.num_cached_tokens == 0
    written(bm, s)
    h0 = BlockManager.compute_hash([0, 1, 2, 3])
    h1 = BlockManager.compute_hash([4, 5, 6, 7], h0)
    assert (bm.blocks[0].hash, bm.blocks[1].hash, bm.blocks[2].hash) == (h0, h1, -1)
    assert bm.hash_to_block_id == {h0: 0, h1: 1}
    assert list(bm.free_block_ids) == [3, 4, 5, 6, 7]


@pytest.mark.parametrize("ends", [[3, 10], [5, 9], [8, 10], [1, 2, 6, 7, 10]])
def test_chunks_hash_the_blocks_they_complete(ends):
    """Chunk ends on or off block edges: each step hashes exactly the blocks it completed."""
    bm = BlockManager(8, BS)
    s = seq(list(range(10)))
    bm.allocate(s)
    hashes = [BlockManager.compute_hash([0, 1, 2, 3])]
    hashes.append(BlockManager.compute_hash([4, 5, 6, 7], hashes[0]))
    for end in ends:
        written(bm, s, end)
        full = end // BS
        assert [bm.blocks[i].hash for i in range(3)] == hashes[:full] + [-1] * (3 - full)
    assert bm.hash_to_block_id == {hashes[0]: 0, hashes[1]: 1}


def test_free_all_keeps_the_cached_prefixes():
    bm = BlockManager(4, BS)
    a, b = seq(list(range(6))), seq([9] * 6)
    bm.allocate(a)
    bm.allocate(b)
    written(bm, a)  # b's step never finished: its blocks are not hashed
    bm.free_all()
    assert bm.num_free_blocks == 4 and not bm.used_block_ids
    assert list(bm.free_block_ids) == [1, 2, 3, 0]  # blocks without a cached prefix first
    c = seq(list(range(4)) + [7])
    assert bm.can_allocate(c)
    bm.allocate(c)
    assert c.block_table == [0, 1] and c.num_cached_tokens == BS


def test_can_allocate_counts_prefix_hits():
    bm = BlockManager(3, BS)
    a = seq(list(range(9)))
    bm.allocate(a)
    written(bm, a)
    b = seq(list(range(8)) + [1, 2])  # 3 blocks, 2 shared with a: needs 1, none is free
    assert not bm.can_allocate(b)
    bm.deallocate(a)
    a2 = seq(list(range(8)) + [5])  # hits on 2 freed blocks still take 2 free ones
    assert bm.can_allocate(a2)


def test_without_prefix_caching_a_shared_prefix_gets_blocks_of_its_own():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a, b = seq(list(range(10))), seq(list(range(8)) + [50, 51, 52])
    bm.allocate(a)
    written(bm, a)
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table == [3, 4, 5] and b.num_cached_tokens == 0
    assert [bm.blocks[i].ref_count for i in range(6)] == [1] * 6
    assert bm.num_cache_hit_blocks == 0
    bm.free_all()
    c = seq(list(range(9)))
    bm.allocate(c)
    assert c.num_cached_tokens == 0  # freed blocks are never revived either


def test_hash_chain_depends_on_prefix():
    a = BlockManager.compute_hash([4, 5, 6, 7], BlockManager.compute_hash([0, 1, 2, 3]))
    b = BlockManager.compute_hash([4, 5, 6, 7], BlockManager.compute_hash([9, 1, 2, 3]))
    assert a != b != BlockManager.compute_hash([4, 5, 6, 7])


def test_shared_prefix_shares_physical_blocks():
    bm = BlockManager(8, BS)
    a, b = seq(list(range(10))), seq(list(range(8)) + [50, 51, 52])
    bm.allocate(a)
    written(bm, a)
    bm.allocate(b)
    assert b.block_table == [0, 1, 3]
    assert b.num_cached_tokens == 8
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    assert bm.num_cache_hit_blocks == 2
    bm.deallocate(a)
    assert [bm.blocks[i].ref_count for i in range(4)] == [1, 1, 0, 1]
    assert list(bm.free_block_ids) == [4, 5, 6, 7, 2]


def test_whole_block_prompt_keeps_last_block_uncached():
    bm = BlockManager(8, BS)
    a = seq(list(range(8)))
    bm.allocate(a)
    written(bm, a)
    b = seq(list(range(8)))  # fully cached would leave nothing to prefill
    bm.allocate(b)
    assert b.num_cached_tokens == 4
    assert b.block_table == [0, 2]
    assert bm.blocks[2].hash == -1  # recomputed; hashed again once written
    written(bm, b)
    assert bm.blocks[2].hash == bm.blocks[1].hash and bm.hash_to_block_id[bm.blocks[2].hash] == 2


def test_freed_block_revived_by_hit():
    bm = BlockManager(4, BS)
    a = seq(list(range(6)))
    bm.allocate(a)
    written(bm, a)
    bm.deallocate(a)
    assert list(bm.free_block_ids) == [2, 3, 1, 0]
    b = seq(list(range(4)) + [99])
    bm.allocate(b)
    assert b.block_table == [0, 2]  # block 0 revived from the free list, by its hash
    assert b.num_cached_tokens == 4
    assert bm.blocks[0].ref_count == 1


def test_reused_block_loses_old_hash():
    bm = BlockManager(2, BS)
    a = seq(list(range(5)))
    bm.allocate(a)
    written(bm, a)
    h0 = bm.blocks[0].hash
    bm.deallocate(a)  # free list: [1, 0]
    c = seq([7] * 9)  # needs both blocks + 1: cannot fit
    assert not bm.can_allocate(c)
    d = seq([7] * 6)
    bm.allocate(d)  # takes block 1 then 0; block 0 is overwritten
    assert d.block_table == [1, 0]
    assert h0 not in bm.hash_to_block_id
    e = seq(list(range(5)))
    bm.deallocate(d)
    bm.allocate(e)
    assert e.num_cached_tokens == 0


def test_append_allocates_and_a_block_is_hashed_once_written():
    bm = BlockManager(4, BS)
    s = seq([1, 2, 3])
    bm.allocate(s)
    # the prefill wrote tokens 1..3; 4 fills block 0 but is not written yet
    s.append_pending_token()
    s.commit_pending_token(4)
    assert bm.can_append(s)
    bm.may_append(s)
    bm.hash_blocks(s)
    assert bm.blocks[0].hash == -1 and not bm.hash_to_block_id
    s.append_pending_token()  # the decode step wrote token 4; 5 starts a new block
    s.commit_pending_token(5)
    bm.may_append(s)
    assert s.block_table == [0, 1]
    bm.hash_blocks(s)
    assert bm.blocks[0].hash == BlockManager.compute_hash([1, 2, 3, 4])
    assert bm.num_free_blocks == 2


def test_can_append_needs_a_free_block_only_at_block_start():
    bm = BlockManager(1, BS)
    s = seq([1, 2, 3, 4])
    bm.allocate(s)
    s.append_pending_token()
    s.commit_pending_token(5)
    assert not bm.can_append(s)


@pytest.mark.parametrize("n", [1, 4, 5, 12])
def test_num_blocks(n):
    assert seq(list(range(n))).num_blocks == -(-n // BS)

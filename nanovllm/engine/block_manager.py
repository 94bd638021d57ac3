"""KV-cache blocks: allocation, reference counts and the xxhash prefix cache."""
from collections import deque

import numpy as np
import xxhash

from nanovllm.engine.sequence import Sequence


class Block:
    """One physical KV block; `hash` is -1 until the block is full."""

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []

    def update(self, h: int, token_ids: list[int]) -> None:
        self.hash = h
        self.token_ids = token_ids


class BlockManager:
    """Hands out physical blocks; full blocks are shared through a chained-hash prefix cache.

    Block i of a sequence is keyed by hash(hash of block i-1, tokens of block i), so a hit
    on block i implies the whole prefix up to it matches. Freed blocks keep their hash and
    can be revived by a later hit until they are handed out again.
    """

    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()
        self.num_cache_hit_blocks = 0  # blocks served from the prefix cache since reset_stats

    @staticmethod
    def compute_hash(token_ids: list[int], prefix: int = -1) -> int:
        h = xxhash.xxh64()
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        h.update(np.array(token_ids, dtype=np.int64).tobytes())
        return h.intdigest()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def reset_stats(self) -> None:
        self.num_cache_hit_blocks = 0

    def _allocate_block(self, block_id: int) -> Block:
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]  # its old contents are about to be overwritten
        block.hash, block.token_ids, block.ref_count = -1, [], 1
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return block

    def _deallocate_block(self, block_id: int) -> None:
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def can_allocate(self, seq: Sequence) -> bool:
        return len(self.free_block_ids) >= seq.num_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence its block table, reusing cached full blocks."""
        assert not seq.block_table
        h, cache_miss = -1, False
        for i in range(seq.num_blocks):
            token_ids = seq.block(i)
            full = len(token_ids) == self.block_size
            h = self.compute_hash(token_ids, h) if full else -1
            block_id = self.hash_to_block_id.get(h, -1)
            if seq.num_prompt_logprobs is not None:
                block_id = -1  # prompt logprobs need every prompt position computed
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                cache_miss = True
            if i == seq.num_blocks - 1 and not cache_miss:
                cache_miss = True  # keep >= 1 token to compute so prefill yields logits
            if cache_miss:
                block = self._allocate_block(self.free_block_ids[0])
            else:
                seq.num_cached_tokens += self.block_size
                self.num_cache_hit_blocks += 1
                block = self.blocks[block_id]
                if block_id in self.used_block_ids:
                    block.ref_count += 1
                else:
                    block = self._allocate_block(block_id)
            if h != -1:
                block.update(h, token_ids)
                self.hash_to_block_id[h] = block.block_id
            seq.block_table.append(block.block_id)

    def deallocate(self, seq: Sequence) -> None:
        """Drop a sequence's references; blocks reaching zero return to the free list."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def reset(self) -> None:
        """Free every block and forget every cached prefix; callers drop all block tables."""
        for block in self.blocks:
            block.ref_count = 0
            block.update(-1, [])
        self.hash_to_block_id.clear()
        self.free_block_ids = deque(range(len(self.blocks)))
        self.used_block_ids.clear()

    def can_append(self, seq: Sequence) -> bool:
        """A decode step needs a new block when the newest token starts one."""
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq: Sequence) -> None:
        """Reserve room for the newest token; hash the last block once it is full and known."""
        block_table = seq.block_table
        last_block = self.blocks[block_table[-1]]
        if len(seq) % self.block_size == 1:
            assert last_block.hash != -1
            block = self._allocate_block(self.free_block_ids[0])
            block_table.append(block.block_id)
        elif len(seq) % self.block_size == 0:
            if not seq.num_pending_tokens:  # else Scheduler.commit hashes it once it is known
                self.hash_last_block(seq)
        else:
            assert last_block.hash == -1

    def hash_last_block(self, seq: Sequence) -> None:
        """Register a sequence's just-filled last block in the prefix cache."""
        block_table = seq.block_table
        last_block = self.blocks[block_table[-1]]
        assert last_block.hash == -1
        token_ids = seq.block(seq.num_blocks - 1)
        prefix = self.blocks[block_table[-2]].hash if len(block_table) > 1 else -1
        h = self.compute_hash(token_ids, prefix)
        last_block.update(h, token_ids)
        self.hash_to_block_id[h] = last_block.block_id

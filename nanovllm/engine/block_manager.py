"""KV-cache blocks: allocation, reference counts and the xxhash prefix cache."""
from collections import deque

import numpy as np
import xxhash

from nanovllm.sequence import Sequence


class Block:
    """One physical KV block; `hash` is -1 until the block is full."""

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []
        self.lora_int_id = 0  # the adapter its K/V was computed under (0: the base model)

    def update(self, h: int, token_ids: list[int], lora_int_id: int = 0) -> None:
        self.hash = h
        self.token_ids = token_ids
        self.lora_int_id = lora_int_id


class BlockManager:
    """Hands out physical blocks; full blocks are shared through a chained-hash prefix cache.
    Block i of a sequence is keyed by hash(hash of block i-1, tokens of block i), so a hit on
    block i implies the whole prefix up to it matches; block 0's "previous hash" is the
    sequence's LoRA adapter id (-1 for the base model), so K/V computed under one adapter is
    never reused by another. Freed blocks keep their hash and can be revived by a later hit
    until they are handed out again. With enable_prefix_caching False no lookup hits."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
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

    @staticmethod
    def chain_seed(seq: Sequence) -> int:
        """The hash chain's start: the adapter's id, or -1 (no prefix) for the base model."""
        return seq.lora_int_id or -1

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

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of the sequence's full blocks."""
        # The block holding the last token is never a hit: a prefill always has a row to sample.
        hits, h = [], self.chain_seed(seq)
        # off, or prompt logprobs: they need every prompt position computed
        if seq.num_prompt_logprobs is not None or not self.enable_prefix_caching:
            return hits
        for i in range((seq.num_tokens - 1) // self.block_size):
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h)
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                break
            hits.append(block_id)
        return hits

    def first_block_hash(self, seq: Sequence) -> int | None:
        """Hash of the sequence's first block if it could be a prefix-cache hit, else None."""
        if (seq.num_tokens - 1) // self.block_size == 0:
            return None
        return self.compute_hash(seq.block(0), self.chain_seed(seq))

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether the free list holds the blocks the sequence needs beyond shared hits."""
        shared = sum(1 for block_id in self.cached_prefix(seq) if block_id in self.used_block_ids)
        return len(self.free_block_ids) >= seq.num_blocks - shared

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence its whole block table: cached prefix blocks, then fresh ones."""
        assert not seq.block_table
        hits = self.cached_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block_id in self.used_block_ids:
                block.ref_count += 1
            else:  # a freed block that kept its contents: revive it, hash included
                h, token_ids = block.hash, block.token_ids
                self._allocate_block(block_id).update(h, token_ids, seq.lora_int_id)
                self.hash_to_block_id[h] = block_id
            seq.block_table.append(block_id)
        seq.num_cached_tokens = len(hits) * self.block_size
        self.num_cache_hit_blocks += len(hits)
        for _ in range(len(hits), seq.num_blocks):
            seq.block_table.append(self._allocate_block(self.free_block_ids[0]).block_id)

    def deallocate(self, seq: Sequence) -> None:
        """Drop a sequence's references; blocks reaching zero return to the free list."""
        # Freed blocks serve later steps only, never recycled inside one (kernels.pdl's reads).
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids.append(block_id)
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

    def forget_lora(self, lora_int_id: int) -> None:
        """Forget the cached blocks of an adapter no sequence uses any more (it may come back
        under its id with other weights)."""
        for block in self.blocks:
            if block.lora_int_id == lora_int_id and block.hash != -1:
                assert block.ref_count == 0, "forget_lora while a sequence holds its blocks"
                if self.hash_to_block_id.get(block.hash) == block.block_id:
                    del self.hash_to_block_id[block.hash]
                block.update(-1, [])

    def free_all(self) -> None:
        """Free every block but keep the cached prefixes; callers drop all block tables."""
        # A block is hashed only once the step writing its K/V was launched: the hashes hold.
        for block in self.blocks:
            block.ref_count = 0
        self.hash_to_block_id = {h: block_id for h, block_id in self.hash_to_block_id.items()
                                 if self.blocks[block_id].hash == h}
        # Blocks without a cached prefix are handed out first.
        self.free_block_ids = deque(sorted(range(len(self.blocks)),
                                           key=lambda i: self.blocks[i].hash != -1))
        self.used_block_ids.clear()

    def can_append(self, seq: Sequence) -> bool:
        """A decode step needs a new block when the newest token starts one."""
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq: Sequence) -> None:
        """Reserve a block for the newest token when it starts one."""
        if len(seq) % self.block_size == 1:
            block = self._allocate_block(self.free_block_ids[0])
            seq.block_table.append(block.block_id)

    def hash_blocks(self, seq: Sequence) -> None:
        """Hash the full blocks below num_cached_tokens that have no hash yet."""
        # Launched steps have written them; chunk ends need not be block ends.
        # Shared only once written: decode reads older rows before its PDL wait (kernels.pdl).
        table = seq.block_table
        end = min(seq.num_cached_tokens // self.block_size, len(table))
        if end == 0 or self.blocks[table[end - 1]].hash != -1:
            return  # the common decode case: no block filled since the last call
        start = end - 1
        while start > 0 and self.blocks[table[start - 1]].hash == -1:
            start -= 1
        h = self.blocks[table[start - 1]].hash if start else self.chain_seed(seq)
        for i in range(start, end):
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h)
            self.blocks[table[i]].update(h, token_ids, seq.lora_int_id)
            self.hash_to_block_id[h] = table[i]

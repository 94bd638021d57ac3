"""Waiting and running queues: prefill first (in chunks), then decode, preemption by recompute.

A prompt longer than the token budget left in a step is prefilled over several steps. While its
chunks run it stays at the head of `waiting`, holding its whole block table; the step that
computes its last chunk samples its first token and moves it to `running` (decoding).
"""
import logging
from collections import deque
from itertools import islice
from time import perf_counter

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.structured_outputs import accept_token
from nanovllm.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


class Scheduler:
    """Picks each step's batch: all prefill or all decode. A prefill step that leaves a prompt
    unfinished is followed by a decode step, so decodes advance once per chunk of a long prompt."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...], num_blocks: int, block_size: int,
                 longest_first: bool = False, max_loras: int = 0,
                 enable_prefix_caching: bool = True):
        self.max_num_seqs = max_num_seqs
        self.max_loras = max_loras  # adapters among the running and scheduled; 0: no LoRA
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.longest_first = longest_first
        self.eos_token_ids = eos_token_ids  # any of them ends a completion (unless ignore_eos)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # tokens prefilled again after a preemption
        self._decode_next = False  # the last prefill step ended inside a prompt

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    @property
    def num_used_blocks(self) -> int:
        return len(self.block_manager.used_block_ids)

    def stats(self) -> dict:
        return dict(cache_hit_blocks=self.block_manager.num_cache_hit_blocks,
                    preemptions=self.num_preemptions,
                    recomputed_tokens=self.num_recomputed_tokens)

    def reset_stats(self) -> None:
        self.num_preemptions = self.num_recomputed_tokens = 0
        self.block_manager.reset_stats()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (all blocks must be free)."""
        assert not self.num_used_blocks, "reset_prefix_cache while sequences hold blocks"
        self.block_manager.reset()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """(sequences, is_prefill) of the next step; num_scheduled_tokens set per sequence."""
        if not (self._decode_next and self.running):
            scheduled = self._schedule_prefill()
            if scheduled:
                self._decode_next = not scheduled[-1].samples_next
                return scheduled, True
        self._decode_next = False
        batch = self._schedule_decode()
        if self.longest_first:  # the backend asks; `running` keeps the preemption order
            batch.sort(key=lambda seq: seq.num_tokens, reverse=True)
        return batch, False

    def _schedule_prefill(self) -> list[Sequence]:
        """Waiting sequences in order, each given the rest of its prompt or the budget left; a
        sequence is allocated its whole block table (after any cached prefix) when admitted."""
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        computing: set[int] = set()  # hashes of the first blocks this step computes
        # Adapters of the running and this step's sequences: at most max_loras, so that every
        # step's adapters fit in the GPU slots (a sequence waits for a slot, in order).
        loras = {seq.lora_int_id for seq in self.running} if self.max_loras else set()
        while self.waiting and budget and len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.max_loras:
                if not self._fits_lora(seq, loras):
                    break
                loras.add(seq.lora_int_id)
            if not seq.block_table:  # not admitted yet (or preempted)
                head = self.block_manager.first_block_hash(seq)
                if head in computing:
                    break  # shares a block this step computes: next step it is a cache hit
                if not self.block_manager.can_allocate(seq):
                    break
                self.block_manager.allocate(seq)
                if head is not None and not seq.num_cached_tokens:
                    computing.add(head)
                if seq.num_completion_tokens:  # it has output, so it was preempted: a recompute
                    self.num_recomputed_tokens += len(seq) - seq.num_cached_tokens
            seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, budget)
            budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
            if not seq.samples_next:
                break  # the budget is spent: it stays first in waiting for its next chunk
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
        return scheduled

    def _fits_lora(self, seq: Sequence, loras: set[int]) -> bool:
        """Whether seq's adapter is among `loras` or fits beside them (the base always fits)."""
        return (not seq.lora_int_id or seq.lora_int_id in loras
                or len(loras - {0}) < self.max_loras)

    def _schedule_decode(self) -> list[Sequence]:
        batch = list(islice(self.running, self.max_num_seqs))
        block_size, block_manager = self.block_manager.block_size, self.block_manager
        new_blocks = sum(1 for seq in batch if seq.num_tokens % block_size == 1)
        if new_blocks <= block_manager.num_free_blocks:
            # Fast path, taken unless blocks run out: nobody is preempted, order is unchanged,
            # and only sequences that open or fill a block need the block manager.
            for seq in batch:
                if seq.num_tokens % block_size <= 1:
                    block_manager.may_append(seq)
            return batch
        return self._schedule_decode_preempting()

    def _schedule_decode_preempting(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                victim = self._preemption_victim()
                if victim is None:
                    self.running.appendleft(seq)
                    self.preempt(seq)
                    break
                self.preempt(victim)
            else:
                self.block_manager.may_append(seq)
                scheduled.append(seq)
        assert scheduled, "no sequence could be scheduled: KV pool smaller than one sequence"
        self.running.extendleft(reversed(scheduled))
        return scheduled

    def _preemption_victim(self) -> Sequence | None:
        """The most recently admitted decoding sequence, else a partly prefilled one."""
        if self.running:
            return self.running[-1]
        return next((seq for seq in reversed(self.waiting) if seq.block_table), None)

    def preempt(self, seq: Sequence) -> None:
        """Free a running or partly prefilled sequence's blocks; it is recomputed later."""
        self.block_manager.deallocate(seq)
        self.num_preemptions += 1
        if seq.status == SequenceStatus.RUNNING:
            seq.status = SequenceStatus.WAITING
            self.running.remove(seq)
            # A partly prefilled prompt at the head keeps its place: ahead of it, this sequence
            # could wait forever for the blocks that prompt holds.
            head_holds_blocks = bool(self.waiting and self.waiting[0].block_table)
            self.waiting.insert(1 if head_holds_blocks else 0, seq)

    def abort(self, seqs: list[Sequence], in_flight: list[Sequence] = ()) -> None:
        """Recover from an exception mid-step: drop `seqs` and the in-flight pending tokens,
        send every other unfinished sequence back to waiting, and free the whole pool."""
        # An interrupt can land between any two lines, so no block table or reference count is
        # trusted; the cached prefixes are kept, since only launched steps hash blocks.
        dropped = {seq.seq_id for seq in seqs}
        for seq in in_flight:
            if seq.drop_pending_token() and seq.finish_reason == "length":
                # Finished by its pending token (finish() itself may have been cut): not really.
                seq.status, seq.finish_reason = SequenceStatus.RUNNING, None
                if seq not in self.running and seq not in self.waiting:
                    self.running.append(seq)
        survivors = [seq for seq in (*self.running, *self.waiting)
                     if seq.seq_id not in dropped and not seq.is_finished]
        for seq in seqs:
            if not seq.is_finished:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        for seq in (*seqs, *survivors):
            seq.drop_pending_token()  # an append cut between its lines
            seq.block_table.clear()
            seq.num_cached_tokens = 0
            seq.num_scheduled_tokens = 1
        for seq in survivors:
            seq.status = SequenceStatus.WAITING
        self.running.clear()
        self.waiting = deque(survivors)  # formerly running first: they arrived earlier
        self.block_manager.free_all()
        self._decode_next = False

    def advance(self, seqs: list[Sequence], samples: list[bool] | None = None
                ) -> list[tuple[int, Sequence]]:
        """After a launch: count the step's tokens as cached, hash the blocks they fill, give
        each sampling row a pending token and finish those at a length limit. Returns (row in
        the step's ids, seq) of the sequences given one (samples None: every row samples)."""
        # Hashing at launch is safe: later steps run after this one on the same stream, and an
        # abort waits for launched work (a step that failed to launch is never advanced).
        advanced = []
        row = -1
        block_size, block_manager = self.block_manager.block_size, self.block_manager
        for i, seq in enumerate(seqs):
            if samples is not None and not samples[i]:  # a chunk that ends inside the prompt
                if not seq.is_finished:
                    seq.num_cached_tokens += seq.num_scheduled_tokens
                    block_manager.hash_blocks(seq)
                continue
            row += 1  # rows of the step's sampled ids: one per sampling sequence
            if seq.is_finished:  # stopped by the previous commit: its new token is dropped
                continue
            seq.num_scheduled_tokens = 1
            advanced.append((row, seq))
            seq.append_pending_token()
            if samples is not None or seq.num_cached_tokens % block_size == 0:
                block_manager.hash_blocks(seq)  # a decode token fills a block now and then
            if (seq.num_completion_tokens >= seq.sampling_params.max_tokens
                    or len(seq) >= self.max_model_len):
                self.finish(seq, "length")
        return advanced

    def commit(self, advanced: list[tuple[int, Sequence]], token_ids: list[int]
               ) -> list[Sequence]:
        """Record the ids of advanced sequences' pending tokens; return those that finished."""
        finished = []
        now = perf_counter()
        for row, seq in advanced:
            token_id = token_ids[row]
            seq.commit_pending_token(token_id)
            if seq.num_completion_tokens == 1:
                seq.first_token_time = now
            stops, rejected = self._stops_on(seq, token_id), False
            if seq.grammar is not None:  # advanced by every token; "stop" once it terminates
                terminated = accept_token(seq.grammar, token_id)
                rejected, stops = terminated is None, bool(terminated) or stops
            if rejected:  # its constraints left no token: it ends alone, the batch goes on
                logger.warning("request %s: token %d breaks its grammar (its other "
                               "constraints left no token the grammar allows): aborted",
                               seq.request_id, token_id)
                self.finish(seq, "abort", now)
            elif stops:
                self.finish(seq, "stop", now)
            if seq.is_finished:
                seq.finish_time = now  # a length limit is set in advance(); the token lands now
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence, reason: str, now: float | None = None) -> None:
        """Retire a running (or, pipelined, just preempted) sequence: free its blocks, record why
        it stopped (one finished by length on this step takes the new reason)."""
        if seq.is_finished:
            seq.finish_reason = reason
            return
        seq.finish_time = perf_counter() if now is None else now
        seq.finish_reason = reason
        # Waiting, too, in the pipelined engine: preempted while its last token was in flight.
        (self.running if seq.status == SequenceStatus.RUNNING else self.waiting).remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.block_manager.deallocate(seq)

    def _stops_on(self, seq: Sequence, token_id: int) -> bool:
        params = seq.sampling_params
        stops = ((not params.ignore_eos and token_id in self.eos_token_ids)
                 or bool(params.stop_token_ids and token_id in params.stop_token_ids))
        return stops and seq.num_completion_tokens >= params.min_tokens  # vLLM's check_stop

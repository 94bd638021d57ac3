"""Property-based tests: BlockManager and Scheduler under random add / step / finish / preempt /
abort sequences on tiny pools, driven without a model (random token ids stand in for it)."""
import sys
from collections import Counter
from contextlib import contextmanager

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.request_checks import max_blocks_needed
from nanovllm.engine.scheduler import Scheduler
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence, SequenceStatus

BS = 4
EOS = 0
MAX_MODEL_LEN = 24
# Two token values make shared prefixes, and so prefix-cache hits, common.
TOKENS = st.integers(1, 2)
PROMPTS = st.lists(TOKENS, min_size=1, max_size=MAX_MODEL_LEN - 1)
SETTINGS = settings(max_examples=80, stateful_step_count=40, deadline=None)


def chained_hashes(seq: Sequence, num_blocks: int) -> list[int]:
    hashes, h = [], -1
    for i in range(num_blocks):
        h = BlockManager.compute_hash(seq.block(i), h)
        hashes.append(h)
    return hashes


def check_sequence_blocks(bm: BlockManager, seq: Sequence, in_flight: bool = False) -> None:
    """Between steps a sequence has blocks for all its tokens but the newest (for all of them
    once a launched step is in flight, or while its prompt is prefilled in chunks). Exactly
    the full blocks below num_cached_tokens (written by launched steps) are hashed, by the
    chain over the sequence's own tokens."""
    resident = len(seq) if in_flight else len(seq) - 1
    assert len(seq.block_table) == -(-resident // BS)
    assert seq.num_cached_tokens <= resident
    num_hashed = seq.num_cached_tokens // BS
    for i, h in enumerate(chained_hashes(seq, num_hashed)):
        block = bm.blocks[seq.block_table[i]]
        assert block.hash == h and block.token_ids == seq.block(i)
    assert all(bm.blocks[i].hash == -1 for i in seq.block_table[num_hashed:])


def check_pool(bm: BlockManager, holders: list[Sequence], in_flight: tuple = ()) -> None:
    """Free + used = total; ref counts equal the block-table references of `holders`."""
    free = list(bm.free_block_ids)
    assert len(free) == len(set(free)) and set(free).isdisjoint(bm.used_block_ids)
    assert len(free) + len(bm.used_block_ids) == len(bm.blocks)
    refs = Counter(block_id for seq in holders for block_id in seq.block_table)
    for block in bm.blocks:
        assert block.ref_count >= 0
        assert block.ref_count == refs[block.block_id]
        assert (block.ref_count > 0) == (block.block_id in bm.used_block_ids)
    for h, block_id in bm.hash_to_block_id.items():
        assert bm.blocks[block_id].hash == h
    for seq in holders:
        check_sequence_blocks(bm, seq, seq in in_flight)


def check_all_free(bm: BlockManager) -> None:
    assert bm.num_free_blocks == len(bm.blocks) and not bm.used_block_ids
    assert all(block.ref_count == 0 for block in bm.blocks)


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives BlockManager the way the scheduler does: allocate + sample on admission,
    may_append + sample per decode, deallocate on finish or preemption."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(6, BS)
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []

    @rule(tokens=PROMPTS)
    def add(self, tokens):
        self.waiting.append(Sequence(tokens, SamplingParams(), BS))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), token=TOKENS)
    def admit(self, data, token):
        seq = data.draw(st.sampled_from(self.waiting))
        if not self.bm.can_allocate(seq):
            return
        self.bm.allocate(seq)
        assert seq.num_cached_tokens % BS == 0 and seq.num_cached_tokens < len(seq)
        event(f"prefix hit: {seq.num_cached_tokens > 0}")
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.append_pending_token()  # the prefill's sampled token
        seq.commit_pending_token(token)
        self.bm.hash_blocks(seq)  # once the prefill has run

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=TOKENS)
    def decode(self, data, token):
        seq = data.draw(st.sampled_from(self.running))
        if len(seq) < MAX_MODEL_LEN and self.bm.can_append(seq):
            self.bm.may_append(seq)
            seq.append_pending_token()
            seq.commit_pending_token(token)
            self.bm.hash_blocks(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def release(self, data, preempt):
        seq = data.draw(st.sampled_from(self.running))
        self.bm.deallocate(seq)
        self.running.remove(seq)
        if preempt:
            self.waiting.append(seq)  # recomputed from its tokens when admitted again

    @invariant()
    def pool_is_consistent(self):
        check_pool(self.bm, self.running)
        assert all(not seq.block_table and seq.num_cached_tokens == 0 for seq in self.waiting)

    def teardown(self):
        for seq in self.running:
            self.bm.deallocate(seq)
        check_all_free(self.bm)


@contextmanager
def interrupt_after(num_lines: int):
    """Raise KeyboardInterrupt at the num_lines-th line run in nanovllm/engine, as Ctrl-C could."""
    count = 0
    previous = sys.gettrace()

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
            if count == num_lines:
                sys.settrace(previous)
                raise KeyboardInterrupt
        return local

    def tracer(frame, event, arg):
        return local if any(f"nanovllm/{room}/" in frame.f_code.co_filename
                            for room in ("engine", "runner", "executor")) else None

    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(previous)


class SchedulerMachine(RuleBasedStateMachine):
    """Scheduler + BlockManager with valid requests only (as the engine admits them); a token
    budget of 6 (not a multiple of the block size) chunks the longer prompts."""

    def __init__(self):
        super().__init__()
        self.num_blocks, self.max_num_seqs, self.budget = 8, 3, 6
        self.s = Scheduler(self.max_num_seqs, self.budget, MAX_MODEL_LEN, (EOS,),
                           self.num_blocks, BS)
        self.seqs: list[Sequence] = []
        self.pending: list[Sequence] = []  # the pipelined engine's in-flight batch
        self.samples: list[bool] | None = None  # which of its rows sample (None: decode)

    @property
    def bm(self) -> BlockManager:
        return self.s.block_manager

    @property
    def unfinished(self) -> list[Sequence]:
        return [seq for seq in self.seqs if not seq.is_finished]

    @rule(tokens=PROMPTS, max_tokens=st.integers(1, 30), ignore_eos=st.booleans())
    def add(self, tokens, max_tokens, ignore_eos):
        if max_blocks_needed(len(tokens), max_tokens, MAX_MODEL_LEN, BS) > self.num_blocks:
            return  # generate() rejects it up front
        seq = Sequence(tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos), BS)
        self.s.add(seq)
        self.seqs.append(seq)

    def _step(self, tokens: list[int]) -> None:
        if self.pending:  # a lockstep step after pipelined ones: commit first, nothing in flight
            finished = self._commit(self._advance(), tokens)
            self.pending = []
            for seq in finished:
                self._check_finished(seq)
            if self.s.is_finished():
                return
        self.pending, self.samples = self._schedule()  # lockstep: launched, committed at once
        finished = self._commit(self._advance(), tokens)
        self.pending = []
        for seq in finished:
            self._check_finished(seq)

    def _advance(self) -> list[tuple[int, Sequence]]:
        return self.s.advance(self.pending, self.samples)

    def _commit(self, advanced: list[tuple[int, Sequence]], tokens: list[int]) -> list[Sequence]:
        return self.s.commit(advanced, tokens)

    def _pipelined_step(self, tokens: list[int]) -> None:
        """LLMEngine.step without tensor parallelism: advance, schedule, launch, commit. The
        in-flight batch stays recorded until its commit is done, as abort needs it."""
        advanced = self._advance()
        assert all(seq.num_pending_tokens == 1 for _, seq in advanced)
        batch, samples = self._schedule() if not self.s.is_finished() else ([], None)
        finished = self._commit(advanced, tokens)
        self.pending, self.samples = batch, samples
        for seq in finished:
            self._check_finished(seq)

    def _schedule(self) -> tuple[list[Sequence], list[bool] | None]:
        """The next batch and, for a prefill, which rows sample (as the engine records)."""
        preemptions = self.s.num_preemptions
        batch, is_prefill = self.s.schedule()
        event(f"preempted in schedule: {self.s.num_preemptions > preemptions}")
        assert 0 < len(batch) <= self.max_num_seqs  # an admitted request always progresses
        if is_prefill:
            assert sum(seq.num_scheduled_tokens for seq in batch) <= self.budget
            assert all(seq.num_scheduled_tokens > 0 for seq in batch)
            samples = [seq.samples_next for seq in batch]
            event(f"chunked: {not all(samples)}")
            assert all(samples[:-1])  # only the last row of a step may end inside its prompt
            return batch, samples
        assert all(len(seq.block_table) == seq.num_blocks for seq in batch)
        assert all(seq.num_blocks <= -(-MAX_MODEL_LEN // BS) for seq in batch)
        return batch, None

    def _check_finished(self, seq: Sequence) -> None:
        params = seq.sampling_params
        assert not seq.block_table and seq not in self.s.running and seq not in self.s.waiting
        assert len(seq) <= MAX_MODEL_LEN and seq.num_completion_tokens <= params.max_tokens
        if seq.finish_reason == "stop":
            assert seq.last_token == EOS and not params.ignore_eos
        else:
            assert seq.finish_reason == "length"
            assert seq.num_completion_tokens == params.max_tokens or len(seq) == MAX_MODEL_LEN

    @precondition(lambda self: not self.s.is_finished())
    @rule(tokens=st.lists(st.integers(0, 2), min_size=3, max_size=3))
    def step(self, tokens):
        self._step(tokens)

    @precondition(lambda self: not self.s.is_finished() or self.pending)
    @rule(tokens=st.lists(st.integers(0, 2), min_size=3, max_size=3))
    def pipelined_step(self, tokens):
        self._pipelined_step(tokens)

    @precondition(lambda self: any(seq.block_table for seq in self.unfinished)
                  and not self.pending)
    @rule(data=st.data())
    def preempt(self, data):
        """A decoding or a partly prefilled sequence."""
        seq = data.draw(st.sampled_from([seq for seq in self.unfinished if seq.block_table]))
        self.s.preempt(seq)

    @precondition(lambda self: not self.s.is_finished())
    @rule(data=st.data())
    def model_fails(self, data):
        """An exception between schedule and commit aborts one call's requests."""
        if self.pending:  # the pipelined engine advances the in-flight batch first
            self._advance()
        if not self.s.is_finished():
            self.s.schedule()
        unfinished = self.unfinished
        call = data.draw(st.lists(st.sampled_from(unfinished), unique=True)) if unfinished else []
        self.s.abort(call, self.pending)
        self.pending = []  # the engine drops the failed step's sampled ids
        assert all(seq.is_finished for seq in call)
        check_all_free(self.bm)  # cached prefixes are kept: check_pool checks their hashes

    @precondition(lambda self: not self.s.is_finished())
    @rule(at_line=st.integers(1, 400), tokens=st.lists(st.integers(0, 2), min_size=3,
                                                        max_size=3), pipelined=st.booleans())
    def interrupted_step(self, at_line, tokens, pipelined):
        """Ctrl-C at any line of a step; generate() then aborts every in-flight request."""
        try:
            with interrupt_after(at_line):
                (self._pipelined_step if pipelined else self._step)(tokens)
        except KeyboardInterrupt:
            event("interrupted")
            self.s.abort(self.seqs, self.pending)
            self.pending = []
            assert self.s.is_finished()
            check_all_free(self.bm)

    @invariant()
    def queues_and_pool_are_consistent(self):
        running, waiting = list(self.s.running), list(self.s.waiting)
        assert {id(seq) for seq in running}.isdisjoint(id(seq) for seq in waiting)
        assert sorted(seq.seq_id for seq in running + waiting) == sorted(
            seq.seq_id for seq in self.unfinished)
        assert all(seq.status == SequenceStatus.RUNNING for seq in running)
        assert all(seq.status == SequenceStatus.WAITING for seq in waiting)
        # block holders in waiting: the one partly prefilled prompt, if any
        assert len([seq for seq in waiting if seq.block_table]) <= 1
        assert all(len(seq) <= MAX_MODEL_LEN for seq in self.seqs)
        # no pending token outlives its step, and every counted token's id is known
        assert all(not seq.num_pending_tokens and len(seq.token_ids) == len(seq)
                   for seq in self.seqs)
        prefilling = [seq for seq in waiting if seq.block_table]  # its whole prompt has blocks
        check_pool(self.bm, running + prefilling, (*self.pending, *prefilling))

    def teardown(self):
        steps = 0
        while not self.s.is_finished():  # every admitted request finishes: no livelock
            self._step([1, 1, 1])
            steps += 1
            assert steps < 5000
        check_all_free(self.bm)


TestBlockManagerProperties = SETTINGS(BlockManagerMachine).TestCase
TestSchedulerProperties = SETTINGS(SchedulerMachine).TestCase

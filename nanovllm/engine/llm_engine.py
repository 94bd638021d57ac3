"""The engine loop: add requests, step the scheduler and model, collect finished outputs."""
import weakref
from contextlib import nullcontext
from time import perf_counter

from tqdm.auto import tqdm

from nanovllm.config import config_from_kwargs
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.outputs import completion_params, record_logprobs, request_output
from nanovllm.engine.sampled_ids import SampledIds
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.stats import StepCounters
from nanovllm.engine.stop_strings import StopStringChecker
from nanovllm.engine.validation import RequestLimits, validate_request, validate_requests
from nanovllm.engine.worker import WorkerGroup
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.tokenizer import load_tokenizer


class LLMEngine:
    """Owns the scheduler and the model runner(s); `generate` runs requests to completion."""

    def __init__(self, model: str, **kwargs):
        attention_backend = kwargs.pop("attention_backend", "auto")
        self.config = config = config_from_kwargs(model, kwargs)
        # The tokenizer first: a bad directory then fails before any model or worker exists.
        self.tokenizer = load_tokenizer(config.model)
        # Ranks 1..N-1 first: rank 0's runner agrees on the KV pool size with them.
        self.workers = (WorkerGroup(config, attention_backend)
                        if config.tensor_parallel_size > 1 else None)
        try:
            with self.workers.guard() if self.workers else nullcontext():
                self.model_runner = ModelRunner(config, 0, attention_backend)
        except BaseException:
            if self.workers is not None:
                self.workers.shutdown()
            raise
        if self.workers is not None:
            self.workers.runner = self.model_runner
        eos = self.tokenizer.eos_token_id
        if eos is None:
            eos = getattr(config.hf_config, "eos_token_id", None)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, eos,
                                   self.model_runner.num_kvcache_blocks,
                                   config.kvcache_block_size)
        self.stop_checker = StopStringChecker(self.tokenizer)
        self.counters = StepCounters()
        # (sequences, their sampled ids on the device) of the step launched but not committed
        self.pending: tuple[list[Sequence], SampledIds] | None = None
        # Workers build their inputs from host token ids, so tensor parallelism runs lockstep.
        self.pipelined = self.workers is None
        # Runs on `del llm`, garbage collection or interpreter exit, whichever is first; it
        # holds the workers and runner, not the engine, so it does not keep the engine alive.
        self._finalizer = weakref.finalize(self, _release, self.workers, self.model_runner)

    def shutdown(self) -> None:
        """Stop the workers; release the model, KV pool and graphs; safe to call twice."""
        if hasattr(self, "_finalizer"):
            self._finalizer()
        self.workers = self.model_runner = self.pending = None

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams) -> int:
        """Validate and queue one request; returns its sequence id."""
        token_ids = validate_request(prompt, sampling_params, self.request_limits(),
                                     self.tokenizer.encode)
        if sampling_params.n != 1:
            raise ValueError(f"n={sampling_params.n}: add_request() runs one completion; "
                             "generate() runs n")
        seq = Sequence(token_ids, sampling_params, self.config.kvcache_block_size)
        self.scheduler.add(seq)
        return seq.seq_id

    def request_limits(self) -> RequestLimits:
        """What a request may ask for: checked before it is queued."""
        return RequestLimits(vocab_size=self.config.hf_config.vocab_size,
                             max_model_len=self.config.max_model_len,
                             block_size=self.config.kvcache_block_size,
                             num_blocks=len(self.scheduler.block_manager.blocks))

    def step(self) -> tuple[list[Sequence], int]:
        """Run one scheduled batch; returns (finished sequences, tokens processed: + prefill,
        - decode). Without tensor parallelism the engine runs one step ahead: a step is
        launched before the previous step's sampled ids are read, so the host's bookkeeping
        overlaps the GPU, and sequences are returned one step after their last token."""
        if self.model_runner is None:
            raise RuntimeError("the engine is shut down")
        if self.is_finished():
            return [], 0
        try:
            finished, num_tokens = (self._step_pipelined() if self.pipelined
                                    else self._step_lockstep())
        except BaseException:
            # Nothing a failed step touched is trusted: every unfinished request goes back to
            # waiting, without placeholders, to be recomputed (generate() aborts its own).
            self._abort([])
            raise
        for seq in finished:
            self.model_runner.token_counts.release(seq.seq_id)
        return finished, num_tokens

    def _step_pipelined(self) -> tuple[list[Sequence], int]:
        """Advance the launched batch, launch the next, then commit the launched one's ids."""
        t0 = perf_counter()
        pending, self.pending = self.pending, None
        advanced = self.scheduler.advance(pending[0]) if pending else []
        seqs, is_prefill, num_tokens, kv_blocks_in_use = self._schedule()
        if seqs:
            previous = pending[1].device if pending and not is_prefill else None
            self.pending = (seqs, self.model_runner.launch(seqs, is_prefill, previous))
        finished = []
        if pending:
            # The only host sync: by now the GPU has the next step queued behind this one.
            finished = self.scheduler.commit(advanced, pending[1].tolist(), seqs)
            record_logprobs(pending[0], advanced, pending[1])
            finished += self._check_stop_strings([seq for _, seq in advanced])
        if seqs:
            self.counters.record(is_prefill, len(seqs), abs(num_tokens), t0, perf_counter(),
                                 kv_blocks_in_use)
        return finished, num_tokens

    def _step_lockstep(self) -> tuple[list[Sequence], int]:
        """Schedule, run on every rank, and postprocess before returning."""
        t0 = perf_counter()
        seqs, is_prefill, num_tokens, kv_blocks_in_use = self._schedule()
        if self.workers is None:
            sampled = self.model_runner.run(seqs, is_prefill)
        else:
            sampled = self.workers.execute(self.model_runner, "run", seqs, is_prefill)
        finished = self.scheduler.postprocess(seqs, sampled.tolist())
        record_logprobs(seqs, list(enumerate(seqs)), sampled)
        finished += self._check_stop_strings(seqs)
        self.counters.record(is_prefill, len(seqs), abs(num_tokens), t0, perf_counter(),
                             kv_blocks_in_use)
        return finished, num_tokens

    def _schedule(self) -> tuple[list[Sequence], bool, int, int]:
        """The next batch, whether it is prefill, its token count (+ tokens a prefill computes,
        - sequences a decode extends) and the KV blocks in use once it is scheduled (the step's
        peak: finishing sequences free blocks later)."""
        seqs, is_prefill = self.scheduler.schedule()
        if is_prefill:
            num_tokens = sum(len(seq) - seq.num_cached_tokens for seq in seqs)
        else:
            num_tokens = -len(seqs)
        return seqs, is_prefill, num_tokens, len(self.scheduler.block_manager.used_block_ids)

    def _check_stop_strings(self, seqs: list[Sequence]) -> list[Sequence]:
        """Finish sequences whose text now contains a stop string; returns the newly finished.

        A match on the step that also ended a sequence (EOS, length) turns its reason to "stop".
        """
        newly_finished = []
        for seq in seqs:
            if not seq.sampling_params.stop:  # the common path decodes nothing
                continue
            cut = self.stop_checker.check(seq)
            if cut is not None:
                seq.text = self.stop_checker.text(seq)[:cut]
                if seq.is_finished:
                    seq.finish_reason = "stop"
                else:
                    self.scheduler.finish(seq, "stop")
                    newly_finished.append(seq)
            if seq.is_finished:
                self.stop_checker.forget(seq)
        return newly_finished

    def stats(self) -> dict:
        """Counters since the last reset_stats(): see README.md, "Engine counters"."""
        scheduler = self.scheduler
        stats = self.counters.as_dict()
        stats.update(cache_hit_blocks=scheduler.block_manager.num_cache_hit_blocks,
                     preemptions=scheduler.num_preemptions,
                     recomputed_tokens=scheduler.num_recomputed_tokens)
        if self.counters.timeline is not None:
            stats["timeline"] = list(self.counters.timeline)
        return stats

    def reset_stats(self, timeline: bool = False) -> None:
        """Zero every counter; with timeline=True also record one entry per step from now on."""
        self.counters = StepCounters(timeline=[] if timeline else None)
        self.scheduler.block_manager.num_cache_hit_blocks = 0
        self.scheduler.num_preemptions = 0
        self.scheduler.num_recomputed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Drop all cached prefixes, e.g. between benchmark repeats."""
        if not self.is_finished():
            raise RuntimeError("reset_prefix_cache() needs an idle engine")
        self.scheduler.block_manager.reset_prefix_cache()

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self.pending is None

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        """Run one prompt or a list to completion; one SamplingParams for all or one per prompt.

        Returns, in input order, one dict per prompt (see outputs.request_output): "text",
        "token_ids", "finish_reason", "logprobs", "prompt_logprobs", "outputs", "metrics".
        Every request is validated before any is queued, so a ValueError changes nothing. On
        any exception (Ctrl-C included) this call's requests are aborted and the engine stays
        usable.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts, list)
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt: a string or a list of token ids
        if sampling_params is None:
            sampling_params = SamplingParams()
        requests = validate_requests(prompts, sampling_params, self.request_limits(),
                                     self.tokenizer.encode)
        block_size = self.config.kvcache_block_size
        # n completions of a prompt: adjacent, so the later ones hit the first one's blocks
        groups = [[Sequence(token_ids, p, block_size) for p in completion_params(sp)]
                  for token_ids, sp in requests]
        seqs = [seq for group in groups for seq in group]
        own = {seq.seq_id for seq in seqs}  # requests queued by add_request are not ours
        pbar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True,
                    disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        try:
            for seq in seqs:
                self.scheduler.add(seq)
            while not self.is_finished():
                t = perf_counter()
                finished, num_tokens = self.step()
                if use_tqdm and num_tokens:  # formatting costs more than a step's scheduling
                    elapsed = perf_counter() - t
                    if num_tokens > 0:
                        prefill_tps = num_tokens / elapsed
                    else:
                        decode_tps = -num_tokens / elapsed
                    pbar.set_postfix(Prefill=f"{int(prefill_tps)}tok/s",
                                     Decode=f"{int(decode_tps)}tok/s", refresh=False)
                pbar.update(sum(seq.seq_id in own for seq in finished))
        except BaseException:
            self._abort(seqs)
            for seq in seqs:
                self.stop_checker.forget(seq)
            raise
        finally:
            pbar.close()
        return [request_output(group, self.tokenizer.decode) for group in groups]

    def _abort(self, seqs: list[Sequence]) -> None:
        """Drop the in-flight step's ids and abort `seqs`; others go back to waiting."""
        self.pending = None
        if self.model_runner is not None:
            self.model_runner.wait_idle()  # no queued copy may still read a staging buffer
            # counts may hold a dropped token: survivors refill theirs when next scheduled
            self.model_runner.token_counts.clear()
        self.scheduler.abort(seqs)


def _release(workers: WorkerGroup | None, runner: ModelRunner) -> None:
    """Stop the workers (which frees rank 0's runner first, see WorkerGroup.runner), then free
    rank 0's model, KV pool and graphs (again harmless)."""
    try:
        if workers is not None:
            workers.shutdown()
    finally:
        runner.shutdown()

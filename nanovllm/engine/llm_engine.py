"""The engine loop: add requests, step the scheduler and model, collect finished outputs."""
import weakref
from collections.abc import Callable
from time import perf_counter

from nanovllm.config import config_from_kwargs
from nanovllm.engine.outputs import RequestTable, record_logprobs, request_output
from nanovllm.engine.progress import check_use_tqdm, progress_bar
from nanovllm.engine.request_checks import (
    Prompt,
    RequestLimits,
    validate_request,
    validate_requests,
)
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.stats import StepCounters
from nanovllm.engine.stop_strings import StopStringChecker
from nanovllm.engine.structured_outputs import StructuredOutputs
from nanovllm.executor.base import Executor, UniprocExecutor
from nanovllm.executor.multiproc import MultiprocExecutor
from nanovllm.lora.registry import LoRARegistry, lora_request_list
from nanovllm.lora.request import LoRARequest
from nanovllm.runner.sampled_ids import InFlightStep, SampledIds, StepLogits
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence
from nanovllm.utils.tokenizer import eos_token_ids, load_tokenizer


class LLMEngine:
    """Owns the scheduler and the model runner(s); `generate` runs requests to completion.
    Private test hooks: `_pipelined = False` runs lockstep; `_launch` sends every step."""

    def __init__(self, model: str, **kwargs):
        self.config = config = config_from_kwargs(model, kwargs)
        # The tokenizer first: a bad directory then fails before any model or worker exists.
        self.tokenizer = load_tokenizer(config.tokenizer)
        # Tensor parallelism's worker processes, or one rank in this process: one interface.
        self.executor: Executor | None = (MultiprocExecutor(config)
                                          if config.tensor_parallel_size > 1
                                          else UniprocExecutor(config))
        self.model_runner = self.executor.runner  # rank 0's
        eos = eos_token_ids(self.tokenizer, config.hf_config, config.model)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, eos,
                                   self.model_runner.num_kvcache_blocks,
                                   config.kvcache_block_size,
                                   self.model_runner.backend.longest_first,
                                   config.max_loras if config.enable_lora else 0,
                                   config.enable_prefix_caching)
        self.loras = (LoRARegistry(config.hf_config, config.max_lora_rank, self.executor)
                      if config.enable_lora else None)
        self.stop_checker = StopStringChecker(self.tokenizer)
        # The logits' width, not the tokenizer's: the bitmask covers every id the model scores.
        self.grammars = StructuredOutputs(self.tokenizer, config.hf_config.vocab_size, eos)
        self._counters = StepCounters()
        self._in_flight: InFlightStep | None = None
        self._unreturned: list[dict] = []  # hand-queued requests that finished in generate()
        self._requests = RequestTable()
        self._pipelined = self.executor.pipelined
        self._host_tokens_queued = False  # a grammar or bad_words request was ever queued
        # Runs on `del llm`, garbage collection or interpreter exit, whichever is first; it
        # holds the executor, not the engine, so it does not keep the engine alive.
        self._finalizer = weakref.finalize(self, self.executor.shutdown)

    def shutdown(self) -> None:
        """Release every rank's model, KV pool and graphs (ending any workers); idempotent."""
        if hasattr(self, "_finalizer"):
            self._finalizer()
        self.executor = self.model_runner = self._in_flight = None

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams,
                    lora_request: LoRARequest | None = None) -> int:
        """Validate and queue one request; returns its request id (see step())."""
        token_ids, params = validate_request(prompt, sampling_params, self.request_limits(),
                                             self.tokenizer.encode, self.grammars)
        [lora_request] = lora_request_list(lora_request, 1, self.loras is not None)
        if lora_request is not None:
            self.loras.register([lora_request])
        return self._queue(token_ids, params, lora_request)[0].request_id

    def _queue(self, token_ids: list[int], params: SamplingParams,
               lora_request: LoRARequest | None = None) -> list[Sequence]:
        """Queue a request's n completions, adjacent: the later ones hit the first's blocks."""
        lora_int_id = 0 if lora_request is None else lora_request.lora_int_id
        seqs = self._requests.add(token_ids, params, self.config.kvcache_block_size,
                                  lora_int_id)
        # set once: engines that never see such a request never look for one in a step
        self._host_tokens_queued = self._host_tokens_queued or params.needs_host_tokens
        for seq in seqs:
            if params.structured_outputs is not None:
                seq.grammar = self.grammars.matcher(params.structured_outputs)
            self.scheduler.add(seq)
        return seqs

    def request_limits(self) -> RequestLimits:
        """What a request may ask for: checked before it is queued."""
        self._check_running()
        return RequestLimits(vocab_size=self.config.hf_config.vocab_size,
                             max_model_len=self.config.max_model_len,
                             block_size=self.config.kvcache_block_size,
                             num_blocks=self.model_runner.num_kvcache_blocks,
                             eos_token_ids=self.scheduler.eos_token_ids)

    def step(self) -> tuple[list[dict], int]:
        """Run one step; returns (finished requests' outputs, tokens: + prefill, - decode)."""
        # Outputs include hand-queued requests that finished during an earlier generate().
        finished, num_tokens = self._step()
        outputs, self._unreturned = self._unreturned, []
        return outputs + [self._output(g) for g in self._requests.finished(finished)], num_tokens

    def _step(self) -> tuple[list[Sequence], int]:
        """Advance the in-flight step, launch the next, then commit the in-flight one's ids."""
        # Committing after the launch overlaps the host's bookkeeping with the GPU. Lockstep
        # (tensor parallelism: workers need host ids) commits the launched step at once.
        self._check_running()
        if not self._has_work():
            return [], 0
        t0 = perf_counter()
        previous = self._in_flight  # stays recorded until committed, for _abort
        try:
            if previous is not None:
                previous.advanced = self.scheduler.advance(previous.seqs, previous.samples)
            seqs, is_prefill, num_tokens, kv_blocks_in_use = self._schedule()
            if previous is not None and isinstance(previous.sampled, StepLogits):
                # its rows' state is at the step before it, which the last call committed
                previous.sampled = self.executor.sample(previous.sampled)
            launched = None  # nothing to launch once the last in-flight step is all that is left
            if seqs:
                # A row whose sampling reads the previous step's token on the host (a grammar's
                # mask, bad_words) defers its sampler to the next call, after the commit below:
                # the GPU runs this forward meanwhile, and the next forward follows the sampler.
                defer = previous is not None and self._needs_host_tokens(seqs)
                samples = [seq.samples_next for seq in seqs] if is_prefill else None
                launched = InFlightStep(seqs, self._launch(seqs, is_prefill, previous, defer),
                                        samples)
            finished = self._commit(previous) if previous is not None else []
            self._in_flight = launched
            if launched is not None and not self._pipelined:
                launched.advanced = self.scheduler.advance(seqs, launched.samples)
                finished += self._commit(launched)
                self._in_flight = None
        except BaseException:
            # Nothing a failed step touched is trusted: every unfinished request goes back to
            # waiting, without pending tokens, to be recomputed (generate() aborts its own).
            self._abort([])
            raise
        if seqs:
            self._counters.record(is_prefill, len(seqs), abs(num_tokens), t0, perf_counter(),
                                  kv_blocks_in_use)
        for seq in finished:
            self.model_runner.token_counts.release(seq.seq_id)
        return finished, num_tokens

    def _needs_host_tokens(self, seqs: list[Sequence]) -> bool:
        """Whether a row's sampling reads its latest token on the host (a grammar's next mask,
        bad_words' banned ids); a plain engine never looks."""
        return self._host_tokens_queued and any(seq.sampling_params.needs_host_tokens
                                                for seq in seqs)

    def _launch(self, seqs: list[Sequence], is_prefill: bool,
                previous: InFlightStep | None = None, defer_sample: bool = False
                ) -> SampledIds | StepLogits:
        """Start a step on every rank; pending tokens from `previous` (pipelined only)."""
        if self.loras is not None:  # adapters a host cache let go of are sent again
            self.loras.reload({seq.lora_int_id for seq in seqs})
        if previous is None or is_prefill or not previous.advanced:  # no pending token
            return self.executor.launch(seqs, is_prefill, defer_sample=defer_sample)
        return self.executor.launch(seqs, False, previous.sampled.device,
                                    previous.source_rows(seqs), defer_sample=defer_sample)

    def _commit(self, step: InFlightStep) -> list[Sequence]:
        """Read an advanced step's ids (the one host sync per step); returns the finished."""
        finished = self.scheduler.commit(step.advanced, step.sampled.tolist())
        record_logprobs(step.seqs, step.advanced, step.sampled)
        advanced = [seq for _, seq in step.advanced]
        return finished + self.stop_checker.finish_stopped(advanced, self.scheduler.finish)

    def _schedule(self) -> tuple[list[Sequence], bool, int, int]:
        """(batch, is_prefill, tokens: + prefill, - decode, KV blocks in use: the step's peak)."""
        seqs, is_prefill = self.scheduler.schedule()
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs) if is_prefill else -len(seqs)
        return seqs, is_prefill, num_tokens, self.scheduler.num_used_blocks

    def stats(self) -> dict:
        """Counters since the last reset_stats(): see docs/api.md, "Engine counters"."""
        stats = self._counters.as_dict()
        stats.update(self.scheduler.stats())
        if self._counters.timeline is not None:
            stats["timeline"] = list(self._counters.timeline)
        return stats

    def reset_stats(self, timeline: bool = False) -> None:
        """Zero every counter; with timeline=True also record one entry per step from now on."""
        self._counters = StepCounters(timeline=[] if timeline else None)
        self.scheduler.reset_stats()

    def reset_prefix_cache(self) -> None:
        """Drop all cached prefixes, e.g. between benchmark repeats."""
        if self._has_work():
            raise RuntimeError("reset_prefix_cache() needs an idle engine")
        self.scheduler.reset_prefix_cache()

    def is_finished(self) -> bool:
        """Nothing left to run, and step() has returned every hand-queued request's output."""
        return not self._has_work() and not self._unreturned

    def _check_running(self) -> None:
        if self.executor is None:
            raise RuntimeError("the engine is shut down")

    def _has_work(self) -> bool:
        return not self.scheduler.is_finished() or self._in_flight is not None

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | Callable = True,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None
                 ) -> list[dict]:
        """Run one prompt or a list to completion; returns one dict per prompt, in order."""
        check_use_tqdm(use_tqdm)
        # Every request is validated before any is queued, so a ValueError changes nothing. On
        # any exception (Ctrl-C too) this call's requests are aborted; the engine stays usable.
        requests = validate_requests(prompts, sampling_params, self.request_limits(),
                                     self.tokenizer.encode, self.grammars,
                                     self.config.default_sampling_params)
        loras = lora_request_list(lora_request, len(requests), self.loras is not None)
        if any(loras):
            self.loras.register(loras)
        groups: list[list[Sequence]] = []
        pbar = progress_bar(use_tqdm, len(requests))
        tok_s = [0.0, 0.0]  # prefill, decode: the last step's rate of each kind
        try:
            for (token_ids, sp), lora in zip(requests, loras):
                groups.append(self._queue(token_ids, sp, lora))
            # Ours (not add_request's), each made as it finishes: text decoded while the GPU works
            outputs = dict.fromkeys(group[0].request_id for group in groups)
            while self._has_work():
                t = perf_counter()
                finished, num_tokens = self._step()
                if use_tqdm and num_tokens:  # formatting costs more than a step's scheduling
                    tok_s[num_tokens < 0] = abs(num_tokens) / (perf_counter() - t)
                    pbar.set_postfix(Prefill=f"{int(tok_s[0])}tok/s",
                                     Decode=f"{int(tok_s[1])}tok/s", refresh=False)
                for group in self._requests.finished(finished):
                    if group[0].request_id in outputs:
                        outputs[group[0].request_id] = self._output(group)
                        pbar.update(1)
                    else:
                        self._unreturned.append(self._output(group))
        except BaseException:
            seqs = [seq for group in groups for seq in group]
            self._abort(seqs)
            for seq in seqs:
                self._requests.drop(seq.request_id)
                self.stop_checker.forget(seq)
            raise
        finally:
            pbar.close()
        return [outputs[group[0].request_id] for group in groups]

    def _abort(self, seqs: list[Sequence]) -> None:
        """Drop the in-flight step and abort `seqs`; others go back to waiting."""
        in_flight, self._in_flight = self._in_flight, None
        if self.model_runner is not None:
            self.model_runner.wait_idle()  # no queued copy may still read a staging buffer
            # counts may hold a dropped token: survivors refill theirs when next scheduled
            self.model_runner.token_counts.clear()
        self.scheduler.abort(seqs, in_flight.seqs if in_flight is not None else ())

    def _output(self, group: list[Sequence]) -> dict:
        return request_output(group, self.tokenizer.decode)

    # ---- Online serving: what AsyncLLM needs beyond add_request/step ---------------------

    def abort_request(self, request_id: int) -> bool:
        """Finish a request now and free its KV blocks; False when unknown or finished."""
        aborted = [seq for seq in (*self.scheduler.running, *self.scheduler.waiting)
                   if seq.request_id == request_id]  # each of its n completions
        for seq in aborted:
            self.scheduler.finish(seq, "abort")
            self.stop_checker.forget(seq)
            # its penalty row, as a finished sequence's (a step in flight that still counts
            # into it runs before the next sequence's zeroing, on the same stream)
            self.model_runner.token_counts.release(seq.seq_id)
        self._requests.finished(aborted)  # step() never returns an aborted request
        return bool(aborted)

    def new_tokens(self, num_read: dict[int, int]
                   ) -> dict[int, tuple[list[int], list[dict[int, float]] | None]]:
        """Request id -> (completion tokens after num_read[id], their logprobs or None)."""
        # Requests with no new token are left out. _commit records a token's logprobs in the
        # same step, so the two lists stay aligned.
        new = {}
        for seq in self.scheduler.running:
            start = num_read.get(seq.seq_id)
            if start is not None:
                # the new ids alone, not the whole completion sliced each step; a pending token
                # is not in token_ids yet
                ids = seq.token_ids[seq.num_prompt_tokens + start:]
                if ids:
                    logprobs = seq.logprobs
                    new[seq.seq_id] = ids, None if logprobs is None else logprobs[start:]
        return new


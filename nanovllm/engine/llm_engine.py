"""The engine loop: add requests, step the scheduler and model, collect finished outputs."""
import atexit
from contextlib import nullcontext
from time import perf_counter

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from nanovllm.config import config_from_kwargs
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.worker import WorkerGroup
from nanovllm.sampling_params import SamplingParams


class LLMEngine:
    """Owns the scheduler and the model runner(s); `generate` runs requests to completion."""

    def __init__(self, model: str, **kwargs):
        attention_backend = kwargs.pop("attention_backend", "auto")
        self.config = config = config_from_kwargs(model, kwargs)
        self.model_runner: ModelRunner | None = None
        # Ranks 1..N-1 first: rank 0's runner agrees on the KV pool size with them.
        self.workers = (WorkerGroup(config, attention_backend)
                        if config.tensor_parallel_size > 1 else None)
        atexit.register(self.shutdown)
        try:
            with self.workers.guard() if self.workers else nullcontext():
                self.model_runner = ModelRunner(config, 0, attention_backend)
            self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        except BaseException:
            self.shutdown()
            raise
        eos = self.tokenizer.eos_token_id
        if eos is None:
            eos = getattr(config.hf_config, "eos_token_id", None)
        self.eos_token_id = eos
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, eos,
                                   self.model_runner.num_kvcache_blocks,
                                   config.kvcache_block_size)

    def shutdown(self) -> None:
        """Stop the workers; release the model, KV pool and graphs; safe to call twice."""
        atexit.unregister(self.shutdown)
        workers, self.workers = getattr(self, "workers", None), None
        runner, self.model_runner = getattr(self, "model_runner", None), None
        if workers is not None:
            workers.shutdown()
        if runner is not None:
            runner.shutdown()

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams) -> int:
        """Queue one request; returns its sequence id."""
        if isinstance(prompt, str):
            prompt = self.tokenizer.encode(prompt)
        seq = Sequence(prompt, sampling_params, self.config.kvcache_block_size)
        self.scheduler.add(seq)
        return seq.seq_id

    def step(self) -> tuple[list[Sequence], int]:
        """Run one scheduled batch; returns (finished sequences, tokens processed: + prefill,
        - decode)."""
        if self.model_runner is None:
            raise RuntimeError("the engine is shut down")
        seqs, is_prefill = self.scheduler.schedule()
        if is_prefill:
            num_tokens = sum(len(seq) - seq.num_cached_tokens for seq in seqs)
        else:
            num_tokens = -len(seqs)
        if self.workers is None:
            token_ids = self.model_runner.run(seqs, is_prefill)
        else:
            token_ids = self.workers.execute(self.model_runner, "run", seqs, is_prefill)
        finished = self.scheduler.postprocess(seqs, token_ids)
        return finished, num_tokens

    def reset_prefix_cache(self) -> None:
        """Drop all cached prefixes, e.g. between benchmark repeats."""
        if not self.is_finished():
            raise RuntimeError("reset_prefix_cache() needs an idle engine")
        self.scheduler.block_manager.reset_prefix_cache()

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def generate(self, prompts: list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = True) -> list[dict]:
        """Run all prompts to completion; results in input order as {"text", "token_ids"}."""
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        seq_ids = [self.add_request(p, sp) for p, sp in zip(prompts, sampling_params)]
        outputs: dict[int, Sequence] = {}
        pbar = tqdm(total=len(prompts), desc="Generating", dynamic_ncols=True,
                    disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        while not self.is_finished():
            t = perf_counter()
            finished, num_tokens = self.step()
            elapsed = perf_counter() - t
            if num_tokens > 0:
                prefill_tps = num_tokens / elapsed
            else:
                decode_tps = -num_tokens / elapsed
            pbar.set_postfix(Prefill=f"{int(prefill_tps)}tok/s", Decode=f"{int(decode_tps)}tok/s")
            for seq in finished:
                outputs[seq.seq_id] = seq
                pbar.update(1)
        pbar.close()
        return [self._output(outputs[i]) for i in seq_ids]

    def _output(self, seq: Sequence) -> dict:
        token_ids = seq.completion_token_ids
        ttft = seq.first_token_time - seq.arrival_time
        latency = seq.finish_time - seq.arrival_time
        return {"text": self.tokenizer.decode(token_ids), "token_ids": token_ids,
                "finish_reason": seq.finish_reason,
                "metrics": {"ttft_s": ttft, "latency_s": latency}}

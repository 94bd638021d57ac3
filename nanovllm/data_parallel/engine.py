"""Data parallelism: N whole engines in Ray actors, on one machine or many; the LLM facade's
DataParallelLLM puts LLM's API on it."""
import weakref
from collections.abc import Callable
from dataclasses import replace

from nanovllm.config import config_from_kwargs
from nanovllm.data_parallel.placement import place_requests
from nanovllm.data_parallel.replicas import (
    EngineReplica,
    connect,
    describe_failure,
    import_ray,
    release,
    replica_device,
)
from nanovllm.engine.progress import check_use_tqdm, progress_bar
from nanovllm.engine.request_checks import Prompt, validate_requests
from nanovllm.layers.backend_names import check_backend_name
from nanovllm.lora.adapter import load_adapter
from nanovllm.lora.registry import lora_request_list
from nanovllm.lora.request import LoRARequest
from nanovllm.sampling_params import MAX_SEED, SamplingParams
from nanovllm.utils.field_checks import check_int
from nanovllm.utils.tokenizer import load_tokenizer


def check_data_parallel_size(value: object) -> int:
    """The number of replicas, or a ValueError naming the bad value."""
    return check_int("data_parallel_size", value, 1, None, "an int >= 1")


class DataParallelEngine:
    """N engines as Ray actors, each with its own tensor_parallel_size GPUs (a process on CPU);
    requests are split across them by expected tokens, and outputs come back in input order."""

    def __init__(self, model: str, data_parallel_size: int, **kwargs):
        n = check_data_parallel_size(data_parallel_size)
        # the name only: the replicas resolve it on their own devices
        check_backend_name(kwargs.get("attention_backend", "auto"))
        ray = import_ray(n)
        # Checked here, before any process starts; CUDA is checked against the cluster's GPUs,
        # not this machine's (the driver may have none).
        device = kwargs.get("device", "auto")
        config = config_from_kwargs(model, {
            **{k: v for k, v in kwargs.items() if k != "attention_backend"},
            "device": "cpu" if device in ("auto", "cuda") else device})
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.data_parallel_size, self.block_size = n, config.kvcache_block_size
        self.config = config
        owns_connection = connect(ray)
        self.replicas: list = []
        self._finalizer = weakref.finalize(self, release, ray, self.replicas, owns_connection)
        try:
            device, num_gpus = replica_device(ray, device, config.tensor_parallel_size, n)
            actor = ray.remote(num_cpus=0, num_gpus=num_gpus, max_restarts=0)(EngineReplica)
            # replica r draws from seed + r: replicas that shared one stream would draw the
            # same noise for the requests each runs at the same step
            self.replicas += [actor.remote(config.model, dict(
                kwargs, device=device, seed=None if config.seed is None
                else (config.seed + r) % (MAX_SEED + 1))) for r in range(n)]
            self.replica_info = self._call_all("info")
        except BaseException:
            self._stop(graceful=False)
            raise
        self.limits = replace(self.replica_info[0]["limits"],
                              num_blocks=min(i["limits"].num_blocks for i in self.replica_info))

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | Callable = True,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None
                 ) -> list[dict]:
        """As LLMEngine.generate; each replica runs its share in one call."""
        check_use_tqdm(use_tqdm)
        requests = validate_requests(prompts, sampling_params, self.limits, self.tokenizer.encode,
                                     default=self.config.default_sampling_params)
        loras = lora_request_list(lora_request, len(requests), self.config.enable_lora)
        for request in {r.lora_int_id: r for r in loras if r is not None}.values():
            # checked here too, so that a bad adapter stops the call before any replica starts
            load_adapter(request, self.config.hf_config, self.config.max_lora_rank)
        token_ids = [ids for ids, _ in requests]
        placement = place_requests(token_ids, [p.max_tokens for _, p in requests],
                                   self.data_parallel_size, self.block_size)
        calls = {r: ([token_ids[i] for i in indices], [requests[i][1] for i in indices],
                     [loras[i] for i in indices])
                 for r, indices in enumerate(placement) if indices}
        pbar = progress_bar(use_tqdm, len(requests))
        try:
            results = self._call("generate", calls, lambda r: pbar.update(len(placement[r])))
        finally:
            pbar.close()
        outputs: list[dict] = [{}] * len(requests)
        for r, outs in results.items():
            for i, out in zip(placement[r], outs):
                outputs[i] = out
        return outputs

    def stats(self) -> dict:
        """The replicas' counters summed (rates too: they run at once), each's under "replicas"."""
        return merge_stats(self._call_all("stats"))

    def reset_stats(self, timeline: bool = False) -> None:
        self._call_all("reset_stats", timeline)

    def reset_prefix_cache(self) -> None:
        self._call_all("reset_prefix_cache")

    def shutdown(self) -> None:
        """Free every replica's engine, end the actors, and stop Ray if this LLM started it."""
        self._stop(graceful=True)

    def _call_all(self, method: str, *args) -> list:
        results = self._call(method, {r: args for r in range(len(self.replicas))})
        return [results[r] for r in range(len(self.replicas))]

    def _call(self, method: str, calls: dict[int, tuple],
              on_done: Callable[[int], None] | None = None) -> dict:
        """Run `method` on the replicas named in `calls` at once; {replica: result}."""
        if not self._finalizer.alive:
            raise RuntimeError("the LLM is shut down")
        import ray
        refs = {getattr(self.replicas[r], method).remote(*args): r for r, args in calls.items()}
        results, pending = {}, list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                r = refs[done[0]]
                try:
                    results[r] = ray.get(done[0])
                except ray.exceptions.RayError as e:
                    self._fail(r, e)
                if on_done is not None:
                    on_done(r)
        except BaseException:
            # Ctrl-C included: a running replica call cannot be interrupted, only its actor
            # ended, so nothing in flight is left running.
            self._stop(graceful=False)
            raise
        return results

    def _fail(self, r: int, error: Exception) -> None:
        """Stop every replica and raise an error naming replica `r`."""
        where = (f" (pid {self.replica_info[r]['pid']} on {self.replica_info[r]['host']})"
                 if getattr(self, "replica_info", None) else "")
        self._stop(graceful=False)
        raise RuntimeError(f"data-parallel replica {r} of {self.data_parallel_size}{where} "
                           f"failed: {describe_failure(error)}; the other replicas were "
                           "stopped and the LLM is shut down") from error

    def _stop(self, graceful: bool) -> None:
        state = self._finalizer.detach()
        if state is not None:
            _, func, args, _ = state
            func(*args, graceful=graceful)


def merge_stats(per_replica: list[dict]) -> dict:
    """Sum the replicas' stats; the timelines interleave by start time."""
    merged: dict = {}
    for stats in per_replica:
        for key, value in stats.items():
            if key != "timeline":
                merged[key] = merged.get(key, 0) + value
    if all("timeline" in stats for stats in per_replica):
        merged["timeline"] = sorted(e for stats in per_replica for e in stats["timeline"])
    merged["replicas"] = [{k: v for k, v in s.items() if k != "timeline"} for s in per_replica]
    return merged

"""Data parallelism: N whole engines in Ray actors behind LLM's API, on one machine or many."""
import os
import socket
import weakref
from collections.abc import Callable
from dataclasses import replace

from tqdm.auto import tqdm

from nanovllm.config import config_from_kwargs
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.request_placement import place_requests
from nanovllm.engine.validation import as_conversation_list, validate_requests
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.tokenizer import chat_prompt_ids, load_tokenizer

RAY_HINT = 'pip install -e ".[ray]"'
# Seconds shutdown() waits for replicas to free their engines before killing them.
SHUTDOWN_TIMEOUT_S = 60


def check_data_parallel_size(value: object) -> int:
    """The number of replicas, or a ValueError naming the bad value."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"data_parallel_size={value!r} is invalid: expected an int >= 1")
    return value


def import_ray(data_parallel_size: int):
    """Ray, or a ValueError saying how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ValueError(f"data_parallel_size={data_parallel_size} runs its replicas on Ray, "
                         f"which is not installed: {RAY_HINT}") from e
    return ray


class EngineReplica:
    """One whole engine inside a Ray actor: its GPUs are the ones Ray gave the actor."""

    def __init__(self, model: str, kwargs: dict):
        self.engine = LLMEngine(model, **kwargs)

    def info(self) -> dict:
        """Where it runs and what requests it accepts."""
        return dict(pid=os.getpid(), host=socket.gethostname(),
                    limits=self.engine.request_limits())

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[dict]:
        return self.engine.generate(prompts, params, use_tqdm=False)

    def stats(self) -> dict:
        return self.engine.stats()

    def reset_stats(self, timeline: bool) -> None:
        self.engine.reset_stats(timeline)

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()


class DataParallelLLM:
    """`LLM(model, data_parallel_size=N, **kwargs)`: N engines as Ray actors, each with its own
    tensor_parallel_size GPUs (a process on CPU); requests are split across them by expected
    tokens, and outputs come back in input order."""

    def __init__(self, model: str, data_parallel_size: int, **kwargs):
        n = check_data_parallel_size(data_parallel_size)
        ray = import_ray(n)
        # Checked here, before any process starts; CUDA is checked against the cluster's GPUs,
        # not this machine's (the driver may have none).
        device = kwargs.get("device", "auto")
        config = config_from_kwargs(model, {
            **{k: v for k, v in kwargs.items() if k != "attention_backend"},
            "device": "cpu" if device in ("auto", "cuda") else device})
        self.tokenizer = load_tokenizer(config.model)
        self.data_parallel_size, self.block_size = n, config.kvcache_block_size
        owns_connection = connect(ray)
        self.replicas: list = []
        self._finalizer = weakref.finalize(self, release, ray, self.replicas, owns_connection)
        try:
            device, num_gpus = replica_device(ray, device, config.tensor_parallel_size, n)
            actor = ray.remote(num_cpus=0, num_gpus=num_gpus, max_restarts=0)(EngineReplica)
            self.replicas += [actor.remote(config.model, dict(kwargs, device=device))
                              for _ in range(n)]
            self.replica_info = self._call_all("info")
        except BaseException:
            self._stop(graceful=False)
            raise
        self.limits = replace(self.replica_info[0]["limits"],
                              num_blocks=min(i["limits"].num_blocks for i in self.replica_info))

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        """As LLMEngine.generate: every request is validated here, then each replica runs its
        share in one call; a failing replica stops them all (see _fail)."""
        requests = validate_requests(prompts, sampling_params, self.limits, self.tokenizer.encode)
        token_ids = [ids for ids, _ in requests]
        placement = place_requests(token_ids, [p.max_tokens for _, p in requests],
                                   self.data_parallel_size, self.block_size)
        calls = {r: ([token_ids[i] for i in indices], [requests[i][1] for i in indices])
                 for r, indices in enumerate(placement) if indices}
        pbar = tqdm(total=len(requests), desc="Generating", dynamic_ncols=True,
                    disable=not use_tqdm)
        with pbar:
            results = self._call("generate", calls, lambda r: pbar.update(len(placement[r])))
        outputs: list[dict] = [{}] * len(requests)
        for r, outs in results.items():
            for i, out in zip(placement[r], outs):
                outputs[i] = out
        return outputs

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[dict]:
        """As LLM.chat: conversations through the chat template, then generate()."""
        return self.generate(chat_prompt_ids(self.tokenizer, as_conversation_list(messages)),
                             sampling_params, use_tqdm)

    def stats(self) -> dict:
        """The replicas' counters summed (their rates too: replicas run at the same time), with
        each replica's own under "replicas"."""
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


def connect(ray) -> bool:
    """Join the configured cluster (an earlier ray.init, or RAY_ADDRESS), else start a local
    one; True when this call made the connection, which shutdown then closes."""
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init()  # ray.init reads the address itself
    else:
        ray.init(include_dashboard=False)
    return True


def replica_device(ray, device: str, tp: int, n: int) -> tuple[str, int]:
    """("cuda" or "cpu", GPUs per replica); CUDA when asked or, on "auto", when the cluster
    has GPUs. Refuses what could never be placed: that would wait forever."""
    nodes = [node["Resources"].get("GPU", 0) for node in ray.nodes() if node["Alive"]]
    if device == "auto":
        device = "cuda" if any(nodes) else "cpu"
    if device == "cpu":
        return "cpu", 0
    slots = sum(int(gpus) // tp for gpus in nodes)
    if slots < n:
        raise ValueError(f"data_parallel_size={n} with tensor_parallel_size={tp} needs {n} "
                         f"replicas of {tp} GPU(s) on one machine each; the Ray cluster's "
                         f"machines have {[int(g) for g in nodes]} GPUs, room for {slots}")
    return "cuda", tp


def release(ray, replicas: list, owns_connection: bool, graceful: bool = True) -> None:
    """End the replicas (after freeing their engines when graceful) and close the connection
    this LLM made; on a local cluster that stops Ray and all its processes."""
    if not ray.is_initialized():
        return
    if graceful and replicas:
        ray.wait([r.shutdown.remote() for r in replicas], num_returns=len(replicas),
                 timeout=SHUTDOWN_TIMEOUT_S)
    for replica in replicas:
        ray.kill(replica, no_restart=True)
    replicas.clear()
    if owns_connection:
        ray.shutdown()


def describe_failure(error: Exception) -> str:
    """One line: the exception raised inside the replica (its traceback's last line), or why
    its process died."""
    import ray
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    raised = isinstance(error, ray.exceptions.RayTaskError) or getattr(
        error, "actor_init_failed", False)
    return lines[-1] if raised else lines[0]


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

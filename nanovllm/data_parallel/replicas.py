"""Ray's side of data parallelism: the actor that holds one engine, and the cluster's plumbing."""
import os
import socket

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams

RAY_HINT = 'pip install -e ".[ray]"'
# Seconds shutdown() waits for replicas to free their engines before killing them.
SHUTDOWN_TIMEOUT_S = 60


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
        """Where it runs, what requests it accepts and the seed its sampler draws from."""
        return dict(pid=os.getpid(), host=socket.gethostname(),
                    limits=self.engine.request_limits(), seed=self.engine.config.seed)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 loras: list | None = None) -> list[dict]:
        return self.engine.generate(prompts, params, use_tqdm=False, lora_request=loras)

    def stats(self) -> dict:
        return self.engine.stats()

    def reset_stats(self, timeline: bool) -> None:
        self.engine.reset_stats(timeline)

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()


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
    """One line: the exception raised inside the replica, or why its process died."""
    import ray
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    raised = isinstance(error, ray.exceptions.RayTaskError) or getattr(
        error, "actor_init_failed", False)
    return lines[-1] if raised else lines[0]

"""Compile ahead, in parallel: start-up runs a batch of steps once with every Triton launch
compiling its kernel on a thread pool instead of running it, then runs them for real.

A launch compiles its kernel variant before it runs, so a serial warm-up compiles one variant
at a time. Triton's AsyncCompileMode (triton.runtime._async_compile) hands each compile to an
executor, but a launch still waits for its own kernel (JITFunction.run, Triton 3.6:
`kernel = kernel.result()` before `kernel.run(...)`); only a warmup launch (`warmup=True`:
compile, run nothing) returns at once. So the compile-only pass turns every launch into a
warmup launch, and AsyncCompileMode's exit waits for all compiles and puts each kernel in its
JIT cache. Triton releases the GIL in its MLIR and LLVM passes, and ptxas is a subprocess, but
its code generator holds it: with forked workers (kernels.compile_workers) each thread hands
its compile to a process and then reads the kernel from the file cache. Each pool thread then
loads its kernel on the GPU (its launcher built with gcc on Triton 3.6, its module loaded)
while other kernels still compile, so a CUDA graph's capture needs no eager run to load them
(runner/cuda_graphs.py).

In that pass no kernel writes its outputs, so a step must not branch on them on the host:
start-up's steps (warm-up, fused-limit calibration, graph capture) only copy sampled ids back,
and size every tensor from shapes. Variants depend on shapes, dtypes, pointer alignment and
constexprs, never on values, so the pass reaches the ones the real pass runs (checked under
the interpreter by tests/runner/test_warmup_variants.py); the real pass compiles any it missed.
Triton is imported when called: CPU-only installs may lack it.
"""
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from nanovllm.kernels.compile_workers import CompileWorkers, task_of

# "0": compile serially, as kernels launch; "threads": on threads without workers (A/B runs)
ENV = "NANOVLLM_PARALLEL_COMPILE"
MAX_THREADS = 32  # a pass has a few dozen variants at most

logger = logging.getLogger(__name__)

# Set while this thread's launches only compile: another thread's launches still run.
_compile_only: ContextVar[bool] = ContextVar("nanovllm_compile_only", default=False)


def compile_threads(device: str, ranks_per_host: int) -> int:
    """Threads that compile start-up's kernels ahead; 0: none, kernels compile as they launch
    (not CUDA, the interpreter, NANOVLLM_PARALLEL_COMPILE=0, or no AsyncCompileMode)."""
    if device != "cuda" or os.environ.get(ENV, "1") == "0":
        return 0
    import triton
    if triton.knobs.runtime.interpret or not hasattr(triton, "AsyncCompileMode"):
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = min(MAX_THREADS, (cpus or 1) // ranks_per_host)  # every rank compiles the same
    return threads if threads >= 2 else 0


@contextmanager
def launches_compile_only(kernel_type: type) -> Iterator[None]:
    """Within, on this thread, every launch of a kernel_type kernel is a warmup launch: it
    compiles the kernel (or, under AsyncCompileMode, queues its compile) and runs nothing."""
    launch = kernel_type.run

    def run(self, *args, grid, warmup, **kwargs):
        return launch(self, *args, grid=grid, warmup=warmup or _compile_only.get(), **kwargs)

    kernel_type.run = run
    token = _compile_only.set(True)
    try:
        yield
    finally:
        _compile_only.reset(token)
        kernel_type.run = launch


def start_workers(threads: int) -> CompileWorkers | None:
    """Forked compile workers for `threads` pool threads (one each), unless ENV says threads;
    call before CUDA or any thread starts (kernels.compile_workers)."""
    if not threads or os.environ.get(ENV) == "threads" or not hasattr(os, "fork"):
        return None
    try:
        return CompileWorkers(threads)
    except OSError as error:  # no room for a process: the threads compile alone
        logger.warning("compile workers not started (%s): compiling on threads", error)
        return None


def compile_in_parallel(steps: Iterable[Callable[[], object]], threads: int,
                        kernel_type: type | None = None,
                        workers: CompileWorkers | None = None) -> None:
    """Run each step with its Triton launches (of kernel_type, default JITFunction) compiling
    on `threads` threads (each through one of `workers`, if given) and running nothing; return
    once all compiled (errors raise here)."""
    import triton
    from triton.runtime import _async_compile
    from triton.runtime.jit import JITFunction
    # The RNG states are restored: the sampler seeds its kernel from torch's CPU generator, and
    # a start-up with the pass must leave it as one without does.
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    # Pool threads load each kernel on this thread's device (Triton loads on the current one).
    with (torch.random.fork_rng(devices),
          ThreadPoolExecutor(threads, thread_name_prefix="nanovllm-compile",
                             initializer=torch.cuda.set_device if devices else None,
                             initargs=tuple(devices)) as pool):
        mode = triton.AsyncCompileMode(_CompileThenLoad(pool, workers))
        try:
            with mode, launches_compile_only(kernel_type or JITFunction):
                for step in steps:
                    step()
        finally:
            # Triton 3.6's exit deactivates the mode only once every compile succeeded: after
            # an error this thread's launches would otherwise keep queueing compiles.
            if _async_compile.active_mode.get() is mode:
                _async_compile.active_mode.set(None)


class _CompileThenLoad:
    """The pool as AsyncCompileMode's executor: a thread that compiled a kernel (in a worker
    first, if any) then loads it (load), while other threads still compile."""

    def __init__(self, pool: ThreadPoolExecutor, workers: CompileWorkers | None = None) -> None:
        self.pool, self.workers = pool, workers

    def submit(self, compile_fn: Callable[..., object], /, *args, **kwargs) -> Future:
        return self.pool.submit(_compile_then_load, compile_fn, args, kwargs, self.workers)


def _compile_then_load(compile_fn: Callable[..., object], args: tuple, kwargs: dict,
                       workers: CompileWorkers | None = None) -> object:
    task = task_of(compile_fn) if workers is not None and not (args or kwargs) else None
    hashes = workers.compile(task) if task is not None else None
    kernel = compile_fn(*args, **kwargs)  # a file-cache hit after the worker's compile
    if workers is not None:
        workers.check(kernel, hashes)
    load(kernel)
    return kernel


def load(kernel: object) -> None:
    """Load a compiled kernel onto the GPU (its module, and its launcher, built with gcc on
    Triton 3.6) here, where its first launch would: a CUDA graph's capture then needs no eager
    run first for its Triton kernels. Without Triton's private loader: the launcher only."""
    init_handles = getattr(kernel, "_init_handles", None)
    if init_handles is None or not hasattr(kernel, "src") or not torch.cuda.is_initialized():
        build_launcher(kernel)
        return
    init_handles()


def build_launcher(kernel: object) -> None:
    """Build a compiled kernel's launcher here, where its first launch would build it on the
    launching thread: Triton 3.6 compiles a C launcher per kernel signature with gcc (~0.3 s
    each, a quarter of a cold start-up serially) and caches it in TRITON_CACHE_DIR, where the
    launch then finds it. Newer Triton's launchers build nothing: this costs nothing there."""
    if getattr(kernel, "module", None) is not None or not hasattr(kernel, "src"):
        return  # loaded already, or not a real kernel (the driver is looked up only for one)
    from triton.runtime import driver
    driver.active.launcher_cls(kernel.src, kernel.metadata)


def start_prewarm(threads: int, device: torch.device) -> threading.Thread | None:
    """With compile threads, start on a thread what the first compile waits for: the CUDA
    driver's utilities (gcc on an empty cache), the compile target and Triton's cache key (a
    hash of its own sources), so they overlap loading the weights; join it before compiling."""
    if not threads:
        return None
    thread = threading.Thread(target=_prewarm, args=(device,), name="nanovllm-prewarm",
                              daemon=True)
    thread.start()
    return thread


def _prewarm(device: torch.device) -> None:
    try:
        import triton
        from triton.runtime import driver
        # a thread starts on device 0: a rank of another GPU would open a context there
        torch.cuda.set_device(device)
        try:
            from triton.runtime.cache import triton_key
        except ImportError:  # older Triton
            from triton.compiler.compiler import triton_key
        triton.compiler.make_backend(driver.active.get_current_target()).hash()
        triton_key()
    except Exception:  # the first compile redoes this work and raises what it raises
        logger.debug("compiler prewarm failed", exc_info=True)

"""Compile ahead, in parallel: start-up runs a batch of steps once with every Triton launch
compiling its kernel on a thread pool instead of running it, then runs them for real.

A launch compiles its kernel variant before it runs, so a serial warm-up compiles one variant
at a time. Triton's AsyncCompileMode (triton.runtime._async_compile) hands each compile to an
executor, but a launch still waits for its own kernel (JITFunction.run, Triton 3.6:
`kernel = kernel.result()` before `kernel.run(...)`); only a warmup launch (`warmup=True`:
compile, run nothing) returns at once. So the compile-only pass turns every launch into a
warmup launch, and AsyncCompileMode's exit waits for all compiles and puts each kernel in its
JIT cache. Threads are enough: Triton releases the GIL in its MLIR and LLVM passes, and ptxas
is a subprocess.

In that pass no kernel writes its outputs, so a step must not branch on them on the host:
start-up's steps (warm-up, fused-limit calibration, graph capture) only copy sampled ids back,
and size every tensor from shapes. Variants depend on shapes, dtypes, pointer alignment and
constexprs, never on values, so the pass reaches the ones the real pass runs (checked under
the interpreter by tests/runner/test_warmup_variants.py); the real pass compiles any it missed.
Triton is imported when called: CPU-only installs may lack it.
"""
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar

import torch

ENV = "NANOVLLM_PARALLEL_COMPILE"  # "0": compile serially, as kernels launch (A/B runs)
MAX_THREADS = 32  # a pass has a few dozen variants at most

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


def compile_in_parallel(steps: Iterable[Callable[[], object]], threads: int,
                        kernel_type: type | None = None) -> None:
    """Run each step with its Triton launches (of kernel_type, default JITFunction) compiling
    on `threads` threads and running nothing; return once all compiled (errors raise here)."""
    import triton
    from triton.runtime import _async_compile
    from triton.runtime.jit import JITFunction
    # The RNG states are restored: the sampler seeds its kernel from torch's CPU generator, and
    # a start-up with the pass must leave it as one without does.
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with (torch.random.fork_rng(devices),
          ThreadPoolExecutor(threads, thread_name_prefix="nanovllm-compile") as pool):
        mode = triton.AsyncCompileMode(pool)
        try:
            with mode, launches_compile_only(kernel_type or JITFunction):
                for step in steps:
                    step()
                # read before the exit: newer Triton empties the record there
                compiles = list(getattr(mode, "future_kernels", {}).values())
        finally:
            # Triton 3.6's exit deactivates the mode only once every compile succeeded: after
            # an error this thread's launches would otherwise keep queueing compiles.
            if _async_compile.active_mode.get() is mode:
                _async_compile.active_mode.set(None)
        build_launchers([future.result() for future in compiles], pool)


def build_launchers(kernels: Iterable[object], pool: ThreadPoolExecutor) -> None:
    """Build each compiled kernel's launcher on the pool, where its first launch would build
    it on this thread: Triton 3.6 compiles a C launcher per kernel signature with gcc (~0.3 s
    each, a quarter of a cold start-up serially) and caches it in TRITON_CACHE_DIR, where the
    launch then finds it. Newer Triton's launchers build nothing: this costs nothing there."""
    todo = [k for k in kernels if getattr(k, "module", None) is None and hasattr(k, "src")]
    if not todo:  # (the driver is looked up only for real kernels: CPU tests have none)
        return
    from triton.runtime import driver
    make = driver.active.launcher_cls
    list(pool.map(lambda k: make(k.src, k.metadata), todo))  # errors raise here

"""kernels.compile_workers: a forked worker compiles a real kernel variant (for sm_90, without a
GPU) from Triton's own compile closure, and the pool thread's compile then reads it from the
file cache: the same key in both processes, so the code generator runs once."""
import json
import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from nanovllm.kernels import compile_ahead  # noqa: E402
from nanovllm.kernels.compile_workers import _CLOSURE, CompileWorkers, task_of  # noqa: E402

# A compile-only pass of two real kernels (RMSNorm alone and after a residual add) on CPU
# tensors, Triton's driver replaced by one that names an sm_90 target and loads nothing; with
# workers or on threads alone. It prints what Triton's compile listener saw in this process.
_PASS = """
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

class Driver:  # what a compile-only launch asks of the driver
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def launcher_cls(self, src, metadata): pass
driver.set_active(Driver())

from nanovllm.kernels import compile_ahead
from nanovllm.kernels.compile_workers import CompileWorkers
from nanovllm.kernels.fused_ops import _rms_norm_kernel, add_rms_norm, rms_norm

workers = CompileWorkers(2) if sys.argv[1] == "workers" else None
if len(sys.argv) > 2:  # keyed here unlike a fresh process (Triton 3.6: its callees' order)
    _rms_norm_kernel.hash = _rms_norm_kernel.cache_key + "+callees keyed in another order"
compile_ahead.load = lambda kernel: None  # a GPU machine would load it (not on this driver)
hits = []
triton.knobs.compilation.listener = lambda cache_hit, **_: hits.append(cache_hit)
x, r = torch.randn(2, 4, 256, dtype=torch.bfloat16)
w = torch.randn(256, dtype=torch.bfloat16)
steps = [lambda: rms_norm(x, w, 1e-6), lambda: add_rms_norm(x, r, w, 1e-6)]
compile_ahead.compile_in_parallel(steps, 2, workers=workers)
twice = workers.compiled_twice if workers else []
if workers:
    workers.close()
print(json.dumps({"hits": sorted(hits), "twice": twice}))
"""


def _compile_pass(how: str, cache_dir: str, *rekey: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": cache_dir, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", _PASS, how, *rekey], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_thread_reads_what_the_worker_compiled(tmp_path) -> None:
    """With workers, both of this process's compiles are file-cache hits (the worker ran the
    code generator under the same key); on threads alone, both are misses."""
    assert _compile_pass("workers", str(tmp_path / "a")) == {"hits": [True, True], "twice": []}
    assert _compile_pass("threads", str(tmp_path / "b")) == {"hits": [False, False],
                                                              "twice": []}


def test_a_worker_takes_this_processs_key(tmp_path) -> None:
    """A kernel whose key here differs from what the worker would derive (Triton 3.6 hashes a
    kernel's callees' globals by the order their keys were computed) still compiles once:
    the task carries this process's key."""
    assert _compile_pass("workers", str(tmp_path), "rekey") == {"hits": [True, True],
                                                                "twice": []}


def test_tasks_come_from_tritons_own_compile_closure() -> None:
    """The closure JITFunction._do_compile hands AsyncCompileMode holds what a task is made
    of (a Triton that renames it compiles on threads: task_of returns None)."""
    closures = [c for c in JITFunction._do_compile.__code__.co_consts
                if getattr(c, "co_name", "") == "async_compile"]
    assert len(closures) == 1 and set(_CLOSURE) <= set(closures[0].co_freevars)
    assert task_of(lambda: None) is None


def test_a_task_a_worker_cannot_compile_is_left_to_the_thread() -> None:
    """A task that fails in the worker returns None (the thread compiles and raises what
    Triton raises), and the worker serves the next task."""
    workers = CompileWorkers(1)
    try:
        assert workers.compile(b"not a task") is None
        assert workers.compile(b"nor this") is None
        workers.check(object(), None)
        assert workers.compiled_twice == []
    finally:
        workers.close()


def test_workers_start_only_with_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(compile_ahead.ENV, raising=False)
    assert compile_ahead.start_workers(0) is None
    monkeypatch.setenv(compile_ahead.ENV, "threads")
    assert compile_ahead.start_workers(4) is None
    monkeypatch.delenv(compile_ahead.ENV)
    workers = compile_ahead.start_workers(2)
    try:
        assert isinstance(workers, CompileWorkers) and workers.idle.qsize() == 2
    finally:
        workers.close()


def test_a_failed_fork_leaves_the_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    def fork():
        raise BlockingIOError("Resource temporarily unavailable")
    monkeypatch.delenv(compile_ahead.ENV, raising=False)
    monkeypatch.setattr(os, "fork", fork)
    assert compile_ahead.start_workers(2) is None

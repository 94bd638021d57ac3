"""kernels.compile_ahead: launches that only compile (on this thread, while the context lasts),
compiles that overlap on the pool under Triton's own AsyncCompileMode, and the guard.

Triton's JITFunction needs a GPU driver to launch anything, so the kernels here are stand-ins
that do what JITFunction.run does with `warmup` (Triton 3.6, runtime/jit.py): a warmup launch
under AsyncCompileMode submits its compile and returns the future; any other launch runs.
The warm-up's own steps under a compile-only pass are tested in
tests/runner/test_warmup_variants.py."""
import contextlib
import inspect
import os
import threading

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402
import triton  # noqa: E402
from triton.runtime import _async_compile  # noqa: E402

from nanovllm.kernels import compile_ahead  # noqa: E402
from nanovllm.kernels.compile_ahead import (  # noqa: E402
    compile_in_parallel,
    compile_threads,
    launches_compile_only,
    start_prewarm,
)


class Kernel:
    """Records each launch's `warmup`; a warmup launch under AsyncCompileMode submits
    `compile_fn` and, once finalized, files its result in `compiled`."""

    launches: list[bool] = []
    compiled: dict[str, object] = {}

    def __init__(self, name: str, compile_fn=lambda: "binary") -> None:
        self.name, self.compile_fn = name, compile_fn

    def run(self, *args, grid, warmup, **kwargs):
        Kernel.launches.append(warmup)
        mode = _async_compile.active_mode.get()
        if warmup and mode is not None:
            # triton 3.9 added cleanup_fn (called with the future of a compile that failed)
            cleanup = (lambda future: None,) * ("cleanup_fn" in inspect.signature(
                mode.submit).parameters)
            return mode.submit(self.name, self.compile_fn,
                               lambda binary: Kernel.compiled.__setitem__(self.name, binary),
                               *cleanup)
        return None

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)


@pytest.fixture(autouse=True)
def _fresh_records() -> None:
    Kernel.launches, Kernel.compiled = [], {}


def test_launches_only_compile_inside_the_context() -> None:
    run = Kernel.__dict__["run"]
    kernel = Kernel("k")
    with launches_compile_only(Kernel):
        kernel[(1,)](1, 2)
        kernel.run(grid=(1,), warmup=True)  # a launch that was a warmup stays one
    kernel[(1,)](1, 2)
    assert Kernel.launches == [True, True, False]
    assert Kernel.__dict__["run"] is run


def test_another_threads_launches_run() -> None:
    """The switch is the entering thread's: a launch from another thread meanwhile runs."""
    kernel = Kernel("k")
    with launches_compile_only(Kernel):
        other = threading.Thread(target=lambda: kernel[(1,)]())
        other.start()
        other.join()
        kernel[(1,)]()
    assert Kernel.launches == [False, True]


def test_a_failing_step_restores_launches() -> None:
    run = Kernel.__dict__["run"]
    with pytest.raises(ZeroDivisionError), launches_compile_only(Kernel):
        Kernel("k")[(1,)]()
        _ = 1 / 0
    assert Kernel.__dict__["run"] is run
    Kernel("k")[(1,)]()
    assert Kernel.launches == [True, False]


def _meeting(parties: int):
    """A compile that returns only once `parties` compiles run at the same time."""
    barrier = threading.Barrier(parties, timeout=2)

    def compile_fn() -> str:
        barrier.wait()
        return "binary"
    return compile_fn


def test_compiles_overlap_and_finish_before_return() -> None:
    """Two kernels' compiles run at once on two threads (each waits for the other), and both
    are finalized when compile_in_parallel returns; nothing ran."""
    meet = _meeting(2)
    kernels = [Kernel("a", meet), Kernel("b", meet)]
    compile_in_parallel([lambda k=k: k[(1,)]() for k in kernels], 2, kernel_type=Kernel)
    assert Kernel.compiled == {"a": "binary", "b": "binary"}
    assert Kernel.launches == [True, True]


def test_a_compile_error_raises_on_return() -> None:
    """On one thread the two compiles cannot meet: the first one's error surfaces, and the
    mode is off afterwards (Triton 3.6 leaves it on after a failed compile)."""
    meet = _meeting(2)
    kernels = [Kernel("a", meet), Kernel("b", meet)]
    with pytest.raises(threading.BrokenBarrierError):
        compile_in_parallel([lambda k=k: k[(1,)]() for k in kernels], 1, kernel_type=Kernel)
    assert Kernel.compiled == {} and _async_compile.active_mode.get() is None


def test_one_compile_per_variant() -> None:
    """A variant launched twice in a pass compiles once (AsyncCompileMode keys by variant)."""
    calls = []
    kernel = Kernel("a", lambda: calls.append(1) or "binary")
    compile_in_parallel([lambda: kernel[(1,)](), lambda: kernel[(2,)]()], 2, kernel_type=Kernel)
    assert calls == [1] and Kernel.compiled == {"a": "binary"}


def test_the_pass_leaves_the_rng_as_it_found_it() -> None:
    """A step's draws from torch's generator (the sampler seeds its kernel from it) are undone:
    start-up samples alike with and without the pass."""
    torch.manual_seed(0)
    expected = torch.randint(2**31 - 1, (1,))
    torch.manual_seed(0)
    compile_in_parallel([lambda: torch.randint(2**31 - 1, (4,))], 2, kernel_type=Kernel)
    assert torch.equal(torch.randint(2**31 - 1, (1,)), expected)


def test_compile_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads per rank on CUDA (at most MAX_THREADS; 0 below 2); 0 off CUDA, under the
    interpreter, with NANOVLLM_PARALLEL_COMPILE=0, and without AsyncCompileMode."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(compile_ahead.ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert compile_threads("cuda", 1) == 16
    assert compile_threads("cuda", 4) == 4
    assert compile_threads("cuda", 8) == 2
    assert compile_threads("cuda", 16) == 0  # one thread a rank: no pool
    assert compile_threads("cpu", 1) == 0
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(128)), raising=False)
    assert compile_threads("cuda", 1) == compile_ahead.MAX_THREADS
    monkeypatch.setenv(compile_ahead.ENV, "0")
    assert compile_threads("cuda", 1) == 0
    monkeypatch.setenv(compile_ahead.ENV, "1")
    for interpret in ("1", "true"):  # Triton's own reading of it
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        assert compile_threads("cuda", 1) == 0
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.delattr(triton, "AsyncCompileMode")
    assert compile_threads("cuda", 1) == 0


class Compiled:
    """A stand-in CompiledKernel: its source and metadata, no module loaded yet."""

    def __init__(self, src: str, module: object = None) -> None:
        self.src, self.metadata, self.module = src, {"name": src}, module


class Launchers:
    """A stand-in driver whose launcher_cls records what it built, optionally meeting others."""

    def __init__(self, parties: int = 0, fail: str = "") -> None:
        self.built: list[str] = []
        self.barrier = threading.Barrier(parties, timeout=2) if parties else None
        self.fail = fail
        self.built_one = threading.Event()

    def launcher_cls(self, src: str, metadata: dict) -> str:
        if src == self.fail:
            raise RuntimeError(f"gcc failed on {src}")
        if self.barrier:
            self.barrier.wait()
        self.built.append(metadata["name"])
        self.built_one.set()
        return "launcher"


def _compiled_by(kernels: list[Kernel], launchers: Launchers, threads: int,
                 monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.runtime import driver
    monkeypatch.setattr(driver, "_active", launchers)
    compile_in_parallel([lambda k=k: k[(1,)]() for k in kernels], threads, kernel_type=Kernel)


def test_launchers_build_on_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each compiled kernel's launcher is built before compile_in_parallel returns, two at once
    (each build waits for the other); a kernel already loaded is left alone."""
    launchers = Launchers(parties=2)
    kernels = [Kernel("a", lambda: Compiled("a")), Kernel("b", lambda: Compiled("b")),
               Kernel("c", lambda: Compiled("c", module="loaded"))]
    _compiled_by(kernels, launchers, 2, monkeypatch)
    assert sorted(launchers.built) == ["a", "b"]


def test_a_launcher_builds_while_other_kernels_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread that compiled a kernel builds its launcher at once: here b's compile ends only
    once a's launcher is built, which a build after the last compile would never see."""
    launchers = Launchers()

    def compile_b() -> Compiled:
        assert launchers.built_one.wait(timeout=2), "a's launcher waited for b's compile"
        return Compiled("b")
    kernels = [Kernel("a", lambda: Compiled("a")), Kernel("b", compile_b)]
    _compiled_by(kernels, launchers, 2, monkeypatch)
    assert launchers.built == ["a", "b"]


def test_prewarm_runs_on_a_thread_only_with_compile_threads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With compile threads, the prewarm selects the rank's GPU on its own thread (else a
    rank of another GPU opens a context on GPU 0), then looks up the driver's target (a
    failure there is left to the first compile); without, nothing starts."""
    from triton.runtime import driver
    seen = []

    class Driver:
        def get_current_target(self):
            seen.append(threading.current_thread().name)
            raise RuntimeError("no GPU here")
    monkeypatch.setattr(driver, "_active", Driver())
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: seen.append(device))
    gpu = torch.device("cuda:1")
    assert start_prewarm(0, gpu) is None
    thread = start_prewarm(4, gpu)
    thread.join(timeout=5)
    assert seen == [gpu, "nanovllm-prewarm"] and not thread.is_alive()


def test_a_launcher_error_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    kernels = [Kernel("a", lambda: Compiled("a")), Kernel("b", lambda: Compiled("b"))]
    with pytest.raises(RuntimeError, match="gcc failed on b"):
        _compiled_by(kernels, Launchers(fail="b"), 2, monkeypatch)


class Loadable(Compiled):
    """A stand-in CompiledKernel with Triton's loader (_init_handles), recording the device
    current on the thread that loads it."""

    def __init__(self, src: str, devices: list) -> None:
        super().__init__(src)
        self.devices = devices

    def _init_handles(self) -> None:
        self.devices.append((self.src, torch.cuda.current_device()))


def test_a_kernel_loads_on_the_pool_on_the_callers_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With CUDA up, each pool thread loads the kernel it compiled (module and launcher), on
    the device current where compile_in_parallel was called, so a graph's capture needs no
    eager run to load it; without, only the launcher is built (the loader is left alone)."""
    loads, launchers = [], Launchers()
    current = {"device": 0}  # per thread: a pool thread starts on device 0, as CUDA's do
    state = threading.local()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device",
                        lambda: getattr(state, "device", current["device"]))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: setattr(state, "device", d))
    monkeypatch.setattr(torch.random, "fork_rng", lambda devices: contextlib.nullcontext())
    state.device = 3  # the runner's device, on this thread only
    _compiled_by([Kernel("a", lambda: Loadable("a", loads)),
                  Kernel("b", lambda: Loadable("b", loads))], launchers, 2, monkeypatch)
    assert sorted(loads) == [("a", 3), ("b", 3)] and launchers.built == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    compile_ahead.load(Loadable("c", loads))
    assert launchers.built == ["c"] and len(loads) == 2


"""Where a cold start-up's time goes: each start-up phase's burst of Triton compiles, and the
rest (loading, the steps themselves, the graphs). `python -m benchmarks.cold_compiles --profile`.

A compile is timed by Triton's compile listener (triton.knobs.compilation.listener: its stage
times, reported as it ends) or, in a compile worker (kernels.compile_workers), by wrapping
CompileWorkers.compile (the task's round trip; the thread's read from the file cache after it
is a cache hit, left out); its load by wrapping kernels.compile_ahead's load (the launcher's
build, gcc on Triton 3.6, and the module's load onto the GPU, right after the compile on the
same thread); a phase by ModelRunner._timed. Compiles run on start-up's threads, so a burst
spans from its first compile's start to the end of its last compile or load, not their summed
time.
"""
import threading
import time
from typing import NamedTuple


class Compile(NamedTuple):
    start: float
    end: float
    kernel: str


class Phase(NamedTuple):
    name: str
    start: float
    end: float


class BurstRow(NamedTuple):
    """One phase: its seconds, its compiles, and when its burst starts and ends within it."""

    phase: str
    wall_s: float
    variants: int
    first_start_s: float  # from the phase's start; 0 without compiles
    last_end_s: float  # the last compile's or load's end

    @property
    def span_s(self) -> float:
        return self.last_end_s - self.first_start_s


def burst_rows(phases: list[Phase], compiles: list[Compile],
               loads: list[Compile] | None = None) -> list[BurstRow]:
    """A row per phase, with the compiles and loads that ended inside it."""
    rows = []
    for phase in phases:
        own = [c for c in compiles if phase.start <= c.end <= phase.end]
        work = own + [b for b in loads or () if phase.start <= b.end <= phase.end]
        first = min((c.start for c in work), default=phase.start) - phase.start
        last = max((c.end for c in work), default=phase.start) - phase.start
        rows.append(BurstRow(phase.name, phase.end - phase.start, len(own), first, last))
    return rows


def burst_table(rows: list[BurstRow], outside: int, total_s: float) -> str:
    """The rows as a markdown table, the bursts' total against total_s (LLM()'s seconds), and
    how many compiles ended outside every phase (0 expected)."""
    lines = ["| phase | s | variants | burst starts | burst ends | burst s |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r.phase} | {r.wall_s:.2f} | {r.variants} | +{r.first_start_s:.2f} | "
              f"+{r.last_end_s:.2f} | {r.span_s:.2f} |" for r in rows]
    bursts = sum(r.span_s for r in rows)
    lines.append(f"compile bursts {bursts:.2f} s of LLM()'s {total_s:.2f} s (the rest "
                 f"{total_s - bursts:.2f} s); compiles outside the phases: {outside}")
    return "\n".join(lines)


class BurstRecorder:
    """Records the compiles (cache hits left out) and start-up's phases of this process."""

    def __init__(self) -> None:
        self.compiles: list[Compile] = []
        self.loads: list[Compile] = []  # compile_ahead.load's calls
        self.phases: list[Phase] = []
        self._lock = threading.Lock()

    def install(self) -> None:
        """Listen to Triton's compiles, time the workers' compiles, the kernels' loads and
        ModelRunner's phases (before LLM())."""
        from triton import knobs

        from nanovllm.kernels import compile_ahead
        from nanovllm.kernels.compile_workers import CompileWorkers
        from nanovllm.runner.model_runner import ModelRunner
        if not hasattr(knobs, "compilation") or not hasattr(knobs.compilation, "listener"):
            raise SystemExit("--profile needs Triton's compile listener (Triton 3.4 or newer)")
        knobs.compilation.listener = self.listen
        load = compile_ahead.load  # looked up at each call: the wrapper is seen

        def timed_load(kernel) -> None:
            start = time.perf_counter()
            load(kernel)
            with self._lock:
                self.loads.append(Compile(start, time.perf_counter(), "load"))
        compile_ahead.load = timed_load
        in_worker = CompileWorkers.compile

        def timed_compile(workers, task: bytes):
            start = time.perf_counter()
            hashes = in_worker(workers, task)
            if hashes is not None:  # else the thread compiles it, and the listener times that
                with self._lock:
                    self.compiles.append(Compile(start, time.perf_counter(), "worker"))
            return hashes
        CompileWorkers.compile = timed_compile
        timed = ModelRunner._timed

        def timed_phase(runner, phase: str, run, *args) -> None:
            start = time.perf_counter()
            try:
                timed(runner, phase, run, *args)
            finally:
                self.phases.append(Phase(phase, start, time.perf_counter()))
        ModelRunner._timed = timed_phase

    def listen(self, *, src=None, times=None, cache_hit: bool = False, **_) -> None:
        """Triton's listener: called on the compiling thread as a compile ends."""
        if cache_hit or times is None:
            return
        end = time.perf_counter()
        kernel = getattr(getattr(src, "fn", None), "__name__", "?")
        with self._lock:
            self.compiles.append(Compile(end - times.total / 1e6, end, kernel))

    def table(self, total_s: float) -> str:
        """burst_table of what was recorded, against LLM()'s total_s seconds."""
        rows = burst_rows(self.phases, self.compiles, self.loads)
        outside = len(self.compiles) - sum(r.variants for r in rows)
        return burst_table(rows, outside, total_s)

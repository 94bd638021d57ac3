"""benchmarks.compile_bursts: compiles and kernel loads grouped by the start-up phase they
end in, each burst from its first compile's start to the last end; the listener skips cache
hits."""
from types import SimpleNamespace

from pytest import approx

from benchmarks.compile_bursts import (
    BurstRecorder,
    Compile,
    Phase,
    burst_rows,
    burst_table,
)


def test_bursts_by_phase() -> None:
    phases = [Phase("warmup", 10.0, 12.0), Phase("calibrate", 12.5, 14.0),
              Phase("capture", 15.0, 18.0)]
    compiles = [Compile(10.5, 11.5, "a"), Compile(10.6, 11.8, "b"),  # overlapping threads
                Compile(15.2, 16.0, "c"), Compile(19.0, 19.5, "late")]
    loads = [Compile(11.8, 12.0, "load")]  # after the last compile, on its thread
    rows = burst_rows(phases, compiles, loads)
    assert [(r.phase, r.variants) for r in rows] == [("warmup", 2), ("calibrate", 0),
                                                     ("capture", 1)]
    warmup, calibrate, capture = rows
    assert (warmup.first_start_s, warmup.last_end_s, warmup.span_s) == approx((0.5, 2.0, 1.5))
    assert calibrate.span_s == 0.0 and (capture.span_s, capture.wall_s) == approx((0.8, 3.0))
    table = burst_table(rows, outside=1, total_s=9.0)
    assert "| warmup | 2.00 | 2 | +0.50 | +2.00 | 1.50 |" in table
    assert "compile bursts 2.30 s of LLM()'s 9.00 s (the rest 6.70 s)" in table
    assert table.endswith("compiles outside the phases: 1")


def test_the_listener_records_compiles_not_cache_hits() -> None:
    recorder = BurstRecorder()
    src = SimpleNamespace(fn=SimpleNamespace(__name__="_rms_norm_kernel"))
    recorder.listen(src=src, times=SimpleNamespace(total=250_000), cache_hit=False,
                    metadata=None)
    recorder.listen(src=src, times=SimpleNamespace(total=1_000), cache_hit=True)
    [compile_] = recorder.compiles
    assert compile_.kernel == "_rms_norm_kernel"
    assert compile_.end - compile_.start == approx(0.25)
    recorder.phases.append(Phase("warmup", compile_.start - 1, compile_.end + 1))
    assert "| warmup | 2.25 | 1 | +1.00 | +1.25 | 0.25 |" in recorder.table(3.0)


def test_install_times_the_loads(monkeypatch) -> None:
    """Installed, the recorder times each compile_ahead.load call made where start-up makes it
    (the compiling thread, through the module's name), each compile a worker made (not one it
    failed), and listens to Triton's compiles."""
    from triton import knobs

    from nanovllm.kernels import compile_ahead
    from nanovllm.kernels.compile_workers import CompileWorkers
    from nanovllm.runner.model_runner import ModelRunner
    monkeypatch.setattr(CompileWorkers, "compile",
                        lambda self, task: None if task == b"bad" else ("h", "s", "f"))
    for owner, name in ((compile_ahead, "load"), (ModelRunner, "_timed"),
                        (knobs.compilation, "listener")):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored after the test
    recorder = BurstRecorder()
    recorder.install()
    assert knobs.compilation.listener == recorder.listen
    assert compile_ahead._compile_then_load(lambda: "binary", (), {}) == "binary"
    [build] = recorder.loads
    assert build.kernel == "load" and build.end >= build.start
    workers = object.__new__(CompileWorkers)
    assert workers.compile(b"task") == ("h", "s", "f") and workers.compile(b"bad") is None
    [compiled] = recorder.compiles
    assert compiled.kernel == "worker" and compiled.end >= compiled.start

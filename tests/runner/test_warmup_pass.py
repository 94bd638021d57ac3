"""runner.warmup.warm_up_kernels: with compile threads, one compile-only pass takes the warm-up's
steps and the steps start-up runs after them (the graphs' forwards: one burst of compiles, not
two); only the warm-up's own steps then run for real."""
from types import SimpleNamespace

import pytest

from nanovllm.runner import warmup


@pytest.mark.parametrize("threads", [0, 2])
def test_one_pass_compiles_the_warm_up_and_the_graphs(monkeypatch: pytest.MonkeyPatch,
                                                      threads: int) -> None:
    ran, passes = [], []
    monkeypatch.setattr(warmup, "warm_up_steps", lambda runner, graph_sizes: [
        lambda: ran.append("prefill"), lambda: ran.append("decode")])

    def compile_pass(steps, count, workers=None):
        passes.append((count, workers))
        for step in steps:
            step()
    monkeypatch.setattr(warmup, "compile_in_parallel", compile_pass)
    runner = SimpleNamespace(compile_threads=threads, compile_workers="workers")
    warmup.warm_up_kernels(runner, [1, 2], [lambda: ran.append("graph")])
    if threads:
        assert passes == [(2, "workers")]
        assert ran == ["prefill", "decode", "graph", "prefill", "decode"]
    else:  # no pass: the graphs compile as they are captured
        assert passes == [] and ran == ["prefill", "decode"]

"""keep_caches: a run of CUDA graph captures flushes the allocator's caches once, not per
capture (torch.cuda.graph's __enter__ looks both flushes up at call time)."""
import inspect

import pytest
import torch

from nanovllm.utils.graph_capture import keep_caches


def test_graph_entry_flushes_through_the_patched_names():
    """The patch has teeth only while torch.cuda.graph calls the flushes by attribute."""
    src = inspect.getsource(torch.cuda.graphs.graph.__enter__)
    assert "torch.cuda.empty_cache()" in src
    assert hasattr(torch._C, "_host_emptyCache") == ("torch._C._host_emptyCache()" in src)


def test_flushes_are_kept_inside_and_restored_after(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("device"))
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("host"),
                        raising=False)
    with keep_caches():
        for _ in range(3):  # as three captures' entries would
            torch.cuda.empty_cache()
            torch._C._host_emptyCache()
    assert calls == ["device"]  # the one flush before the run
    torch.cuda.empty_cache()
    torch._C._host_emptyCache()
    assert calls == ["device", "device", "host"]


def test_restored_when_a_capture_fails(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("device"))
    with pytest.raises(RuntimeError), keep_caches():
        raise RuntimeError("capture failed")
    torch.cuda.empty_cache()
    assert calls == ["device", "device"]

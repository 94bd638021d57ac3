"""layers.backend_names: what 'auto' and the explicit backend names resolve to."""
import importlib.util
import logging

import pytest
import torch

from nanovllm.layers import backend_names as backends
from nanovllm.layers.backend_names import resolve_attention_backend


@pytest.mark.parametrize("has_flash", [False, True])
@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_auto_picks_triton_on_cuda(monkeypatch, caplog, has_flash, kv, dtype) -> None:
    """'auto' is Triton on CUDA whether or not flash-attn is importable, and says why."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(backends.importlib.util, "find_spec",
                        lambda name: object() if name == "flash_attn" and has_flash
                        else find_spec(name))
    with caplog.at_level(logging.INFO, logger=backends.__name__):
        assert resolve_attention_backend("auto", "cuda", dtype, kv) == "triton"
    picks = [r.getMessage() for r in caplog.records if "attention_backend='auto'" in r.message]
    assert len(picks) == 1 and "'triton'" in picks[0] and "fastest" in picks[0]


def test_auto_picks_torch_on_cpu(caplog) -> None:
    with caplog.at_level(logging.INFO, logger=backends.__name__):
        assert resolve_attention_backend("auto", "cpu", torch.float32) == "torch"
    assert any("-> 'torch'" in r.getMessage() for r in caplog.records)


def test_explicit_names_keep_their_meaning(monkeypatch) -> None:
    """An explicit name runs that backend or fails naming why; 'auto' never changes it."""
    assert resolve_attention_backend("triton", "cuda", torch.bfloat16) == "triton"
    assert resolve_attention_backend("torch", "cuda", torch.bfloat16) == "torch"
    monkeypatch.setattr(backends.importlib.util, "find_spec", lambda name: object())
    assert resolve_attention_backend("flash-attn", "cuda", torch.bfloat16) == "flash-attn"
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        resolve_attention_backend("flash-attn", "cuda", torch.float32)
    with pytest.raises(ValueError, match="fp8"):
        resolve_attention_backend("flash-attn", "cuda", torch.bfloat16, "fp8")
    monkeypatch.setattr(backends.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="pip install"):
        resolve_attention_backend("flash-attn", "cuda", torch.bfloat16)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs device='cuda'"):
        resolve_attention_backend("triton", "cpu", torch.float32)

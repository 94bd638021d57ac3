"""The start-up check that a float32 model on CUDA really runs its matmuls in float32."""
import logging

import torch

from nanovllm.utils.precision import check_float32_matmuls


def test_tf32_matmul_flag_is_reported(monkeypatch, caplog):
    """Needs no GPU: the check only reads torch's process-wide flag."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    assert check_float32_matmuls("cuda", torch.float32)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    with caplog.at_level(logging.WARNING):
        assert not check_float32_matmuls("cuda", torch.float32)
    assert "allow_tf32" in caplog.text
    assert check_float32_matmuls("cuda", torch.bfloat16)
    assert check_float32_matmuls("cpu", torch.float32)

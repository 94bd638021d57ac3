"""The start-up check that a float32 model on CUDA really runs its matmuls in float32. It needs
no GPU: the check only reads torch's process-wide flags."""
import contextlib
import logging

import pytest
import torch

from nanovllm.utils.precision import check_float32_matmuls, tf32_matmuls

MATMUL = torch.backends.cuda.matmul


@contextlib.contextmanager
def restored_flags():
    """Put torch's TF32 flags back as they were, through the API that reads them cleanly.
    (pytest's monkeypatch cannot: the flags are computed attributes of a module object.)"""
    saved = torch.backends.fp32_precision, MATMUL.fp32_precision
    try:
        yield
    finally:
        torch.backends.fp32_precision, MATMUL.fp32_precision = saved


def set_tf32(enabled: bool) -> None:
    """As a user of the installed torch would: its current API."""
    MATMUL.fp32_precision = "tf32" if enabled else "ieee"


def test_tf32_matmul_flag_is_reported(caplog):
    with restored_flags():
        set_tf32(False)
        assert check_float32_matmuls("cuda", torch.float32)
        set_tf32(True)
        with caplog.at_level(logging.WARNING):
            assert not check_float32_matmuls("cuda", torch.float32)
        assert "TF32 matmuls enabled" in caplog.text
        assert check_float32_matmuls("cuda", torch.bfloat16)
        assert check_float32_matmuls("cpu", torch.float32)
        set_tf32(False)
        assert check_float32_matmuls("cuda", torch.float32)


@pytest.mark.parametrize("precision", ["high", "medium"])
def test_set_float32_matmul_precision_is_reported(precision):
    with restored_flags():
        torch.set_float32_matmul_precision(precision)
        assert not check_float32_matmuls("cuda", torch.float32)
        torch.set_float32_matmul_precision("highest")
        assert check_float32_matmuls("cuda", torch.float32)


def test_the_generic_fp32_precision_is_inherited():
    """matmul's "none" means: as torch.backends.fp32_precision says."""
    with restored_flags():
        torch.backends.fp32_precision = "tf32"
        MATMUL.fp32_precision = "none"
        assert tf32_matmuls()
        torch.backends.fp32_precision = "ieee"
        assert not tf32_matmuls()


def test_the_flags_restore_cleanly():
    """The tests above leave torch as they found it: the legacy view still reads."""
    before = tf32_matmuls()
    with restored_flags():
        set_tf32(not before)
    assert tf32_matmuls() == before
    assert MATMUL.allow_tf32 == before
    assert torch.get_float32_matmul_precision() == ("high" if before else "highest")


class NewTorchFlags:
    """torch 2.9+'s flag object once fp32_precision was set: the legacy view raises."""

    def __init__(self, fp32_precision: str):
        self.fp32_precision = fp32_precision

    @property
    def allow_tf32(self):
        raise RuntimeError("you have used mix of the legacy and new APIs to set the TF32 status")


@pytest.mark.parametrize("flags, tf32", [
    (NewTorchFlags("tf32"), True),
    (NewTorchFlags("ieee"), False),
    (NewTorchFlags("none"), False),  # the getter resolves "none"; unresolved it is the default
])
def test_torch_flags(flags, tf32):
    assert tf32_matmuls(flags) is tf32
    assert check_float32_matmuls("cuda", torch.float32, flags) is not tf32

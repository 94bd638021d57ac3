"""Which attention backend a run uses: the name Config resolves once (step 1 of backends.py)."""
import importlib.util
import logging
import os

import torch

from nanovllm.utils.field_checks import check

logger = logging.getLogger(__name__)
BACKENDS = ("flash-attn", "triton", "torch")


def check_backend_name(name: object) -> None:
    """A ValueError unless `name` is 'auto' or one of BACKENDS: checked before anything loads,
    wherever the backend is resolved later (data parallelism: in each replica)."""
    check("attention_backend", name, isinstance(name, str) and name in ("auto", *BACKENDS),
          f"one of {['auto', *BACKENDS]}")


def _resolve_auto(device: str) -> str:
    """'auto': triton on CUDA (the fastest measured), torch elsewhere; logs the pick and why."""
    if device != "cuda":
        logger.info("attention_backend='auto' -> 'torch': no CUDA device (the reference path)")
        return "torch"
    # Triton for prefill too: one backend keeps one K/V read path (cached prefixes, FP8), and
    # prefill is a small share of a step mix's time, where the decode gain decides.
    logger.info("attention_backend='auto' -> 'triton': the fastest measured on the H200 "
                "(standard workload, aff7a6c: 27,504 tok/s against flash-attn's 25,260)")
    return "triton"


def resolve_attention_backend(name: str, device: str, dtype: torch.dtype,
                              kv_cache_dtype: str = "auto") -> str:
    """The backend `name` resolves to, or an error naming why it cannot run (Config, once)."""
    # name is 'auto' or in BACKENDS (Config checked it before reading the model).
    if name == "flash-attn" and kv_cache_dtype == "fp8":
        raise ValueError("attention_backend='flash-attn' cannot read kv_cache_dtype='fp8' (the "
                         "installed flash-attn ignores FP8 descale factors): use 'triton' or "
                         "'auto'")
    if name == "auto":
        return _resolve_auto(device)
    has_flash = importlib.util.find_spec("flash_attn") is not None
    half = dtype in (torch.float16, torch.bfloat16)  # FlashAttention has no float32 kernels
    if name == "flash-attn" and not has_flash:
        raise ImportError("attention_backend='flash-attn' needs flash-attn: "
                          "pip install 'nanovllm[flash]'")
    if name == "flash-attn" and not half:
        raise ValueError(f"attention_backend='flash-attn' needs float16 or bfloat16, not {dtype}")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # Triton on CPU, for tests
    if device != "cuda" and not (name == "torch" or name == "triton" and interpreted):
        raise ValueError(f"attention_backend={name!r} needs device='cuda'")
    return name

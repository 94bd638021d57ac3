"""Whether a float32 run on CUDA computes in float32: the one check of torch's TF32 flags."""
import logging

import torch

logger = logging.getLogger(__name__)


def tf32_matmuls(matmul=None) -> bool:
    """Whether cuBLAS would run float32 matmuls in TF32. `matmul` is torch's flag object,
    torch.backends.cuda.matmul (a stand-in in tests).

    torch 2.9+ sets this with `matmul.fp32_precision` ("ieee", "tf32", or "none": inherit from
    torch.backends.fp32_precision, which its getter resolves) and torch.set_float32_matmul_
    precision; there `allow_tf32` is a legacy view that raises RuntimeError once the new API
    has set the flag. Older torch has only `allow_tf32`."""
    matmul = torch.backends.cuda.matmul if matmul is None else matmul
    try:
        precision = matmul.fp32_precision
    except AttributeError:  # torch before the fp32_precision API
        return bool(matmul.allow_tf32)
    return precision == "tf32"


def check_float32_matmuls(device: str, dtype: torch.dtype, matmul=None) -> bool:
    """Warn, and return False, when torch would run a float32 model's matmuls in TF32. Our
    Triton kernels always use IEEE float32 dots (attention_triton.dot_precision) and the sampler
    has no matmul; the linear layers and the LM head go through cuBLAS, which follows the
    process-wide flag. That flag is the caller's to set, so it is reported, not overridden."""
    if device != "cuda" or dtype != torch.float32 or not tf32_matmuls(matmul):
        return True
    logger.warning("float32 model with TF32 matmuls enabled (torch.backends.cuda.matmul."
                   "fp32_precision / allow_tf32 / torch.set_float32_matmul_precision): linear "
                   "layers will keep 10 mantissa bits and greedy tokens may differ from a "
                   "float32 reference")
    return False

"""Whether a float32 run on CUDA computes in float32: the one check of torch's TF32 flags."""
import logging

import torch

logger = logging.getLogger(__name__)


def tf32_matmuls(matmul=None) -> bool:
    """Whether cuBLAS would run float32 matmuls in TF32 (`matmul`: a stand-in, in tests)."""
    # fp32_precision is "ieee", "tf32", or "none" (inherit torch.backends.fp32_precision, which
    # its getter resolves); torch.set_float32_matmul_precision sets it too. The legacy
    # allow_tf32 view raises once this API has set the flag.
    matmul = torch.backends.cuda.matmul if matmul is None else matmul
    return matmul.fp32_precision == "tf32"


def check_float32_matmuls(device: str, dtype: torch.dtype, matmul=None) -> bool:
    """Warn, and return False, when torch would run a float32 model's matmuls in TF32."""
    # Our Triton kernels use IEEE float32 dots and the sampler has no matmul, but the linear
    # layers and the LM head go through cuBLAS, which follows the process-wide flag: the
    # caller's to set, so it is reported, not overridden.
    if device != "cuda" or dtype != torch.float32 or not tf32_matmuls(matmul):
        return True
    logger.warning("float32 model with TF32 matmuls enabled (torch.backends.cuda.matmul."
                   "fp32_precision / allow_tf32 / torch.set_float32_matmul_precision): linear "
                   "layers will keep 10 mantissa bits and greedy tokens may differ from a "
                   "float32 reference")
    return False

"""Whether a float32 run on CUDA computes in float32: the one check of torch's TF32 flags."""
import logging

import torch

logger = logging.getLogger(__name__)


def check_float32_matmuls(device: str, dtype: torch.dtype) -> bool:
    """Warn, and return False, when torch would run a float32 model's matmuls in TF32. Our
    Triton kernels always use IEEE float32 dots (attention_triton.dot_precision) and the sampler
    has no matmul; the linear layers and the LM head go through cuBLAS, which follows the
    process-wide flag. That flag is the caller's to set, so it is reported, not overridden."""
    if device != "cuda" or dtype != torch.float32 or not torch.backends.cuda.matmul.allow_tf32:
        return True
    logger.warning("float32 model with TF32 matmuls enabled (torch.backends.cuda.matmul."
                   "allow_tf32 / torch.set_float32_matmul_precision): linear layers will keep "
                   "10 mantissa bits and greedy tokens may differ from a float32 reference")
    return False

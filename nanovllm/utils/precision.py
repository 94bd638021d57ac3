"""Whether a float32 run on CUDA computes in float32: the one check of torch's TF32 flags."""
import logging

import torch

logger = logging.getLogger(__name__)


def check_float32_matmuls(device: str, dtype: torch.dtype) -> bool:
    """Warn, and return False, when torch would run a float32 model's matmuls in TF32.

    Our Triton kernels always use IEEE float32 dots for float32 (attention_triton.dot_precision)
    and none of them or the sampler has another matmul; the linear layers and the LM head go
    through cuBLAS, which follows the caller's process-wide flag. The flag is the caller's to
    set, so it is reported rather than overridden. cuDNN's own TF32 flag only affects
    convolutions, which this engine has none of.
    """
    if device != "cuda" or dtype != torch.float32 or not torch.backends.cuda.matmul.allow_tf32:
        return True
    logger.warning("float32 model with TF32 matmuls enabled (torch.backends.cuda.matmul."
                   "allow_tf32 / torch.set_float32_matmul_precision): linear layers will keep "
                   "10 mantissa bits and greedy tokens may differ from a float32 reference")
    return False

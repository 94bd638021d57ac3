"""torch.compile for small fused ops, on CUDA only (CPU runs stay eager: compiling costs ~30 s)."""
import functools
from collections.abc import Callable


def compile_on_cuda(fn: Callable) -> Callable:
    """Run `fn` compiled when its first tensor argument is on CUDA, eager otherwise."""
    compiled = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal compiled
        if not args[1].is_cuda:  # args[0] is the module (self)
            return fn(*args, **kwargs)
        if compiled is None:
            import torch  # torch._dynamo is imported on first use, not at import time
            # dynamic=True: one compile serves every batch size (prefill and decode alike),
            # instead of a static compile followed by a dynamic recompile mid-run.
            compiled = torch.compile(fn, dynamic=True)
        return compiled(*args, **kwargs)

    return wrapper

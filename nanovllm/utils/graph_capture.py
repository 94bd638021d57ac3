"""A run of CUDA graph captures without the allocator flush each one starts with."""
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from unittest import mock

import torch


def _keep() -> None:
    """Stands in for the caches' flush during a run of captures."""


@contextmanager
def keep_caches() -> Iterator[None]:
    """Entering torch.cuda.graph synchronizes and empties the allocator's device and pinned
    host caches, which the next allocations then fill again from the driver; a run of captures
    (start-up's ~120 timing graphs) flushes the device cache once, before the first. The decode
    graphs keep the flush: their warm-up runs' cached blocks would stay out of the capture's
    reach."""
    torch.cuda.empty_cache()
    with ExitStack() as patches:
        patches.enter_context(mock.patch.object(torch.cuda, "empty_cache", _keep))
        if hasattr(torch._C, "_host_emptyCache"):  # the pinned cache's flush (newer torch)
            patches.enter_context(mock.patch.object(torch._C, "_host_emptyCache", _keep))
        yield

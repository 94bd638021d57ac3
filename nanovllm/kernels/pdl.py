"""Programmatic dependent launch (PDL, sm_90+) for the decode step's own kernels. A kernel
launched with it is scheduled while the kernel before it still runs: its programs start, wait
(gdc_wait) for the predecessor to finish and its writes to land, then at once let the next
PDL kernel be scheduled in turn. A kernel boundary then costs no launch and no ramp-up, only
the wait's release; CUDA graphs keep the relation as a programmatic edge. It pays only
between two such kernels: cuBLAS GEMMs never release their dependents early
(docs/benchmarks.md). A MoE layer's kernels as PDL launches took the Qwen3-30B-A3B batch-1
step from 4,236 to 4,146 us (H200, alternated x2, 2026-12-04)."""
import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def enabled() -> bool:
    """PDL on a Hopper-or-newer GPU; never under the interpreter (CPU tests)."""
    return (os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] >= 9)


def launch_options() -> dict:
    """Keyword arguments for a kernel launch: PDL and the kernel's USE_PDL switch."""
    return {"launch_pdl": True, "USE_PDL": True} if enabled() else {"USE_PDL": False}


@triton.jit
def wait_then_release(USE_PDL: tl.constexpr):
    """Block until the previous kernel has finished and its writes are visible, then let the
    next PDL kernel start. Every program calls it first and unconditionally: a kernel's
    completion then implies its predecessors' (a chain of PDL kernels stays ordered)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

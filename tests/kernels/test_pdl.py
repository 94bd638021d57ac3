"""Programmatic dependent launch: every kernel launched with it waits for its predecessor before
touching memory, the CPU interpreter never asks for it, and sm_90 code carries the wait and the
release."""
import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import nanovllm.kernels  # noqa: E402
from nanovllm.kernels import pdl  # noqa: E402


def _pdl_kernels() -> list:
    """Every @triton.jit function of nanovllm.kernels with a USE_PDL parameter."""
    found = []
    for info in pkgutil.walk_packages(nanovllm.kernels.__path__, "nanovllm.kernels."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)  # a JITFunction, or the interpreter's wrapper
            if (inspect.isfunction(fn) and fn.__module__ == module.__name__
                    and "USE_PDL" in inspect.signature(fn).parameters
                    and name != "wait_then_release"):
                found.append(obj)
    return found


# Helpers a kernel may call before its wait, each reviewed to read only what no kernel of a
# step writes (kernels.pdl): weights, scales, biases and the step's inputs.
PRE_WAIT_HELPERS = {
    "prefetch_tile", "_prefetch_weight",  # an L2 hint on weight tiles
    "_weight_slice", "rows_slice", "_pair_slices", "row_values", "rms_weight",  # GEMVs
    "_token_inputs",  # qk_norm_rope: positions, slots, cos/sin rows, norm weights
    "_split_bounds", "_chunk_pages", "cached_end",  # decode: context lengths, block tables
    "live_splits",  # a merge inside o_proj: context lengths, as _split_bounds
    "new_token_inputs",  # decode's new token: as _token_inputs
    # decode's new token: the split's first cache tile, rows before the new position, which
    # only earlier steps wrote (the kernel writes the new position's row after its wait)
    "_first_tile",
}


def test_every_pdl_kernel_waits_first() -> None:
    """A PDL kernel may start while the previous one still writes: before wait_then_release
    (which every program must reach) only index arithmetic and calls of PRE_WAIT_HELPERS; no
    load, store, branch or early return of the kernel's own."""
    kernels = _pdl_kernels()
    names = {k.fn.__name__ for k in kernels}
    assert {"_rms_norm_kernel", "_silu_and_mul_kernel", "_decode_split_kernel",
            "decode_reduce_kernel", "_qkv_rope_store_kernel", "_gate_up_silu_kernel",
            "_split_k_kernel", "_gemv_partials_kernel", "_gemv_rows_kernel",
            "_qk_norm_rope_kernel"} <= names
    for kernel in kernels:
        body = inspect.getsource(kernel.fn).split('"""')[-1]  # after the docstring
        head, sep, _ = body.partition("wait_then_release(USE_PDL)")
        assert sep, f"{kernel.fn.__name__} never waits"
        assert not re.search(r"tl\.(load|store|atomic)|return|\bif\b|\bfor\b", head), \
            f"{kernel.fn.__name__} does work before its wait: {head!r}"
        calls = set(re.findall(r"(?<![\w.])(\w+)\(", head))  # not tl.*: the language's
        unknown = calls - PRE_WAIT_HELPERS
        assert not unknown, f"{kernel.fn.__name__} calls {unknown} before its wait"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only on CPU here")
def test_interpreter_never_launches_with_pdl() -> None:
    assert pdl.launch_options() == {"USE_PDL": False}


_COMPILE_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nanovllm.kernels.fused_ops import _rms_norm_kernel as kernel
names = [p.name for p in kernel.params]
for use_pdl in (True, False):
    consts = dict(H=1024, BLOCK=1024, ADD=True, PARTIALS=0, USE_PDL=use_pdl, LORA_SR=0,
                  SR_PAD=1, NUM_SLOTS=0, RANK=1, CHUNK=128, a_ptr=None, slots_ptr=None,
                  ahead_ptr=None, rstd_ptr=None)
    sig = {n: "constexpr" if n in consts else "fp32" if n == "eps" else
           "i32" if n.startswith("stride") or n == "M" else "*bf16" for n in names}
    src = ASTSource(fn=kernel, signature=sig,
                    constexprs={(names.index(n),): v for n, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, launch_pdl=use_pdl))
    ptx = k.asm["ptx"]
    print(use_pdl, "griddepcontrol.wait" in ptx, "griddepcontrol.launch_dependents" in ptx,
          k.metadata.launch_pdl)
"""


def test_sm90_code_has_the_wait() -> None:
    """Compiled for sm_90 (no GPU needed; a process without the interpreter), a PDL launch of
    RMSNorm has griddepcontrol.wait, the release and the launch flag; without USE_PDL none."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["True True True True", "False False False False"]


@triton.jit
def _lines_kernel(w_ptr, out_ptr, row0, col0, stride, row_end, col_end, ROWS: tl.constexpr,
                  ROW_BYTES: tl.constexpr, ELEM_BYTES: tl.constexpr):
    lines = pdl.prefetch_lines(w_ptr, row0, col0, stride, row_end, col_end, ROWS, ROW_BYTES,
                               ELEM_BYTES)
    LINES: tl.constexpr = ROW_BYTES // 128
    offs = tl.arange(0, ROWS)[:, None] * LINES + tl.arange(0, LINES)[None, :]
    tl.store(out_ptr + offs, lines - w_ptr.to(tl.int64))


def _prefetched_bytes(weight: torch.Tensor, row0: int, col0: int, row_end: int, col_end: int,
                      rows: int, row_bytes: int) -> set[int]:
    """Byte offsets into weight of the lines prefetch_lines asks for."""
    out = torch.empty(rows * (row_bytes // 128), dtype=torch.int64, device=weight.device)
    _lines_kernel[(1,)](weight, out, row0, col0, weight.stride(0), row_end, col_end, rows,
                        row_bytes, weight.element_size())
    return set(out.tolist())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_prefetch_lines_stay_inside_the_split(dtype) -> None:
    """Two K steps asked for where a split is one: the last split of a k-major weight asks
    for its own 128 rows only (0.6B o_proj: no line past the weight's end), a middle split of
    a row-major weight for its own columns only (the last line it reaches is clamped to the
    split's last column); every 128-byte line inside is asked."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    elem = torch.empty(0, dtype=dtype).element_size()
    k_major = torch.empty(256, 128 // elem, dtype=dtype, device=device)  # 128-byte rows
    got = _prefetched_bytes(k_major, 128, 0, 256, k_major.shape[1], 256, 128)
    assert got == {r * 128 for r in range(128, 256)}
    row_major = torch.empty(64, 512, dtype=dtype, device=device)  # K = 512, splits of 128
    split_bytes, row_bytes = 128 * elem, 512 * elem
    got = _prefetched_bytes(row_major, 0, 256, 64, 384, 64, 2 * split_bytes)
    inside = list(range(256 * elem, 384 * elem, 128)) + [383 * elem]  # lines, the clamped one
    assert got == {r * row_bytes + b for r in range(64) for b in inside}

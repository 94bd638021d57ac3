"""A decode's splits merged inside o_proj's split-K kernel (kernels.linear.split_k, 2-16 tokens)
vs the merge launch then split-K (TRITON_INTERPRET on CPU: float16, whose TMA loads the
interpreter reads right)."""

import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402

from nanovllm.kernels.attention.decode_reduce import reduce_splits  # noqa: E402
from nanovllm.kernels.linear.split_k import runs_merge_split_k, split_k_linear  # noqa: E402
from tests.kernels.gemv_cases import DEVICE, gemv_weight, pending_merge  # noqa: E402

DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
HEAD_DIM, HEADS = 128, 16  # K 2,048 over 64 output rows: 16 splits of one head each
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9, reason="TMA needs sm_90")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["k-major", "fp8"])
@pytest.mark.parametrize("tokens,splits,empty,idle", [(2, 3, 0, False), (5, 7, 2, False),
                                                      (16, 4, 4, False), (9, 16, 9, True)])
def test_split_k_merges_a_pending_decode(dtype, fmt, tokens, splits, empty, idle) -> None:
    """The partials equal split-K's of the merge launch's output, to one rounding of that
    output (the kernel sums the splits in chunks of 2); empty splits weigh nothing, and rows
    whose splits are all empty (idle: tokens past the first, as a padded graph's rows) give
    zeros."""
    torch.manual_seed(tokens * splits)
    weight, scale, _ = gemv_weight(64, HEADS * HEAD_DIM, fmt, dtype)
    assert runs_merge_split_k(tokens, dtype, HEAD_DIM, weight)
    pending = pending_merge(tokens, HEADS, splits, empty, HEAD_DIM, dtype)
    if idle:
        pending.part_m[1:] = float("-inf")
        pending.part_l[1:] = 0.0
    merged_out = torch.empty_like(pending.out)
    reduce_splits(pending.part_m, pending.part_l, pending.part_acc, merged_out)
    got = split_k_linear(pending, weight, w_scale=scale)
    want = split_k_linear(merged_out.flatten(1), weight, w_scale=scale)
    assert got.shape == want.shape == (16, tokens, 64)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert got.any(dim=(0, 2)).tolist() == [empty < splits and (i == 0 or not idle)
                                            for i in range(tokens)]
    if empty < splits:  # the heads in their order: swapped must fail
        swapped = split_k_linear(merged_out.flip(1).flatten(1), weight, w_scale=scale)
        assert not torch.allclose(got, swapped, atol=1e-1)


def test_merge_only_where_each_split_is_one_head() -> None:
    """runs_merge_split_k: 2-16 tokens, heads of the K step's width, one K step a split."""
    weight, _, _ = gemv_weight(64, HEADS * HEAD_DIM, "k-major", torch.float16)
    assert runs_merge_split_k(16, torch.float16, HEAD_DIM, weight)
    assert not runs_merge_split_k(1, torch.float16, HEAD_DIM, weight)  # the GEMV's
    assert not runs_merge_split_k(17, torch.float16, HEAD_DIM, weight)
    assert not runs_merge_split_k(8, torch.float16, 64, weight)
    wide, _, _ = gemv_weight(64, 2 * HEADS * HEAD_DIM, "k-major", torch.float16)
    assert not runs_merge_split_k(8, torch.float16, HEAD_DIM, wide)  # two K steps a split


_MERGE_SM90 = """
import os, re, subprocess, tempfile, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nanovllm.kernels.linear import split_k
from triton.backends.nvidia.compiler import get_ptxas
PTXAS = get_ptxas(90).path  # the ptxas Triton runs for sm_90 (3.9: CUDA 13's, for its PTX 9.x)
names = [p.name for p in split_k._split_k_kernel.params]
consts = dict(a_desc=None, b_desc=None, lora_slots_ptr=None, BLOCK_T=16, BLOCK_K=128, STAGES=3,
              USE_PDL=True, K_MAJOR=True, W_SCALE=0, LORA_K=0, RANK=1, ELEM_BYTES=2,
              PREFETCH=True, MERGE=True)
types = dict(w_desc="tensordesc<bf16[128, 64]>", x_desc="tensordesc<bf16[16, 128]>",
             part_ptr="*fp32", s_ptr="*fp32", w_ptr="*bf16", out_ptr="*bf16",
             part_m_ptr="*fp32", part_l_ptr="*fp32", part_acc_ptr="*fp32")
sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
src = ASTSource(fn=split_k._split_k_kernel, signature=sig,
                constexprs={(names.index(n),): v for n, v in consts.items()})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
    f.write(k.asm["ptx"])
    f.flush()
    log = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                         capture_output=True, text=True, check=True).stderr
print(sum(int(n) for n in re.findall(r"(\\d+) bytes spill stores", log)),
      re.search(r"Used (\\d+) registers", log).group(1))
"""


def test_sm90_merging_split_k_compiles_without_spills() -> None:
    """Compiled for sm_90 (no GPU needed; the interpreter forgives what the compiler does not),
    the merging variant holds a chunk of 2 splits of 16 tokens in registers without spilling,
    two programs a SM (Qwen3-0.6B's o_proj at 16 tokens: 256 programs, one wave)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _MERGE_SM90], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    spills, registers = map(int, out.stdout.split())
    assert spills == 0 and 2 * 128 * registers <= 65536, out.stdout

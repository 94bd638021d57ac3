"""The one-token decode kernels compile for sm_90 (Triton to PTX, ptxas to a cubin), without a
GPU: what the interpreter cannot show (layouts of tl.join, tl.permute, tl.reshape, a [1, D]
tl.trans, a 16-key tile through tl.dot, a runtime branch holding the softmax state; 32 K weight
elements held in registers by 8 warps), and ptxas fits each in registers (no spills: local
memory in a kernel run once per token)."""
import os
import subprocess
import sys

import pytest
import triton

_COMPILE = """
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nanovllm.kernels.attention.decode import _decode_split_kernel
from nanovllm.kernels.attention.qk_norm_rope import _qk_norm_rope_kernel
from nanovllm.kernels.linear.gemv import _gemv_rows_kernel
from nanovllm.kernels.linear.gemv_gate_up import _gate_up_silu_kernel
from nanovllm.kernels.linear.gemv_mlp import _gate_up_down_kernel

# (registers, stack frame bytes, local bytes) of the cubin, specialised as a launch is: pointers
# and the integers it specialises divisible by 16 (as every one here is)
def cubin(kernel, consts, types, **options):
    names = [p.name for p in kernel.params]
    sig = {n: "constexpr" if n in consts else types.get(n, "*bf16") for n in names}
    attrs = {(p.num,): [["tt.divisibility", 16]] for p in kernel.params
             if not p.do_not_specialize and sig[p.name][0] in "*i"}
    src = ASTSource(fn=kernel, signature=sig, attrs=attrs,
                    constexprs={(names.index(n),): v for n, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(launch_pdl=True, **{"num_warps": 4, **options}))
    # ptxas's allocation as the cubin records it (a cached compile runs no ptxas): spilled
    # registers would take a stack frame in local memory
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    return tuple(int(re.search(rf"\\b{key}:(\\d+)", usage)[1])
                 for key in ("REG", "STACK", "LOCAL"))

ints = dict.fromkeys(["stride_qb", "stride_qh", "stride_bt", "stride_ob", "stride_oh",
                      "num_splits", "window", "stride_nb", "stride_cs", "K", "inter",
                      "stride_w", "stride_qn", "stride_kn", "stride_kh", "stride_cache",
                      "stride_vn", "stride_vh"], "i32")
floats = dict.fromkeys(["qk_scale", "v_scale", "eps", "k_inv_scale", "v_inv_scale"], "fp32")
types = {**ints, **floats, "context_lens_ptr": "*i32", "block_tables_ptr": "*i32",
         "pos_ptr": "*i64", "slot_ptr": "*i32", "cs_ptr": "*fp32", "cache_ptr": "*fp32",
         "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32",
         "s_ptr": "*fp32", "x_ptr": "*fp32"}
for fp8 in (False, True):
    cache = "*fp8e4nv" if fp8 else "*bf16"
    for sliding in (False, True):  # the launch's tiles and stages (decode_attention_triton)
        print("decode", fp8, sliding, *cubin(_decode_split_kernel, dict(
            GROUP=2, GROUP_P2=16, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=256,
            BLOCK_N=128 if fp8 else 64, PAGES_PER_CHUNK=16, PRECISION="tf32", SLIDING=sliding,
            SINGLE_SPLIT=False, FP16_DOT=fp8, NEW_KV=True, NORM=True, FP8=fp8, USE_PDL=True),
            {**types, "k_cache_ptr": cache, "v_cache_ptr": cache}, num_stages=2))
    weight = "*fp8e4nv" if fp8 else "*bf16"
    print("gate_up", fp8, *cubin(_gate_up_silu_kernel, dict(
        BLOCK_N=16 if fp8 else 8, K_P2=1024, W_SCALE=fp8, HAS_BIAS=False, PARTIALS=4,
        USE_PDL=True), {**types, "w_ptr": weight}))
    print("rows", fp8, *cubin(_gemv_rows_kernel, dict(
        BLOCK_N=8, K_P2=1024, W_SCALE=fp8, HAS_BIAS=True, PARTIALS=0, USE_PDL=True),
        {**types, "w_ptr": weight, "x_ptr": "*bf16"}))
    print("norm rows", fp8, *cubin(_gemv_rows_kernel, dict(  # Qwen3-0.6B's qkv_proj
        BLOCK_N=32, K_P2=1024, W_SCALE=fp8, HAS_BIAS=False, PARTIALS=6,
        USE_PDL=True), {**types, "w_ptr": weight}, num_warps=8))
print("mlp", *cubin(_gate_up_down_kernel, dict(  # Qwen3-0.6B's MLP
    BLOCK_N=8, K_P2=1024, N_P2=1024, PARTIALS=4, NUM_SPLITS=6, CLEAR=16, HAS_BIAS=False,
    USE_PDL=True), {**types, "part_ptr": "*fp32", "clear_ptr": "*fp32", "N": "i32",
                    "stride_wd": "i32"}))
print("qk", *cubin(_qk_norm_rope_kernel, dict(
    NUM_Q_HEADS=16, NUM_KV_HEADS=8, Q_HEADS_P2=16, KV_HEADS_P2=8, HEAD_DIM=128, STORE_KV=True,
    NORM=True, FP8=False, USE_PDL=True), types))
"""


# Triton 3.9 runs CUDA 13.4's ptxas with --regAllocOptLevel=2 (its workaround for a ptxas bug,
# passed to every compile): the decode kernel's PTX, at 168 registers a thread (128 from Triton
# 3.8), then spills 8 bytes (40 with an FP8 cache at 255 registers); the same PTX without that
# flag spills nothing. Never run on a GPU with Triton 3.9 (the GPU machine has 3.6).
@pytest.mark.xfail(tuple(map(int, triton.__version__.split(".")[:2])) >= (3, 9), strict=True,
                   reason="Triton 3.9's ptxas flags spill the decode kernel's registers")
def test_one_token_kernels_compile_for_sm90() -> None:
    """Each variant a lone token runs on an H100/H200 gives a cubin (a process without the
    interpreter) within 255 registers a thread, with no stack frame: nothing spilled."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line.rsplit(" ", 3) for line in out.stdout.splitlines()]
    assert [name for name, *_ in lines] == [
        "decode False False", "decode False True", "gate_up False", "rows False",
        "norm rows False", "decode True False", "decode True True", "gate_up True",
        "rows True", "norm rows True", "mlp", "qk"], out.stdout
    for name, regs, stack, local in lines:
        assert 0 < int(regs) <= 255 and stack == local == "0", (name, out.stdout)

"""Decode projections with fused epilogues (Triton, TMA) vs the unfused path (TRITON_INTERPRET
on CPU)."""

import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nanovllm.kernels.attention.kv_quant import FP8_DTYPE  # noqa: E402
from nanovllm.kernels.attention.store_kvcache import store_kvcache_torch  # noqa: E402
from nanovllm.kernels.linear.fused import _launch, fits_qkv, qkv_rope_store  # noqa: E402
from nanovllm.kernels.linear.fused_gate_up import fits_gate_up, gate_up_silu  # noqa: E402
from nanovllm.kernels.linear.lora import LoRAAhead, LoRASlots  # noqa: E402
from nanovllm.kernels.linear.split_k import (  # noqa: E402
    _num_splits,
    _stages,
    fits_split_k,
    split_k_linear,
    sum_partials,
)
from nanovllm.layers.activation import SiluAndMul  # noqa: E402
from nanovllm.layers.layernorm import RMSNorm  # noqa: E402
from nanovllm.layers.rotary_embedding import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, MAX_POS = 256, 2048
# The GEMM sums in another order than the reference's: a 16-bit ulp apart here and there.
TOL = {torch.bfloat16: (3e-2, 3e-2), torch.float16: (1e-2, 1e-2)}
# The interpreter's TMA loads garble bf16 (numpy has none): bf16 runs on CUDA only.
DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9, reason="TMA needs sm_90")


def _weight(rows: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(rows, HIDDEN, device=DEVICE) * HIDDEN ** -0.5).to(dtype)


def _rows(num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """Input rows whose scale differs from row to row."""
    scale = torch.rand(num_tokens, 1, device=DEVICE) * 3 + 0.2
    return (torch.randn(num_tokens, HIDDEN, device=DEVICE) * scale).to(dtype)


def test_fits() -> None:
    assert fits_qkv(1024, 128, torch.bfloat16) and fits_qkv(4096, 128, torch.float16)
    assert not fits_qkv(1024, 64, torch.bfloat16)  # half heads narrower than an MMA tile
    assert not fits_qkv(1024, 256, torch.bfloat16)  # or wider
    assert not fits_qkv(1024, 128, torch.float32)
    assert fits_gate_up(1024, 3072, torch.bfloat16) and not fits_gate_up(1024, 3000, torch.bfloat16)
    assert fits_split_k(3072, 1024, torch.bfloat16) and not fits_split_k(3000, 1024, torch.bfloat16)
    assert not fits_split_k(2048, 1000, torch.bfloat16)
    assert not fits_split_k(2048, 1024, torch.float32)


def test_num_splits() -> None:
    """Qwen3-0.6B's o_proj (K = 2,048) and down_proj (K = 3,072): the sweep's best splits."""
    assert _num_splits(1024, 2048, 1, 16) == 16 and _num_splits(1024, 3072, 1, 16) == 8
    assert _num_splits(1024, 2048, 1, 64) == 8 and _num_splits(1024, 3072, 1, 64) == 8
    assert _num_splits(1024, 2048, 2, 128) == 4 and _num_splits(1024, 3072, 2, 256) == 4
    assert _num_splits(4096, 14336, 2, 256) == 1  # enough programs already
    assert _num_splits(128, 384, 1, 5) == 1  # K = 3 tiles: only one split divides it


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm,bias", [(True, False), (False, True)])
@pytest.mark.parametrize("num_tokens", [1, 3, 37, 130])  # a GEMV; tiles of 16, 32, 64 tokens
@pytest.mark.parametrize("fp8", [False, True])
def test_qkv_rope_store(dtype: torch.dtype, qk_norm: bool, bias: bool, num_tokens: int,
                        fp8: bool) -> None:
    """q equals qkv_proj -> q norm -> RoPE; k and v land in their slots as store_kvcache_torch
    puts the unfused path's k and v; a padding slot (-1) and other slots stay untouched."""
    torch.manual_seed(num_tokens)
    heads, kv_heads, head_dim = 2, 1, 128
    weight = _weight((heads + 2 * kv_heads) * head_dim, dtype)
    b = torch.randn(weight.shape[0], device=DEVICE).to(dtype) if bias else None
    norms = [RMSNorm(head_dim, eps=0.1).to(device=DEVICE, dtype=dtype) for _ in range(2)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.normal_(1.0, 0.3)
    rope = RotaryEmbedding(head_dim, MAX_POS, {"rope_type": "default", "rope_theta": 1e6})
    rope = rope.to(DEVICE)
    x = _rows(num_tokens, dtype)
    positions = torch.randint(0, MAX_POS, (num_tokens,), device=DEVICE)
    cache_dtype = FP8_DTYPE if fp8 else dtype
    k_cache = torch.zeros(16, 16, kv_heads, head_dim, device=DEVICE).to(cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(256, device=DEVICE)[:num_tokens]
    if num_tokens > 1:  # a lone token keeps its slot: something must be written
        slots[-1] = -1
    scales = (0.5, 2.0) if fp8 else (1.0, 1.0)
    with torch.no_grad():
        qkv = F.linear(x, weight, b)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        q, k = q.reshape(-1, heads, head_dim), k.reshape(-1, kv_heads, head_dim)
        if qk_norm:
            q, k = norms[0].rms_forward(q), norms[1].rms_forward(k)
        q_ref, k_ref = rope(positions, q, k)
    k_ref_cache, v_ref_cache = k_cache.clone(), v_cache.clone()
    store_kvcache_torch(k_ref, v.reshape(-1, kv_heads, head_dim), k_ref_cache, v_ref_cache,
                        slots, *scales)
    q_out = qkv_rope_store(x, weight, b, heads, kv_heads, positions,
                           norms[0].weight if qk_norm else None,
                           norms[1].weight if qk_norm else None, 0.1, rope.cos_sin_cache,
                           k_cache, v_cache, slots, scales)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(q_out, q_ref, atol=atol, rtol=rtol)
    tol = (0.13, 0.13) if fp8 else (atol, rtol)  # one e4m3 step is 1/8 relative
    for got, want in ((k_cache, k_ref_cache), (v_cache, v_ref_cache)):
        torch.testing.assert_close(got.float(), want.float(), atol=tol[0], rtol=tol[1])
    written = torch.zeros(256, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0]] = True
    assert k_cache.view(256, -1)[~written].float().abs().sum() == 0
    assert v_cache.view(256, -1)[~written].float().abs().sum() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,bias", [(5, False), (33, True), (130, False)])
def test_gate_up_silu(dtype: torch.dtype, num_tokens: int, bias: bool) -> None:
    """Equals gate_up_proj -> SiLU-and-mul."""
    torch.manual_seed(num_tokens)
    inter = 192
    weight = _weight(2 * inter, dtype)
    b = torch.randn(2 * inter, device=DEVICE).to(dtype) if bias else None
    x = _rows(num_tokens, dtype)
    with torch.no_grad():
        want = SiluAndMul.torch_forward(F.linear(x, weight, b))
    got = gate_up_silu(x, weight, b)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,input_size,splits", [(5, 512, 4), (40, 384, 1), (130, 256, 2)])
def test_split_k_linear(dtype: torch.dtype, num_tokens: int, input_size: int,
                        splits: int) -> None:
    """The partials of a k-major weight (RowParallelLinear's layout) sum to F.linear."""
    torch.manual_seed(num_tokens)
    output = 128
    w_kn = (torch.randn(input_size, output, device=DEVICE) * input_size ** -0.5).to(dtype)
    weight = w_kn.t()  # [N, K] seen through a transposed view, as the layer keeps it
    scale = torch.rand(num_tokens, 1, device=DEVICE) * 3 + 0.2
    x = (torch.randn(num_tokens, input_size, device=DEVICE) * scale).to(dtype)
    parts = split_k_linear(x, weight)
    assert parts.dtype == torch.float32 and parts.shape == (splits, num_tokens, output)
    want = F.linear(x.float(), weight.float())
    torch.testing.assert_close(parts.sum(0), want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("splits,num_tokens,output_size,bias", [(4, 1, 1500, True),
                                                                (2, 5, 96, False),
                                                                (1, 16, 2048, True)])
def test_sum_partials(dtype, splits, num_tokens, output_size, bias) -> None:
    """The splits summed in order in float32, plus the bias, rounded once to dtype (exact)."""
    part = torch.randn(splits, num_tokens, output_size, device=DEVICE) * 100
    b = torch.randn(output_size, device=DEVICE, dtype=dtype) if bias else None
    ref = torch.zeros(num_tokens, output_size, device=DEVICE)
    for split in part:
        ref += split
    ref = (ref if b is None else ref + b.float()).to(dtype)
    out = sum_partials(part, dtype, b)
    assert out.dtype == dtype and out.shape == (num_tokens, output_size)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype,alone,shared,beside_b", [(torch.bfloat16, 4, 3, 2),
                                                         (FP8_DTYPE, 8, 5, 4)])
def test_decode_launch_keeps_its_programs_resident(dtype, alone, shared, beside_b) -> None:
    """Up to 16 tokens, more programs than SMs get the stages that fit them all at once (two a
    SM for Llama-3.1-8B's 224 gate_up programs on 132 SMs; at least 2), with a LoRA shrink
    computed ahead beside B's two tiles; else the stages alone."""
    w = torch.empty(1, dtype=dtype)
    assert [_launch(1, w, None, None, n, 132)[2] for n in (48, 132)] == [alone, alone]
    assert [_launch(16, w, None, None, n, 132)[2] for n in (133, 224)] == [shared, shared]
    assert _launch(1, w, None, None, 448, 132)[2] == 2
    assert _launch(1, w, None, None, 224, 0)[2] == alone  # off CUDA: no SMs, no limit
    assert _launch(17, w, None, None, 224, 132)[2] == 4  # beyond 16 tokens: as before
    lora = LoRASlots(torch.empty(2, 4, 16, 64), torch.empty(128, 4, 16), torch.empty(1))
    assert _launch(1, w, lora, None, 224, 132)[2] == 3  # A's tiles in the loop: its own rule
    ahead = LoRAAhead(lora.lora_a, lora.slots, torch.empty(1), torch.empty(1))
    assert _launch(1, w, lora, ahead, 224, 132)[2] == beside_b
    assert _launch(1, w, lora, ahead, 48, 132)[2] == alone


def _compile_for_sm90(script: str) -> str:
    """A script's stdout, run outside the interpreter (it compiles for sm_90; no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


_RESIDENT_SM90 = """
import os, re, subprocess, tempfile, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nanovllm.kernels.linear import fused, fused_gate_up
from nanovllm.kernels.linear.lora import LoRAAhead, LoRASlots
from triton.backends.nvidia.compiler import get_ptxas
PTXAS = get_ptxas(90).path  # the ptxas Triton runs for sm_90 (3.9: CUDA 13's, for its PTX 9.x)


def spill_bytes(ptx):
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        log = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    return sum(int(n) for n in re.findall(r"(\\d+) bytes spill stores", log))

T = dict(x_desc="tensordesc<bf16[16, 128]>", s_ptr="*fp32", out_ptr="*bf16", bias_ptr="*bf16",
         a_desc="tensordesc<bf16[64, 128]>", b_desc="tensordesc<bf16[64, 64]>",
         lora_slots_ptr="*i32", ahead_ptr="*fp32", rstd_ptr="*fp32")
lora = LoRASlots(torch.empty(2, 4, 16, 64), None, torch.empty(1))
ahead = LoRAAhead(lora.lora_a, lora.slots, None, None)
off = dict(LORA_K=0, RANK=1, AHEAD=0, AHEAD_SR=0, a_desc=None, b_desc=None, lora_slots_ptr=None,
           ahead_ptr=None, rstd_ptr=None)
for dtype, name, w_scale, with_lora in ((torch.bfloat16, "bf16", 0, None),
                                        (torch.float8_e4m3fn, "fp8e4nv", 1, None),
                                        (torch.bfloat16, "bf16-lora-ahead", 0, (lora, ahead))):
    kernel = fused_gate_up._gate_up_silu_kernel
    block_t, block_k, stages, warps = fused._launch(1, torch.empty(1, dtype=dtype),
                                                    *(with_lora or (None, None)), 224, 132)
    consts = dict(HAS_BIAS=False, BLOCK_T=block_t, BLOCK_K=block_k, STAGES=stages, USE_PDL=True,
                  W_SCALE=w_scale, ELEM_BYTES=dtype.itemsize, PREFETCH=True,
                  **(dict(LORA_K=64, RANK=16, AHEAD=8, AHEAD_SR=32) if with_lora else off))
    names = [p.name for p in kernel.params]
    types = dict(T, w_desc=f"tensordesc<{name[:4] if with_lora else name}[64, 128]>",
                 w_ptr=f"*{name[:4] if with_lora else name}")
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = ASTSource(fn=kernel, signature=sig,
                    constexprs={(names.index(n),): v for n, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    ptx = k.asm["ptx"]
    print(name, stages, k.metadata.shared, spill_bytes(ptx),
          -1 < ptx.find("prefetch.global.L2") < ptx.find("griddepcontrol.wait"))
"""


def test_sm90_two_resident_programs_fit() -> None:
    """Compiled for sm_90 (no GPU needed), two 8B gate_up programs at the stages _launch gives
    fit one SM's 228 KB of shared memory (each block also reserves 1 KB), also with a LoRA
    shrink computed ahead (B's tiles beside the pipeline; its 8 chunks summed without
    spilling registers), and with the weight prefetch before the PDL wait in the code."""
    stdout = _compile_for_sm90(_RESIDENT_SM90)
    lines = [line.split() for line in stdout.splitlines()]
    assert [(name, int(stages)) for name, stages, *_ in lines] == [
        ("bf16", 3), ("fp8e4nv", 5), ("bf16-lora-ahead", 2)]
    assert all(2 * (int(shared) + 1024) <= 228 * 1024 for _, _, shared, *_ in lines), stdout
    assert all(int(spills) == 0 for *_, spills, _ in lines), stdout
    # its gate and up rows' first K steps asked of L2 before the PDL wait
    assert all(before == "True" for *_, before in lines), stdout


def test_split_k_keeps_its_programs_resident() -> None:
    """Split-K takes fused._launch's rule: Llama-3.1-8B's FP8 qkv_proj at batch 1 (96 column
    tiles x 4 splits) runs 3 a SM at 6 stages, not 1.45 waves at 8; 256 programs keep 8."""
    fp8, bf16 = torch.empty(1, dtype=FP8_DTYPE), torch.empty(1, dtype=torch.bfloat16)
    assert [_stages(8, 1, None, fp8, n, 132) for n in (132, 256, 384)] == [8, 8, 6]
    assert [_stages(8, 16, None, bf16, n, 132) for n in (256, 384)] == [4, 3]
    assert _stages(8, 1, None, fp8, 384, 0) == 8  # off CUDA: no SMs, no limit
    assert _stages(8, 17, None, fp8, 384, 132) == 4  # beyond 16 tokens: as before


_SPLIT_K_SM90 = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nanovllm.kernels.linear import split_k
stages = split_k._stages(8, 1, None, torch.empty(1, dtype=torch.float8_e4m3fn), 384, 132)
names = [p.name for p in split_k._split_k_kernel.params]
for k_major, w, tile in ((False, "fp8e4nv", "[64, 128]"), (True, "bf16", "[128, 64]")):
    consts = dict(a_desc=None, b_desc=None, lora_slots_ptr=None, BLOCK_T=16, BLOCK_K=128,
                  STAGES=stages, USE_PDL=True, K_MAJOR=k_major, W_SCALE=0 if k_major else 1,
                  LORA_K=0, RANK=1, ELEM_BYTES=2 if k_major else 1, PREFETCH=True, MERGE=False)
    types = dict(w_desc=f"tensordesc<{w}{tile}>", x_desc="tensordesc<bf16[16, 128]>",
                 part_ptr="*fp32", s_ptr="*fp32", w_ptr=f"*{w}", out_ptr="*bf16")
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = ASTSource(fn=split_k._split_k_kernel, signature=sig,
                    constexprs={(names.index(n),): v for n, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    ptx = k.asm["ptx"]
    print(stages, k.metadata.shared,
          -1 < ptx.find("prefetch.global.L2") < ptx.find("griddepcontrol.wait"))
"""


def test_sm90_three_resident_split_k_programs_fit() -> None:
    """Compiled for sm_90, three FP8 split-K programs at the stages _stages gives 384 of them
    fit one SM's 228 KB of shared memory (each block also reserves 1 KB); both weight layouts
    prefetch before the PDL wait."""
    stdout = _compile_for_sm90(_SPLIT_K_SM90)
    fp8, bf16 = (line.split() for line in stdout.splitlines())
    stages, shared = int(fp8[0]), int(fp8[1])
    assert stages == 6 and 3 * (shared + 1024) <= 228 * 1024, stdout
    # FP8 [N, K] and k-major bf16 weights: their first K steps asked of L2 before the wait
    assert fp8[2] == bf16[2] == "True", stdout

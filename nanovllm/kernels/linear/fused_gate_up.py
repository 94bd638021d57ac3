"""gate_up_proj with SiLU-and-mul in its epilogue: kernels.linear.fused's pair GEMM on 64 gate
rows and their 64 up rows a program; a lone token runs kernels.linear.gemv_gate_up's GEMV."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.linear.fused import ROWS, pair_gemm, weight_args
from nanovllm.kernels.linear.fused_fp8 import Block, fits_weight
from nanovllm.kernels.linear.gemv_gate_up import (
    gate_up_silu_gemv,
    runs_gate_up_gemv,
    silu_and_mul_rounded,
)
from nanovllm.kernels.linear.lora import LoRAAhead, LoRASlots
from nanovllm.kernels.pdl import PREFETCH_STEPS, prefetch_tile, wait_then_release


@triton.jit(do_not_specialize=["M"])
def _gate_up_silu_kernel(w_desc, x_desc, bias_ptr, out_ptr, M, K, inter, s_ptr, stride_s,
                         scale_rows, a_desc, b_desc, lora_slots_ptr, ahead_ptr, rstd_ptr, w_ptr,
                         HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                         STAGES: tl.constexpr, USE_PDL: tl.constexpr, W_SCALE: tl.constexpr,
                         LORA_K: tl.constexpr, RANK: tl.constexpr, AHEAD: tl.constexpr,
                         AHEAD_SR: tl.constexpr, ELEM_BYTES: tl.constexpr,
                         PREFETCH: tl.constexpr):
    """Grid (inter / 64, token tiles): silu(gate) * up for 64 columns of BLOCK_T tokens; gate
    rows are W[:inter], up rows W[inter:]; PREFETCH as in the qkv kernel."""
    col0 = tl.program_id(0) * 64  # ROWS
    PREFETCH_BYTES: tl.constexpr = PREFETCH_STEPS * BLOCK_K * ELEM_BYTES
    prefetch_tile(w_ptr, col0, 0, K, 2 * inter, K, 64, PREFETCH_BYTES, ELEM_BYTES,
                  PREFETCH)  # the gate rows
    prefetch_tile(w_ptr, inter + col0, 0, K, 2 * inter, K, 64, PREFETCH_BYTES, ELEM_BYTES,
                  PREFETCH)  # the up rows
    wait_then_release(USE_PDL)
    tok0 = tl.program_id(1) * BLOCK_T
    cols = col0 + tl.arange(0, 64)[:, None]
    if HAS_BIAS:  # requested before the K loop, as in the qkv kernel
        gate_bias = tl.load(bias_ptr + cols).to(tl.float32)
        up_bias = tl.load(bias_ptr + inter + cols).to(tl.float32)
    gate, up = pair_gemm(w_desc, x_desc, col0, inter + col0, tok0, K, s_ptr, stride_s,
                          scale_rows, a_desc, b_desc, lora_slots_ptr, ahead_ptr, rstd_ptr, M, 0,
                          1, BLOCK_T, BLOCK_K, STAGES, W_SCALE, LORA_K, RANK, True, AHEAD,
                          AHEAD_SR)
    if HAS_BIAS:
        gate += gate_bias
        up += up_bias
    toks = tok0 + tl.arange(0, BLOCK_T)[None, :]
    tl.store(out_ptr + toks.to(tl.int64) * inter + cols,
             silu_and_mul_rounded(gate, up, out_ptr.dtype.element_ty), mask=toks < M)


def fits_gate_up(hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 weight_dtype: torch.dtype | None = None, w_block: Block = None) -> bool:
    """Whether gate_up_silu takes these sizes (intermediate_size: this rank's)."""
    return fits_weight(dtype, weight_dtype or dtype, w_block) \
        and intermediate_size % ROWS == 0 and hidden_size % 64 == 0


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                 w_scale: torch.Tensor | None = None, w_block: Block = None,
                 lora: LoRASlots | None = None, ahead: LoRAAhead | None = None) -> torch.Tensor:
    """silu(x @ Wg.T + bg) * (x @ Wu.T + bu), [M, I], for weight [2I, hidden] (gate rows
    first), as gate_up_proj (with its LoRA delta) followed by SiLU-and-mul; FP8 weights as in
    qkv_rope_store. One token without LoRA runs kernels.linear.gemv_gate_up's (faster there)."""
    if lora is None and runs_gate_up_gemv(x, weight, w_scale, w_block):
        return gate_up_silu_gemv(x, weight, bias, w_scale)
    num_tokens, hidden = x.shape
    inter = weight.shape[0] // 2
    assert fits_gate_up(hidden, inter, x.dtype, weight.dtype, w_block)
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    args = weight_args(x, weight, w_scale, w_block, lora, ahead, inter // ROWS)
    _gate_up_silu_kernel[(inter // ROWS, triton.cdiv(num_tokens, args["BLOCK_T"]))](
        bias_ptr=bias if bias is not None else weight, out_ptr=out, M=num_tokens, K=hidden,
        inter=inter, HAS_BIAS=bias is not None, **args)
    return out

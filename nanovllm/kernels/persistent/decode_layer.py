"""A dense decoder layer's decode step (up to 16 tokens) in one launch: one program per SM runs
its phases, a grid barrier between each two, where the per-kernel path runs seven PDL kernels.

    1 qkv_proj, the input RMSNorm applied to each x tile (split over K: float32 partials)
    2 attention, split over the context (softmax partials), each item first norming and
      rotating its queries from the partials; the split holding the new token writes its K/V
    3 o_proj, the splits' attention merged on the fly (split over K)
    4 residual add
    5 gate_up_proj, the post-attention RMSNorm applied to each x tile (split over K)
    6 down_proj, SiLU-and-mul of gate_up's partials on the fly (split over K)
    7 residual add: the layer's output

A step of 1-2 tokens skips phases 4 and 7 and their barriers: gate_up adds o_proj's partials
itself and down_proj's partials carry into the next layer's launch (PersistentDecodeLayer's
__call__). Each program asks L2 for its share of the weights a phase ahead (no phase writes a
weight; the next layer's qkv_proj and o_proj while down_proj runs), so HBM streams them while
the phases before still run. Under the interpreter (CPU) programs run one after another and a
barrier would wait for ever: each phase is then a launch of its own of the same code (PHASE),
which the CPU tests check against torch."""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention import prefill
from nanovllm.kernels.attention.prefill import LOG2E
from nanovllm.kernels.linear.fused_fp8 import num_sms, scale_args
from nanovllm.kernels.pdl import launch_options, wait_then_release
from nanovllm.kernels.persistent.attention import attention
from nanovllm.kernels.persistent.gemms import down, normed_gemm, o_proj
from nanovllm.kernels.persistent.sync import grid_sync, prefetch_share
from nanovllm.kernels.persistent.tiles import BN, residual

BK = 128  # K columns of a GEMM step
L2_PREFETCH_BYTES = 40 << 20  # weights a layer asks L2 for (of the H200's 50 MB), in order
_BK = tl.constexpr(BK)  # the same, for the kernel
ROWS = BN.value  # output rows of a GEMM item (host side)
MAX_TOKENS = 16
PHASES = 7
_MAX_SPLITS = 64  # attention splits of one (token, kv head)


# Plain arguments, not specialised: the token count and split count change with the CUDA
# graph's batch size and stride_bt with the step; a constant each would compile a variant each.
@triton.jit(do_not_specialize=["T", "NS", "stride_bt", "XPART", "FUSE", "CARRY_OUT"])
def _decode_layer_kernel(
        x_ptr, xin_ptr, res_ptr, gate_x_ptr, out_ptr, in_norm_ptr, wqkv_ptr, s_qkv_n, s_qkv_k,
        qn_ptr, kn_ptr, wo_ptr, s_o_n, s_o_k, post_norm_ptr, wgu_ptr, s_gu_n, s_gu_k, wd_ptr,
        s_d_n, s_d_k, next_qkv_ptr, next_o_ptr, cos_sin_ptr, pos_ptr, slot_ptr, k_cache_ptr,
        v_cache_ptr, ctx_ptr, bt_ptr, stride_bt, part1_ptr, q_ptr, m_ptr, l_ptr, acc_ptr,
        part3_ptr, resid2_ptr, part5_ptr, part6_ptr, bar_ptr, sq_ptr, sq_stride, sq_rows,
        so_ptr, so_stride, so_rows, sg_ptr, sg_stride, sg_rows, sd_ptr, sd_stride, sd_rows, P,
        T, eps, qk_scale, NS, XPART, FUSE, CARRY_OUT, S1: tl.constexpr,
        S3: tl.constexpr, S5: tl.constexpr, S6: tl.constexpr, H: tl.constexpr,
        HQ: tl.constexpr, HKV: tl.constexpr, G_P2: tl.constexpr, D: tl.constexpr,
        INTER: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
        NORM: tl.constexpr, PRECISION: tl.constexpr, PHASE: tl.constexpr,
        W_SCALE: tl.constexpr, PREFETCH: tl.constexpr, POLL: tl.constexpr,
        USE_PDL: tl.constexpr):
    """Grid (P,), one program an SM: the phases of the module docstring (PHASE 0: all, with
    barriers; n: phase n alone). XPART, FUSE, CARRY_OUT: PersistentDecodeLayer.__call__'s
    x_partials, fuse and carry_out; res_ptr: x with x_partials added (xin_ptr, which phase 1
    writes) or x; gate_x_ptr: res_ptr with FUSE, else resid2_ptr (which phase 4 writes).
    PREFETCH % 4, where each program asks L2 for its share of each weight: 0 nowhere; 1 after
    the PDL wait; 2 before it; 3 a phase ahead (qkv_proj's and o_proj's before the wait,
    gate_up's at attention, down's at o_proj, the next layer's qkv_proj and o_proj, next_qkv_ptr
    and next_o_ptr, at down_proj); PREFETCH // 4, which weights (a bit each, from
    qkv_proj's: a weight L2 cannot hold is left to its pipeline). POLL: grid_sync's. W_SCALE:
    the weights' format (kernels.linear.fused_fp8); s*: each weight's scales, their row
    stride and the weight rows a scale row covers."""
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    ws_qkv = (sq_ptr, sq_stride, sq_rows)
    ws_o = (so_ptr, so_stride, so_rows)
    ws_gu = (sg_ptr, sg_stride, sg_rows)
    ws_d = (sd_ptr, sd_stride, sd_rows)
    pid = tl.program_id(0)
    NQKV: tl.constexpr = (HQ + 2 * HKV) * D
    _prefetch(wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, pid, P, H, NQKV, HQ * D, INTER, PREFETCH, 0)
    wait_then_release(USE_PDL)
    _prefetch(wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, pid, P, H, NQKV, HQ * D, INTER, PREFETCH, 1)
    if PHASE == 0 or PHASE == 1:  # x: with XPART plus the layer before's down_proj partials
        normed_gemm(x_ptr, part6_ptr, S6, XPART, xin_ptr, in_norm_ptr, wqkv_ptr, s_qkv_n,
                    s_qkv_k, ws_qkv, part1_ptr, pid, P, T, eps, NQKV // BN, S1, H, NQKV, _BK, 0,
                    W_SCALE, PRECISION)
    if PHASE == 0:
        grid_sync(bar_ptr, P, POLL)
    _prefetch(wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, pid, P, H, NQKV, HQ * D, INTER, PREFETCH, 2)
    if PHASE == 0 or PHASE == 2:
        attention(part1_ptr, S1, q_ptr, qn_ptr, kn_ptr, cos_sin_ptr, pos_ptr, slot_ptr,
                  k_cache_ptr, v_cache_ptr, ctx_ptr, bt_ptr, stride_bt, m_ptr, l_ptr, acc_ptr,
                  NS, pid, P, T, eps, qk_scale, HQ, HKV, G_P2, D, BLOCK_SIZE, BLOCK_N, NORM,
                  PRECISION)
    if PHASE == 0:
        grid_sync(bar_ptr, P, POLL)
    _prefetch(wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, pid, P, H, NQKV, HQ * D, INTER, PREFETCH, 3)
    if PHASE == 0 or PHASE == 3:
        o_proj(m_ptr, l_ptr, acc_ptr, NS, wo_ptr, s_o_n, s_o_k, ws_o, part3_ptr, pid, P, T,
               H // BN, S3, H, HQ, D, dtype, W_SCALE, PRECISION)
    if PHASE == 0:
        grid_sync(bar_ptr, P, POLL)
    if FUSE == 0:  # else gate_up adds o_proj's partials itself: no phase, no barrier
        if PHASE == 0 or PHASE == 4:
            residual(part3_ptr, S3, res_ptr, resid2_ptr, pid, P, T, H)
        if PHASE == 0:
            grid_sync(bar_ptr, P, POLL)
    if PHASE == 0 or PHASE == 5:  # gate_x: resid2 (FUSE 0) or x (FUSE 1, plus part3)
        normed_gemm(gate_x_ptr, part3_ptr, S3, FUSE, resid2_ptr, post_norm_ptr, wgu_ptr,
                    s_gu_n, s_gu_k, ws_gu, part5_ptr, pid, P, T, eps, INTER // BN, S5, H,
                    2 * INTER, _BK, INTER, W_SCALE, PRECISION)
    if PHASE == 0:
        grid_sync(bar_ptr, P, POLL)
    # the next layer's qkv_proj and o_proj (the same shapes) while this one's down_proj runs
    _prefetch(next_qkv_ptr, next_o_ptr, wgu_ptr, wd_ptr, pid, P, H, NQKV, HQ * D, INTER,
              PREFETCH, 4)
    if PHASE == 0 or PHASE == 6:
        down(part5_ptr, S5, wd_ptr, s_d_n, s_d_k, ws_d, part6_ptr, pid, P, T, H // BN, S6, H,
             INTER, _BK, dtype, W_SCALE, PRECISION)
    if CARRY_OUT == 0:  # else the next layer adds down_proj's partials (its XPART)
        if PHASE == 0:
            grid_sync(bar_ptr, P, POLL)
        if PHASE == 0 or PHASE == 7:
            residual(part6_ptr, S6, resid2_ptr, out_ptr, pid, P, T, H)


@triton.jit
def _prefetch(wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, pid, P, H: tl.constexpr, NQKV: tl.constexpr,
              QD: tl.constexpr, INTER: tl.constexpr, PREFETCH: tl.constexpr,
              AT: tl.constexpr):
    """The prefetches _decode_layer_kernel's PREFETCH puts at point AT: 0 before the PDL wait,
    1 after it, 2 at attention, 3 at o_proj, 4 at down_proj (where wqkv_ptr and wo_ptr are the
    next layer's)."""
    MODE: tl.constexpr = PREFETCH % 4
    ON: tl.constexpr = PREFETCH // 4  # a bit a weight, qkv_proj's first
    # where each weight's prefetch goes in each MODE
    QKV_AT: tl.constexpr = 1 if MODE == 1 else 0
    NEXT: tl.constexpr = (MODE == 3) & (AT == 4)  # the next layer's, a layer ahead
    GATE_UP_AT: tl.constexpr = 1 if MODE == 1 else 0 if MODE == 2 else 2
    DOWN_AT: tl.constexpr = 1 if MODE == 1 else 0 if MODE == 2 else 3
    ENABLED: tl.constexpr = MODE > 0
    prefetch_share(wqkv_ptr, NQKV * H, pid, P, ENABLED & ((AT == QKV_AT) | NEXT)
                   & (ON % 2 == 1))
    prefetch_share(wo_ptr, H * QD, pid, P, ENABLED & ((AT == QKV_AT) | NEXT)
                   & (ON // 2 % 2 == 1))
    prefetch_share(wgu_ptr, 2 * INTER * H, pid, P, ENABLED & (AT == GATE_UP_AT)
                   & (ON // 4 % 2 == 1))
    prefetch_share(wd_ptr, H * INTER, pid, P, ENABLED & (AT == DOWN_AT) & (ON // 8 % 2 == 1))


@dataclass
class LayerWeights:
    """One dense layer's weights, nn.Linear's shapes ([out, in]) in any strides."""

    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(HQ + 2 HKV) D, H]: q, k, v heads
    q_norm: torch.Tensor | None  # [D] (Qwen3), or None (Llama)
    k_norm: torch.Tensor | None
    o: torch.Tensor  # [H, HQ D]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H]: gate rows, then up rows
    down: torch.Tensor  # [H, I]
    eps: float
    # FP8 weights (W8A16, kernels.linear.fused_fp8): the scales of qkv, o, gate_up and down,
    # per channel ([N, 1]) or per block of `block` (rows, cols); None: 16-bit weights
    scales: tuple[torch.Tensor, ...] | None = None
    block: tuple[int, int] | None = None

    def scale_args(self) -> tuple[list, int]:
        """Each weight's (scales, row stride, rows a scale row) in kernel order, and W_SCALE."""
        weights = (self.qkv, self.o, self.gate_up, self.down)
        scales = self.scales or (None,) * 4
        args = [scale_args(w, s, self.block) for w, s in zip(weights, scales)]
        return [a for arg in args for a in arg[:3]], args[0][3]


def fits_layer(num_heads: int, num_kv_heads: int, head_dim: int, hidden_size: int,
               intermediate_size: int) -> bool:
    """Whether the kernel takes a layer of these sizes (its tiles: 128-wide K steps, 64-row
    output tiles, 128-wide residual chunks, a head a K step of o_proj)."""
    return (head_dim in (64, 128) and num_heads % num_kv_heads == 0
            and hidden_size % BK == 0 and intermediate_size % BK == 0)


def _fitting(weights: tuple[torch.Tensor, ...], budget: int = L2_PREFETCH_BYTES) -> int:
    """Bits of the weights that fit the L2 budget, taken in order (the rest are left to their
    pipelines: asking for more than L2 holds evicts what was asked for first)."""
    bits = 0
    for i, w in enumerate(weights):
        size = w.numel() * w.element_size()
        if size <= budget:
            bits, budget = bits | 1 << i, budget - size
    return bits


def _pow2_splits(items: int, programs: int, k_steps: int) -> int:
    """K splits (a power of two dividing k_steps) that bring `items` tiles nearest to one item a
    program without exceeding it."""
    splits = 1
    while items * splits * 2 <= programs and k_steps % (splits * 2) == 0:
        splits *= 2
    return splits


class PersistentDecodeLayer:
    """Scratch and launch configuration of _decode_layer_kernel for one shape and device."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, hidden_size: int,
                 intermediate_size: int, dtype: torch.dtype, device: torch.device,
                 programs: int | None = None, num_warps: int = 8, num_stages: int = 3,
                 fuse_max_tokens: int = 2):
        # 8 warps, 3 stages: ~190 registers a thread at 0.6B's shape in bf16 (~220 in FP8) and
        # 119 KB of shared memory, one program an SM. fuse_max_tokens 2: a lone sequence
        # replays the CUDA graph of 2 (runner.cuda_graphs), and a padding row reads nothing.
        self.num_warps, self.num_stages = num_warps, num_stages
        self.fuse_max_tokens = fuse_max_tokens  # __call__ says what fuses
        self.hq, self.hkv, self.d = num_heads, num_kv_heads, head_dim
        self.h, self.i = hidden_size, intermediate_size
        # one an SM; off CUDA (the interpreter runs them in turn) 3, so items wrap around
        self.programs = programs or num_sms(device) or 3
        assert self.programs >= 2 and fits_layer(num_heads, num_kv_heads, head_dim, hidden_size,
                                                 intermediate_size)
        nqkv = (num_heads + 2 * num_kv_heads) * head_dim
        p = self.programs
        self.s1 = _pow2_splits(nqkv // ROWS, p, hidden_size // BK)
        self.s3 = _pow2_splits(hidden_size // ROWS, p, num_heads)
        # a gate_up item is a tile of gate rows with the same tile of up rows
        self.s5 = _pow2_splits(intermediate_size // ROWS, p, hidden_size // BK)
        self.s6 = _pow2_splits(hidden_size // ROWS, p, intermediate_size // BK)
        f32 = dict(dtype=torch.float32, device=device)
        t = MAX_TOKENS
        self.part1 = torch.empty(self.s1, t, nqkv, **f32)
        self.q = torch.empty(t, num_heads, head_dim, dtype=dtype, device=device)
        self.m = torch.empty(t, num_heads, _MAX_SPLITS, **f32)
        self.l = torch.empty_like(self.m)
        self.acc = torch.empty(t, num_heads, _MAX_SPLITS, head_dim, **f32)
        self.part3 = torch.empty(self.s3, t, hidden_size, **f32)
        self.xin = torch.empty(t, hidden_size, dtype=dtype, device=device)  # x + partials
        self.resid2 = torch.empty(t, hidden_size, dtype=dtype, device=device)
        self.part5 = torch.empty(self.s5, t, 2 * intermediate_size, **f32)
        self.part6 = torch.empty(self.s6, t, hidden_size, **f32)
        self.barrier = torch.zeros(1, dtype=torch.int32, device=device)

    def attention_splits(self, num_tokens: int, max_context: int) -> int:
        """Splits of each (token, kv head)'s context: at most one item a program (more would
        give some programs two whole splits), each >= 64 keys (from shapes only: CUDA-graph
        safe)."""
        by_programs = self.programs // (num_tokens * self.hkv)
        return max(1, min(by_programs, triton.cdiv(max_context, 64), _MAX_SPLITS))

    def __call__(self, x: torch.Tensor, w: LayerWeights, cos_sin: torch.Tensor,
                 positions: torch.Tensor, slot_mapping: torch.Tensor, context_lens: torch.Tensor,
                 block_tables: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 scale: float, x_partials: bool = False, carry_out: bool = False,
                 next_layer: LayerWeights | None = None, prefetch: int = 3, poll: int = 1,
                 phase: int = 0) -> torch.Tensor:
        """The layer's output [T, H] for x [T, H] (T <= 16 tokens, one a sequence); the tokens'
        K/V are written to the cache ([blocks, block_size, HKV, D]) at slot_mapping.

        Up to fuse_max_tokens tokens (where re-reading partials costs less than a barrier),
        each program adds o_proj's partials to the residual itself, and the layers may carry
        down_proj's partials over: with carry_out the output is x + attention (a buffer the
        next call overwrites) and down_proj's partials wait in scratch for the next layer's
        call, with x_partials, to add (two barriers fewer a layer). next_layer: the weights
        whose qkv_proj and o_proj to ask L2 for while this layer's down_proj runs."""
        num_tokens = x.shape[0]
        fuse = num_tokens <= self.fuse_max_tokens
        assert 1 <= num_tokens <= MAX_TOKENS and x.is_contiguous() and cos_sin.is_contiguous()
        assert cos_sin.shape[1] == self.d and k_cache.is_contiguous() and v_cache.is_contiguous()
        assert fuse or not (x_partials or carry_out), "carrying partials needs fuse"
        block_size = k_cache.shape[1]
        out = self.resid2[:num_tokens] if carry_out else torch.empty_like(x)
        ns = self.attention_splits(num_tokens, block_tables.shape[1] * block_size)
        interpret = triton.knobs.runtime.interpret
        res = self.xin if x_partials else x
        norms = (w.q_norm, w.k_norm) if w.q_norm is not None else (w.input_norm,) * 2
        scales, w_scale = w.scale_args()
        args = (x, self.xin, res, res if fuse else self.resid2, out, w.input_norm, w.qkv,
                *w.qkv.stride(), *norms, w.o, *w.o.stride(), w.post_norm, w.gate_up,
                *w.gate_up.stride(), w.down, *w.down.stride(), (next_layer or w).qkv,
                (next_layer or w).o, cos_sin, positions, slot_mapping,
                k_cache, v_cache, context_lens, block_tables, block_tables.stride(0), self.part1,
                self.q, self.m, self.l, self.acc, self.part3, self.resid2, self.part5,
                self.part6, self.barrier, *scales, self.programs, num_tokens, w.eps,
                scale * LOG2E, ns,
                int(x_partials), int(fuse), int(carry_out))
        consts = dict(S1=self.s1, S3=self.s3, S5=self.s5, S6=self.s6, H=self.h, HQ=self.hq,
                      HKV=self.hkv, G_P2=max(16, triton.next_power_of_2(self.hq // self.hkv)),
                      D=self.d, INTER=self.i, BLOCK_SIZE=block_size,
                      BLOCK_N=min(64, block_size), NORM=w.q_norm is not None,
                      PRECISION=prefill.dot_precision(x.dtype),
                      W_SCALE=w_scale, PREFETCH=0 if interpret else prefetch + 4 * _fitting(
                          (w.qkv, w.o, w.gate_up, w.down)), POLL=poll,
                      num_warps=self.num_warps, num_stages=self.num_stages)
        # Under the interpreter each phase is a launch (a phase's items are independent);
        # phase n > 0 runs that phase alone (a benchmark's timing: its output is not the layer's)
        for p in (range(1, PHASES + 1) if interpret and not phase else (phase,)):
            _decode_layer_kernel[(self.programs,)](*args, PHASE=p, **consts, **launch_options())
        return out

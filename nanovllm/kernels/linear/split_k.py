"""o_proj and down_proj of a decode step, split over K (kernels.linear.fused's family): float32
partials that the add + RMSNorm after them sums in a fixed order (kernels.fused_ops). Their
1,024 output rows alone would give a swap-AB GEMM 16 programs; splitting K gives 128-256. 16-bit
weights are read k-major, FP8 codes [N, K] row-major (W8A16, kernels.linear.fused_fp8); LoRA
slots add their delta per split (kernels.linear.lora)."""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm.kernels.attention.decode_reduce import MERGE_ROWS_CHUNK, merged_rows
from nanovllm.kernels.attention.kv_quant import FP8_DTYPE
from nanovllm.kernels.attention.pending_merge import PendingMerge
from nanovllm.kernels.linear.fused_fp8 import (
    K_STEP,
    TILE_ROWS,
    Block,
    channel_scaled,
    channel_scales,
    fits_weight,
    num_sms,
    resident_stages,
    scale_args,
    scaled_dot,
    weight_stages,
)
from nanovllm.kernels.linear.gemv_partials import gemv_partials, runs_gemv
from nanovllm.kernels.linear.lora import LoRASlots, add_lora, fused_lora_args, lora_keep
from nanovllm.kernels.pdl import (
    PREFETCH_STEPS,
    launch_options,
    prefetch_tile,
    prefetches,
    wait_then_release,
)

ROWS = TILE_ROWS  # output columns per MMA tile


@triton.jit
def _prefetch_weight(w_ptr, n0, k0, k_end, N, stride_w, K_MAJOR: tl.constexpr,
                     BLOCK_K: tl.constexpr, ELEM_BYTES: tl.constexpr, PREFETCH: tl.constexpr):
    """pdl.prefetch_tile of a program's first weight tiles (within its split, k0:k_end), as
    the weight is stored."""
    if K_MAJOR:  # [K, N]: a tile is BLOCK_K rows of 64 columns
        prefetch_tile(w_ptr, k0, n0, stride_w, k_end, N, PREFETCH_STEPS * BLOCK_K,
                      64 * ELEM_BYTES, ELEM_BYTES, PREFETCH)
    else:  # [N, K]: 64 rows of BLOCK_K columns
        prefetch_tile(w_ptr, n0, k0, stride_w, N, k_end, 64,
                      PREFETCH_STEPS * BLOCK_K * ELEM_BYTES, ELEM_BYTES, PREFETCH)


@triton.jit
def _x_tile(x_desc, tok0, k, M, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, num_heads,
            num_splits, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, MERGE: tl.constexpr):
    """x[tok0.., k..] as [BLOCK_K, BLOCK_T]: by TMA, or with MERGE (BLOCK_K == HEAD_DIM) the
    head at k merged from the decode's splits, rounded to out_ptr's dtype."""
    if MERGE:
        x = merged_rows(part_m_ptr, part_l_ptr, part_acc_ptr, tok0, k // BLOCK_K, M, num_heads,
                        num_splits, out_ptr.dtype.element_ty, BLOCK_T, BLOCK_K,
                        MERGE_ROWS_CHUNK)
    else:
        x = x_desc.load([tok0, k])
    return x.T


@triton.jit(do_not_specialize=["M", "num_splits"])
def _split_k_kernel(w_desc, x_desc, part_ptr, M, N, K_SPLIT, s_ptr, stride_s, scale_rows,
                    a_desc, b_desc, lora_slots_ptr, w_ptr, stride_w, out_ptr, part_m_ptr,
                    part_l_ptr, part_acc_ptr, num_heads, num_splits, BLOCK_T: tl.constexpr,
                    BLOCK_K: tl.constexpr, STAGES: tl.constexpr, USE_PDL: tl.constexpr,
                    K_MAJOR: tl.constexpr, W_SCALE: tl.constexpr, LORA_K: tl.constexpr,
                    RANK: tl.constexpr, ELEM_BYTES: tl.constexpr, PREFETCH: tl.constexpr,
                    MERGE: tl.constexpr):
    """Grid (N / 64, splits, token tiles): part[split] = x[:, ks] @ W[:, ks].T (ks: the split's
    K_SPLIT columns) for 64 output columns of BLOCK_T tokens; W stored k-major ([K, N]) when
    K_MAJOR (16-bit weights), else [N, K] (FP8 codes, scaled as _pair_gemm's). With LoRA each
    split adds B @ its own part of the shrink: B and the slot mask are linear, so the partials
    still sum to the delta (rounded per split, not once). With PREFETCH its first weight
    tiles are asked of L2 before the wait (w_ptr, the weight as stored, rows stride_w apart).
    MERGE: x is a decode's output left as num_splits softmax partials (part_m, part_l,
    part_acc of num_heads heads), each K step one head, which the program merges itself and
    rounds to out's dtype: the merge needs no launch of its own (x_desc and out: the output's,
    never read)."""
    pid_n, split, pid_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n0, tok0, k0 = pid_n * 64, pid_t * BLOCK_T, split * K_SPLIT
    _prefetch_weight(w_ptr, n0, k0, k0 + K_SPLIT, N, stride_w, K_MAJOR, BLOCK_K, ELEM_BYTES,
                     PREFETCH)
    wait_then_release(USE_PDL)
    s_row = s_ptr + n0 // scale_rows * stride_s
    scale = channel_scales(s_row, W_SCALE)
    acc = tl.zeros([64, BLOCK_T], tl.float32)  # ROWS
    shrunk = tl.zeros([64, BLOCK_T], tl.float32)
    if LORA_K > 0:  # requested before the K loop, as in _pair_gemm
        keep = lora_keep(lora_slots_ptr, tok0, M, LORA_K, RANK, BLOCK_T)
        b = b_desc.load([n0, 0])
    for k in tl.range(k0, k0 + K_SPLIT, BLOCK_K, num_stages=STAGES):
        if K_MAJOR:
            w = w_desc.load([k, n0]).T
        else:
            w = w_desc.load([n0, k])
        x = _x_tile(x_desc, tok0, k, M, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
                    num_heads, num_splits, BLOCK_T, BLOCK_K, MERGE)
        acc = scaled_dot(w, x, acc, s_row, k, BLOCK_K, W_SCALE)
        if LORA_K > 0:
            shrunk = tl.dot(a_desc.load([0, k]), x, shrunk)
    acc = channel_scaled(acc, scale, W_SCALE)
    if LORA_K > 0:
        acc = add_lora(acc, shrunk, b, keep)
    cols = n0 + tl.arange(0, 64)[:, None]
    toks = tok0 + tl.arange(0, BLOCK_T)[None, :]
    tl.store(part_ptr + (split * M + toks).to(tl.int64) * N + cols, acc, mask=toks < M)


@triton.jit
def _sum_partials_kernel(part_ptr, bias_ptr, out_ptr, N, stride_s, stride_m,
                         SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    """Grid (M, N / BLOCK): out = sum of the splits in order (+ bias), rounded once."""
    wait_then_release(USE_PDL)
    row, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], tl.float32)
    for split in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + split * stride_s + row * stride_m + cols, mask=mask,
                       other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + row * N + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_partials(part: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """Split partials [S, M, N] (split_k_linear's, w8a8_swap's; any strides but a unit last
    one, any dtype) summed in float32 (+ bias) into [M, N] of dtype in one PDL launch: torch's
    sum and cast were two launches that waited for split-K to end."""
    splits, num_tokens, output_size = part.shape
    assert part.stride(2) == 1
    out = torch.empty(num_tokens, output_size, dtype=dtype, device=part.device)
    block = min(1024, triton.next_power_of_2(output_size))
    if num_tokens:
        _sum_partials_kernel[(num_tokens, triton.cdiv(output_size, block))](
            part, part if bias is None else bias, out, output_size, part.stride(0),
            part.stride(1), SPLITS=splits, HAS_BIAS=bias is not None, BLOCK=block,
            **launch_options())
    return out


def fits_split_k(input_size: int, output_size: int, dtype: torch.dtype,
                 weight_dtype: torch.dtype | None = None, w_block: Block = None) -> bool:
    """Whether split_k_linear takes these sizes."""
    return fits_weight(dtype, weight_dtype or dtype, w_block) and output_size % ROWS == 0 \
        and input_size % K_STEP == 0


def _num_splits(output_size: int, input_size: int, token_tiles: int, num_tokens: int) -> int:
    """Splits of K that give >= 128 programs (256 up to 16 tokens), at most 16, each split
    a whole number of 128-wide K tiles (the split_k_gemm probe's sweep, docs/design.md)."""
    target = 256 if num_tokens <= 16 else 128
    splits = min(16, triton.next_power_of_2(triton.cdiv(target, output_size // ROWS * token_tiles)))
    while input_size % (splits * K_STEP):
        splits //= 2
    return splits


def _stages(k_steps: int, num_tokens: int, lora: LoRASlots | None, weight: torch.Tensor,
            programs: int, sms: int) -> int:
    """Pipeline stages of a split's K loop: up to 16 tokens as many as keep all programs
    resident (fused._launch's rule). LoRA's A tiles make a stage 36 KB at 16 tokens: stages past
    the loop's own K steps then only cost programs per SM (measured: docs/lora.md)."""
    if lora is None:
        stages = weight_stages(num_tokens, weight)
        if num_tokens > 16:
            return stages
        stage = ROWS * K_STEP * weight.element_size() + 16 * K_STEP * 2  # a W tile + x
        return resident_stages(stages, programs, sms, stage)
    return min(3, k_steps + 1) if num_tokens <= 16 else 2


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, *, w_scale: torch.Tensor | None = None,
                   w_block: Block = None, lora: LoRASlots | None = None) -> torch.Tensor:
    """float32 partials [S, M, N] whose sum over S is x @ weight.T (plus its LoRA delta), for a
    16-bit weight [N, K] stored k-major (weight.t() contiguous, as RowParallelLinear keeps it)
    or FP8 codes [N, K] row-major with w_scale (as in qkv_rope_store): a decode step's o_proj
    or down_proj, whose splits the add + RMSNorm after it sums in a fixed order. One token
    without LoRA runs kernels.linear.gemv (CUDA cores, measured faster there). x may be a
    decode's PendingMerge (as gemv_partials or runs_merge_split_k take it), merged inside."""
    merge = x if isinstance(x, PendingMerge) else None
    assert merge is None or lora is None, "a PendingMerge's layer runs no LoRA"
    if merge is not None and merge.out.shape[0] == 1 \
            or merge is None and lora is None and runs_gemv(x, weight, w_scale, w_block):
        return gemv_partials(x, weight, w_scale)
    if merge is not None:  # runs_merge_split_k's: the descriptor's x is never read
        x = merge.out.flatten(1)
        assert runs_merge_split_k(x.shape[0], x.dtype, merge.out.shape[2], weight, w_block)
    num_tokens, input_size = x.shape
    output_size = weight.shape[0]
    k_major = weight.dtype != FP8_DTYPE
    assert fits_split_k(input_size, output_size, x.dtype, weight.dtype, w_block)
    stored = weight.t() if k_major else weight
    assert stored.is_contiguous() and x.stride(1) == 1 and weight.shape[1] == input_size
    block_t = 16 if num_tokens <= 16 else 64 if num_tokens <= 128 else 128
    tiles = triton.cdiv(num_tokens, block_t)
    splits = _num_splits(output_size, input_size, tiles, num_tokens)
    part = torch.empty(splits, num_tokens, output_size, dtype=torch.float32, device=x.device)
    scales = scale_args(weight, w_scale, w_block)
    grid = (output_size // ROWS, splits, tiles)
    stages = _stages(input_size // splits // K_STEP, num_tokens, lora, weight,
                     grid[0] * splits * tiles, num_sms(x.device))
    _split_k_kernel[grid](
        TensorDescriptor.from_tensor(stored, [K_STEP, ROWS] if k_major else [ROWS, K_STEP]),
        TensorDescriptor.from_tensor(x, [block_t, K_STEP]), part, num_tokens, output_size,
        input_size // splits, *scales[:3], **fused_lora_args(lora, K_STEP), w_ptr=stored,
        stride_w=stored.stride(0), out_ptr=x, **_merge_args(merge), BLOCK_T=block_t,
        BLOCK_K=K_STEP, STAGES=stages, K_MAJOR=k_major, W_SCALE=scales[3],
        ELEM_BYTES=weight.element_size(), PREFETCH=prefetches(block_t),
        MERGE=merge is not None, num_warps=4, **launch_options())
    return part


def _merge_args(merge: PendingMerge | None) -> dict:
    """_split_k_kernel's arguments of a PendingMerge (none: placeholders, never read)."""
    if merge is None:
        return dict(part_m_ptr=None, part_l_ptr=None, part_acc_ptr=None, num_heads=1,
                    num_splits=1)
    _, num_heads, num_splits, _ = merge.part_acc.shape
    return dict(part_m_ptr=merge.part_m, part_l_ptr=merge.part_l, part_acc_ptr=merge.part_acc,
                num_heads=num_heads, num_splits=num_splits)


def runs_merge_split_k(num_tokens: int, x_dtype: torch.dtype, head_dim: int,
                       weight: torch.Tensor, w_block: Block = None) -> bool:
    """Whether split_k_linear takes a PendingMerge of 2-16 tokens of x_dtype heads of head_dim:
    each program's split of K one head, one K step (a merge's loads inside the K loop are not
    pipelined across steps, so longer splits would wait for each)."""
    n, k = weight.shape
    return 1 < num_tokens <= 16 and head_dim == K_STEP \
        and fits_split_k(k, n, x_dtype, weight.dtype, w_block) \
        and k // _num_splits(n, k, 1, num_tokens) == K_STEP

"""vLLM's moe_sum: each token's top-k expert outputs (weighted by the down GEMM) summed in one
launch, float32 in k order, rounded once (torch's sum over k ran a generic reduction)."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import launch_options, wait_then_release


@triton.jit
def _moe_sum_kernel(slots_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                    USE_PDL: tl.constexpr):
    """Grid (tokens, cdiv(hidden, BLOCK)): out[t, cols] = sum_k slots[t * TOP_K + k, cols]."""
    wait_then_release(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(slots_ptr + (token * TOP_K + k) * hidden + cols, mask=mask,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_sum(slots: torch.Tensor, top_k: int) -> torch.Tensor:
    """[M * top_k, H] slot outputs (token-major) summed over each token's top_k rows: [M, H]."""
    num_slots, hidden = slots.shape
    assert slots.is_contiguous() and num_slots % top_k == 0, (slots.shape, top_k)
    out = torch.empty(num_slots // top_k, hidden, dtype=slots.dtype, device=slots.device)
    block = min(1024, triton.next_power_of_2(hidden))
    if num_slots:
        _moe_sum_kernel[(num_slots // top_k, triton.cdiv(hidden, block))](
            slots, out, hidden, TOP_K=top_k, BLOCK=block, **launch_options())
    return out

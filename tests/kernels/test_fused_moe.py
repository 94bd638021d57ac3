"""The fused Triton MoE kernel vs the torch loop over experts (TRITON_INTERPRET on CPU), and the
grouping of slots by expert it relies on."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402

from nanovllm.kernels.moe import fused_moe as fused_moe_module  # noqa: E402
from nanovllm.kernels.moe.fused_moe import fused_moe, moe_align_block_size  # noqa: E402
from nanovllm.kernels.moe.reference import fused_moe_torch  # noqa: E402
from nanovllm.kernels.moe.reference import select_experts_torch as select_experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype = torch.float32,
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * inter ** -0.5
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def _routing(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return select_experts(logits.to(DEVICE), top_k, renormalize=True)


def moe_align_block_size_torch(topk_ids: torch.Tensor, num_experts: int,
                               block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels.moe.fused_moe.moe_align_block_size in torch (slots in order within a group)."""
    flat = topk_ids.flatten().long()
    num_slots = flat.numel()
    # at most min(E, slots) groups, each padded by < block_m rows
    max_padded = num_slots + min(num_experts, num_slots) * (block_m - 1)
    max_padded = -(-max_padded // block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded_end = torch.cumsum((counts + block_m - 1) // block_m * block_m, 0)
    padded_start = padded_end - (counts + block_m - 1) // block_m * block_m
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(num_slots, device=flat.device) - (torch.cumsum(counts, 0) - counts)[
        sorted_experts]
    sorted_ids = torch.full((max_padded,), num_slots, dtype=torch.int32, device=flat.device)
    sorted_ids.scatter_(0, padded_start[sorted_experts] + rank, order.int())
    block_starts = torch.arange(0, max_padded, block_m, device=flat.device)
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True)
    expert_ids = expert_ids.clamp_(max=num_experts - 1).int()  # blocks past the end: unused
    return sorted_ids, expert_ids, padded_end[-1:].int()


# (tokens, experts, top_k, hidden, intermediate): batch 1; sizes off the 64-wide tiles
SHAPES = [(1, 8, 2, 64, 32), (7, 16, 4, 96, 80), (40, 8, 3, 72, 48)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_reference(shape):
    tokens, experts, top_k, hidden, inter = shape
    w13, w2 = _experts(experts, hidden, inter)
    x = torch.randn(tokens, hidden, device=DEVICE)
    weights, ids = _routing(torch.randn(tokens, experts), top_k)
    ref = fused_moe_torch(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), ref, atol=1e-5, rtol=1e-5)


def test_imbalanced_routing_with_idle_experts():
    """Most tokens pick experts 0 and 5, experts 1-4 and 6 get none, expert 7 a single token;
    expert 0's group spans several row blocks."""
    tokens, experts, top_k, hidden, inter = 70, 8, 2, 64, 32
    w13, w2 = _experts(experts, hidden, inter, seed=1)
    logits = torch.full((tokens, experts), -10.0)
    logits[:, 0], logits[:, 5] = 5.0, 4.0 + torch.rand(tokens)
    logits[3, 7] = 20.0
    weights, ids = _routing(logits, top_k)
    assert set(ids.flatten().tolist()) == {0, 5, 7}
    x = torch.randn(tokens, hidden, device=DEVICE)
    ref = fused_moe_torch(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), ref, atol=1e-5, rtol=1e-5)


def test_align_groups_every_slot_once_padded_per_expert():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2]], device=DEVICE)
    sorted_ids, expert_ids, num_padded = moe_align_block_size(ids, num_experts=5, block_m=4)
    num_slots, flat = ids.numel(), ids.flatten().tolist()
    # experts 0 (2 slots), 1, 2 (1 each), 3 (3 slots) -> 4 groups of 4 rows; expert 4 none
    assert int(num_padded) == 16
    assert sorted_ids.numel() >= 16 and sorted_ids.numel() % 4 == 0
    used = sorted_ids[:16].view(4, 4).tolist()
    assert expert_ids[:4].tolist() == [0, 1, 2, 3]
    for expert, block in zip([0, 1, 2, 3], used):
        real = [s for s in block if s < num_slots]
        assert all(flat[s] == expert for s in real)
        assert block[len(real):] == [num_slots] * (4 - len(real))
    assert sorted(s for s in sorted_ids.tolist() if s < num_slots) == list(range(num_slots))


@pytest.mark.parametrize("one_program", [True, False], ids=["one-program", "three-kernels"])
@pytest.mark.parametrize("tokens, experts, top_k, block_m", [(1, 8, 2, 16), (300, 64, 6, 32),
                                                             (77, 5, 5, 64), (128, 128, 8, 16)])
def test_align_matches_the_torch_grouping(tokens, experts, top_k, block_m, one_program,
                                          monkeypatch):
    """Same slots per expert (as sets: the three kernels' order within an expert's blocks is
    arbitrary, on a GPU even across them; the one-program grouping keeps slot order, as the
    reference), same experts per live block, same padded total."""
    monkeypatch.setattr(fused_moe_module, "ONE_PROGRAM_SLOTS", 1 << 30 if one_program else 0)
    g = torch.Generator().manual_seed(tokens)
    ids = torch.rand(tokens, experts, generator=g).pow(3).topk(top_k).indices.to(DEVICE)
    got = moe_align_block_size(ids, experts, block_m)
    ref = moe_align_block_size_torch(ids, experts, block_m)
    num_padded = int(ref[2])
    assert int(got[2]) == num_padded and got[0].numel() == ref[0].numel()
    live = num_padded // block_m
    assert got[1][:live].tolist() == ref[1][:live].tolist()

    def slots_of(sorted_ids: torch.Tensor, expert_ids: torch.Tensor, expert: int) -> list:
        blocks = sorted_ids[:num_padded].view(live, block_m)[expert_ids[:live] == expert]
        return sorted(blocks.flatten().tolist())

    for expert in range(experts):
        assert slots_of(*got[:2], expert) == slots_of(*ref[:2], expert), expert
    if one_program:
        assert torch.equal(got[0][:num_padded], ref[0][:num_padded])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 256, 2048])
def test_bfloat16_error_at_qwen3_30b_a3b_shape(tokens):
    """bf16 kernel vs the float32 reference on the same bf16 weights, beside the bf16 torch
    loop's own error: the kernel must be no less accurate (within 1.5x)."""
    experts, top_k, hidden, inter = 128, 8, 2048, 768
    w13, w2 = _experts(experts, hidden, inter, torch.bfloat16, seed=2)
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = _routing(torch.randn(tokens, experts), top_k)
    exact = fused_moe_torch(x.float(), w13.float(), w2.float(), weights.float(), ids)
    kernel_err = (fused_moe(x, w13, w2, weights.bfloat16(), ids).float() - exact).abs().max()
    torch_err = (fused_moe_torch(x, w13, w2, weights.bfloat16(), ids).float() - exact).abs()
    print(f"bf16 fused MoE, {tokens} tokens: max abs error {kernel_err:.3e} "
          f"(torch loop {torch_err.max():.3e}, output scale {exact.abs().max():.3e})")
    assert kernel_err <= 1.5 * torch_err.max() + 1e-3


@pytest.mark.gpu
def test_kernel_replays_in_a_cuda_graph_with_new_routing():
    """Captured once, replayed with other routings (all tokens on one expert, then spread):
    no host sync, and the shape-bound padding suffices for any routing."""
    tokens, experts, top_k, hidden, inter = 8, 16, 4, 128, 96
    w13, w2 = _experts(experts, hidden, inter, seed=3)
    x = torch.randn(tokens, hidden, device=DEVICE)
    weights, ids = _routing(torch.randn(tokens, experts), top_k)
    fused_moe(x, w13, w2, weights, ids)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    skewed = torch.full((tokens, experts), -10.0)
    skewed[:, :top_k] = torch.arange(top_k, 0, -1.0)
    for logits in (skewed, torch.randn(tokens, experts)):
        new_weights, new_ids = _routing(logits, top_k)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        x.copy_(torch.randn(tokens, hidden, device=DEVICE))
        graph.replay()
        torch.testing.assert_close(out, fused_moe_torch(x, w13, w2, weights, ids),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block", [(32, 32), (16, 32), None])
def test_fp8_experts_match_the_torch_reference(block, monkeypatch):
    """Block-scaled (Qwen3-30B-A3B-FP8) and per-channel FP8 experts: the kernel quantizes x and
    h per token group and scales each K step, as fused_moe_torch simulates. The activation
    quantization kernel is tested in test_fp8_gemm.py; on CPU the reference's stands in for it
    (the interpreter rounds a few codes wrongly, see there)."""
    from nanovllm.kernels.linear.fp8_reference import per_token_group_quant_torch, quantize_groups
    from nanovllm.kernels.moe import fused_moe as module
    if DEVICE == "cpu":
        monkeypatch.setattr(module, "per_token_group_quant", per_token_group_quant_torch)
    num_experts, hidden, inter = 4, 64, 32
    w13, w2 = _experts(num_experts, hidden, inter, seed=3)
    quantized = []
    for w in (w13, w2):
        groups = block or (1, w.shape[2])
        codes, scales = zip(*(quantize_groups(e.cpu(), *groups) for e in w))
        quantized += [torch.stack(codes).to(DEVICE), torch.stack(scales).to(DEVICE)]
    w13_q, w13_s, w2_q, w2_s = quantized
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, hidden, generator=g).to(DEVICE)
    weights, ids = _routing(torch.randn(7, num_experts, generator=g), 2)
    out = fused_moe(x, w13_q, w2_q, weights, ids, w13_s, w2_s, block)
    ref = fused_moe_torch(x, w13_q, w2_q, weights, ids, w13_s, w2_s, block)
    tol = dict(rtol=1e-3, atol=1e-3 * ref.abs().max().item())
    if DEVICE == "cuda":  # a rare code may round differently from torch's division
        tol = dict(rtol=0.05, atol=0.02 * ref.abs().max().item())
    torch.testing.assert_close(out, ref, **tol)
    wrong = fused_moe(x, w13_q, w2_q, weights, ids, w13_s.flip(1), w2_s.flip(1), block)
    assert not torch.allclose(wrong, ref, **tol)

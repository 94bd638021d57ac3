"""The RMSNorm computes the LoRA shrink of the projection it feeds (RMSNorm.feeds), and the
projection's fused decode kernel takes it for that norm's output only (TRITON_INTERPRET on CPU,
float16: the interpreter's TMA loads garble bf16)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402

from nanovllm.kernels.linear.lora import AHEAD_MAX_TOKENS  # noqa: E402
from nanovllm.layers.layernorm import RMSNorm  # noqa: E402
from nanovllm.layers.packed_linear import MergedColumnParallelLinear  # noqa: E402
from nanovllm.utils.context import Context, forward_context  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9, reason="TMA needs sm_90")


def _layers(hidden: int = 256, inter: int = 128):
    """A fused RMSNorm feeding a gate_up_proj with 4 rank-16 LoRA slots of random weights."""
    torch.manual_seed(0)
    proj = MergedColumnParallelLinear(hidden, [inter, inter]).to(DEVICE, torch.float16)
    proj.weight.data.normal_(0, hidden ** -0.5)
    proj.add_lora_slots(4, 16)
    proj.lora_a.normal_(0, hidden ** -0.5)
    proj.lora_b.normal_(0, 0.3)
    proj.lora_shrink = proj.lora_expand = object()  # bound: the layer has active slots
    proj.fused_decode_max_tokens = 64
    norm = RMSNorm(hidden).to(DEVICE, torch.float16)
    norm.fused, norm.feeds = True, (proj,)
    return norm, proj


@pytest.mark.parametrize("num_tokens", [1, AHEAD_MAX_TOKENS, AHEAD_MAX_TOKENS + 1])
def test_the_norm_hands_its_shrink_to_the_projection(num_tokens):
    norm, proj = _layers()
    x = torch.randn(num_tokens, 256, device=DEVICE, dtype=torch.float16)
    residual = torch.randn_like(x)
    slots = torch.arange(num_tokens, device=DEVICE, dtype=torch.int32) % 5 - 1
    ctx = Context(slot_mapping=torch.arange(num_tokens, device=DEVICE), lora_slots=slots)
    with forward_context(ctx):
        normed, _ = norm(x, residual)
        ahead = proj.take_lora_ahead(normed)
        assert (ahead is not None) == (num_tokens <= AHEAD_MAX_TOKENS)
        assert proj.take_lora_ahead(normed) is None  # taken once
        in_loop = proj.gate_up_silu(normed)  # nothing pending: the shrink in the K loop
        norm(x, residual)
        assert proj.take_lora_ahead(normed) is None  # computed for another tensor
        normed, _ = norm(x, residual)
        got = proj.gate_up_silu(normed)  # takes what the norm computed, if anything
    assert proj.lora_ahead is None
    torch.testing.assert_close(got, in_loop, atol=2e-2, rtol=2e-2)


def test_no_shrink_ahead_in_prefill_or_without_adapters():
    norm, proj = _layers()
    x = torch.randn(4, 256, device=DEVICE, dtype=torch.float16)
    slots = torch.zeros(4, device=DEVICE, dtype=torch.int32)
    for ctx in (Context(is_prefill=True, slot_mapping=torch.arange(4), lora_slots=slots),
                Context(slot_mapping=torch.arange(4, device=DEVICE))):
        with forward_context(ctx):
            norm(x, torch.randn_like(x))
        assert proj.lora_ahead is None

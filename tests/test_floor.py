"""Named bench shapes load as configs, and the floor counts exactly the weights our model has."""
import pytest
import torch

from benchmarks.floor import floor, matmul_params
from benchmarks.shapes import SHAPES, write_shape
from nanovllm.config import read_config_json
from nanovllm.models.registry import build_model


@pytest.mark.parametrize("name", list(SHAPES))
def test_shape_weights_as_counted(name, tmp_path):
    config = read_config_json(write_shape(name, str(tmp_path)))
    with torch.device("meta"):
        model = build_model(config)
    params = sum(p.numel() for p in model.parameters())  # a tied head is counted once
    if not config.tie_word_embeddings:
        params -= model.model.embed_tokens.weight.numel()  # a lookup reads a few rows only
    assert matmul_params(SHAPES[name]) == params


def test_qwen3_floor_as_published():
    """BENCHMARK.md's Qwen3-0.6B floor on the H200: 35,673 tok/s."""
    assert round(floor(SHAPES["qwen3-0.6b"], 4.27e12, 793e12)["tok_s"]) == 35673


def test_moe_step_reads_only_the_routed_experts():
    """Batch 1 reads 8 of 128 experts per layer; batch 256 nearly all; the rest always."""
    from benchmarks.floor import active_params, expert_params, step_params
    shape = SHAPES["qwen3-30b-a3b"]
    experts = 48 * expert_params(shape)  # one expert in every layer
    assert active_params(shape) == matmul_params(shape) - 120 * experts
    assert step_params(shape, 1) == pytest.approx(active_params(shape))
    assert 127.9 * experts < step_params(shape, 256) - active_params(shape) + 8 * experts \
        <= 128 * experts


def test_fp8_weights_floor():
    """FP8 weights: the layers' bytes halve, the bf16 LM head's do not; prefill's matmuls run
    at twice the rate; the K/V stays, so the workload's bound gains less than 2x."""
    from benchmarks.floor import step_params, weight_bytes
    shape = SHAPES["llama-3.1-8b"]
    head = shape["vocab_size"] * shape["hidden_size"]
    assert weight_bytes(shape, 1) == 2 * step_params(shape, 1)
    assert weight_bytes(shape, 1, 1) == step_params(shape, 1) + head
    bf16, fp8 = floor(shape, 4.27e12, 793e12), floor(shape, 4.27e12, 793e12, 1)
    assert fp8["prefill_s"] == pytest.approx(bf16["prefill_s"] / 2, rel=0.02)
    assert bf16["decode_s"] - fp8["decode_s"] > 0
    assert 1.3 < fp8["tok_s"] / bf16["tok_s"] < 1.6

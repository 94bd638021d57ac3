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

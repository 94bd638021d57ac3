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

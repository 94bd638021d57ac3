"""Shared fixtures: tiny random Qwen3 checkpoints built once per test session."""
import pytest
import torch

from nanovllm.utils.checkpoint import build_checkpoint
from nanovllm.utils.context import reset_context

# name -> shape overrides of TINY_SHAPE; together they cover tied/untied embeddings,
# GQA ratios 1, 2 and 4, and head_dim 16..64.
CHECKPOINTS = {
    "untied_gqa2_d16": dict(),
    "tied_mha_d32": dict(tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=4,
                         head_dim=32, hidden_size=96),
    "untied_gqa4_d64": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                            hidden_size=128, num_hidden_layers=3),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Build every tiny checkpoint once; returns name -> directory."""
    root = tmp_path_factory.mktemp("ckpt")
    return {name: build_checkpoint(str(root / name), seed=i, **shape)
            for i, (name, shape) in enumerate(CHECKPOINTS.items())}


@pytest.fixture(scope="session")
def tiny_model(checkpoints) -> str:
    return checkpoints["untied_gqa2_d16"]


@pytest.fixture(autouse=True)
def _fresh_context():
    """No test sees another test's forward context."""
    reset_context()
    yield
    reset_context()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)

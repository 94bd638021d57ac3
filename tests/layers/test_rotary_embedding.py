"""Every RoPE variant's cos/sin cache equals transformers' (modeling_rope_utils) formulas."""
import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nanovllm.layers.rotary_embedding import RotaryEmbedding, rope_parameters

MAX_POS = 2048
VARIANTS = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "llama3": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64),
    "yarn": dict(rope_type="yarn", rope_theta=1e6, factor=4.0,
                 original_max_position_embeddings=512),
    "yarn_mscale": dict(rope_type="yarn", rope_theta=1e4, factor=8.0, mscale=0.7,
                        mscale_all_dim=1.0, beta_fast=16, beta_slow=2,
                        original_max_position_embeddings=256),
    "yarn_attention_factor": dict(rope_type="yarn", rope_theta=1e4, factor=2.0,
                                  attention_factor=1.3, original_max_position_embeddings=256),
}


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_cache_matches_transformers(name: str, head_dim: int) -> None:
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=MAX_POS, rope_parameters=dict(VARIANTS[name]))
    inv_freq, scale = ROPE_INIT_FUNCTIONS[VARIANTS[name]["rope_type"]](config, "cpu") \
        if name != "default" else (1.0 / (1e4 ** (torch.arange(0, head_dim, 2) / head_dim)), 1.0)
    freqs = torch.outer(torch.arange(MAX_POS, dtype=torch.float), inv_freq.float())
    expected = torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1)
    params = rope_parameters(dict(rope_parameters=dict(VARIANTS[name]),
                                  max_position_embeddings=MAX_POS))
    ours = RotaryEmbedding(head_dim, MAX_POS, params).cos_sin_cache.squeeze(1)
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-6)
    if name != "default":
        default = RotaryEmbedding(head_dim, MAX_POS, rope_parameters(
            dict(rope_theta=VARIANTS[name]["rope_theta"]))).cos_sin_cache.squeeze(1)
        assert not torch.allclose(ours, default), "the variant must change the cache"


def test_older_format_reads_the_same() -> None:
    """rope_theta + rope_scaling with `type` (transformers 4) means the same as rope_parameters."""
    old = dict(rope_theta=500000.0, max_position_embeddings=MAX_POS,
               rope_scaling=dict(type="llama3", factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=64))
    assert rope_parameters(old) == rope_parameters(dict(
        max_position_embeddings=MAX_POS, rope_parameters=VARIANTS["llama3"]))

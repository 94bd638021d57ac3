"""Qwen3 built from our layers; parameter names follow the HF checkpoint."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    divide,
    tp_rank_and_size,
)
from nanovllm.layers.rotary_embedding import RotaryEmbedding, rope_theta


class Qwen3Attention(nn.Module):
    """Self-attention with per-head q/k RMSNorm and RoPE."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        _, tp_size = tp_rank_and_size()
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        self.num_heads = divide(config.num_attention_heads, tp_size)
        self.num_kv_heads = divide(config.num_key_value_heads, tp_size)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim,
                                          config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size, bias=bias)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings,
                                          rope_theta(config))
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5,
                              self.num_kv_heads)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)      # (N, H, D)
        k = k.view(-1, self.num_kv_heads, self.head_dim)   # (N, Hkv, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if q.is_cuda:
            q, k = self.fused_norm_rope(positions, q, k, v)  # writes the K/V cache too
            o = self.attn(q, k, v, store_kv=False)
        else:
            q, k = self.rotary_emb(positions, self.q_norm(q), self.k_norm(k))
            o = self.attn(q, k, v)
        return self.o_proj(o.flatten(1, -1))

    def fused_norm_rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q/k norm, RoPE and the K/V cache write as one Triton kernel (one launch instead of
        four per layer in the decode graph)."""
        # Imported here: CPU-only runs never import Triton (as for the sampler's kernel).
        from nanovllm.kernels.qk_norm_rope import qk_norm_rope
        kv_store = self.attn.kv_store_args(v)
        return qk_norm_rope(q, k, positions, self.q_norm.weight, self.k_norm.weight,
                            self.rotary_emb.cos_sin_cache, self.q_norm.eps, kv_store)


class Qwen3MLP(nn.Module):
    """Gated SiLU MLP; gate and up projections share one GEMM."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size,
                                                       [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm block; the residual add is fused into the next RMSNorm."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.self_attn = Qwen3Attention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Qwen3Model(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Qwen3DecoderLayer(config)
                                     for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3ForCausalLM(nn.Module):
    """The model plus its LM head (tied to the embedding when the config says so)."""

    # checkpoint name fragment -> (our fused parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.model = Qwen3Model(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden_states)

"""The decoder shared by Qwen3, Qwen3-MoE, Qwen2, Llama and Mistral; parameter names follow HF
checkpoints.

The families differ only in the flags of a DecoderSpec (models/registry.py): biases, q/k norm,
sliding windows, the RoPE variant and which layers are sparse mixtures of experts.
"""
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.backends import (
    FUSED_GATE_UP_MAX_TOKENS,
    FUSED_QKV_MAX_TOKENS,
    decode_fuses,
)
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.fused_moe import SparseMoeBlock, expert_weight_target
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    divide,
    tp_rank_and_size,
)
from nanovllm.layers.rotary_embedding import RotaryEmbedding


@dataclass(frozen=True)
class MoeSpec:
    """Sparse layers' experts: a top-k router over num_experts gated MLPs."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    norm_topk_prob: bool  # renormalise the top-k weights to sum to one
    sparse_layers: tuple[bool, ...]  # per layer; False: a dense MLP of intermediate_size


@dataclass(frozen=True)
class DecoderSpec:
    """The flags by which the supported families' decoders differ."""

    head_dim: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (Qwen3)
    sliding_windows: tuple[int | None, ...]  # per layer; None: full causal attention
    rope: dict  # layers.rotary_embedding.rope_parameters(): rope_type, rope_theta, ...
    moe: MoeSpec | None = None


class DecoderAttention(nn.Module):
    """QKV projection, attention (RoPE, optional q/k norm and window inside), output projection."""

    def __init__(self, config: PretrainedConfig, spec: DecoderSpec, rotary_emb: RotaryEmbedding,
                 layer_idx: int):
        super().__init__()
        _, tp_size = tp_rank_and_size()
        head_dim = spec.head_dim
        self.num_heads = divide(config.num_attention_heads, tp_size)
        self.num_kv_heads = divide(config.num_key_value_heads, tp_size)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim,
                                          config.num_attention_heads,
                                          config.num_key_value_heads, bias=spec.qkv_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim,
                                        config.hidden_size, bias=spec.o_bias)
        self.attn = Attention(self.num_heads, head_dim, head_dim ** -0.5, self.num_kv_heads,
                              rotary_emb, config.rms_norm_eps if spec.qk_norm else None,
                              spec.sliding_windows[layer_idx])
        self.fused_decode = False  # set by layers.backends.bind_backend

    def can_fuse_decode(self) -> bool:
        """Whether kernels.fused_linear.qkv_rope_store takes this layer's sizes."""
        from nanovllm.kernels.fused_linear import fits_qkv
        weight = self.qkv_proj.weight
        return weight.is_contiguous() and fits_qkv(weight.shape[1], self.head_dim, weight.dtype)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if (self.fused_decode and decode_fuses(hidden_states.shape[0], FUSED_QKV_MAX_TOKENS)
                and self.attn.takes_projection()):
            o = self.attn.decode_projected(positions, hidden_states, self.qkv_proj)
            return self.o_proj(o.flatten(1, -1))
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)      # (N, H, D)
        k = k.view(-1, self.num_kv_heads, self.head_dim)   # (N, Hkv, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        o = self.attn(positions, q, k, v)
        return self.o_proj(o.flatten(1, -1))


class DecoderMLP(nn.Module):
    """Gated SiLU MLP; gate and up projections share one GEMM."""

    def __init__(self, config: PretrainedConfig, spec: DecoderSpec):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=spec.mlp_bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                           bias=spec.mlp_bias)
        self.act_fn = SiluAndMul()
        self.fused_decode = False  # set by layers.backends.bind_backend

    def can_fuse_decode(self) -> bool:
        """Whether kernels.fused_linear.gate_up_silu takes this layer's sizes."""
        from nanovllm.kernels.fused_linear import fits_gate_up
        weight = self.gate_up_proj.weight
        return weight.is_contiguous() and fits_gate_up(weight.shape[1], weight.shape[0] // 2,
                                                       weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_decode and decode_fuses(x.shape[0], FUSED_GATE_UP_MAX_TOKENS):
            from nanovllm.kernels.fused_linear import gate_up_silu
            return self.down_proj(gate_up_silu(x, self.gate_up_proj.weight,
                                               self.gate_up_proj.bias))
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual add is fused into the next RMSNorm. In decode steps o_proj and
    down_proj may return split-K partials (RowParallelLinear.split_k): every output of the
    attention and of the MLP goes to an add + RMSNorm, which sums them."""

    def __init__(self, config: PretrainedConfig, spec: DecoderSpec, rotary_emb: RotaryEmbedding,
                 layer_idx: int):
        super().__init__()
        self.self_attn = DecoderAttention(config, spec, rotary_emb, layer_idx)
        moe = spec.moe
        if moe is not None and moe.sparse_layers[layer_idx]:
            self.mlp = SparseMoeBlock(config.hidden_size, moe.num_experts, moe.top_k,
                                      moe.intermediate_size, moe.norm_topk_prob)
        else:
            self.mlp = DecoderMLP(config, spec)
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


class DecoderModel(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, config: PretrainedConfig, spec: DecoderSpec):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # one cos/sin cache for all layers (64 MiB at Llama 3.1's 131072 positions)
        rotary_emb = RotaryEmbedding(spec.head_dim, config.max_position_embeddings, spec.rope)
        self.layers = nn.ModuleList([DecoderLayer(config, spec, rotary_emb, i)
                                     for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DecoderForCausalLM(nn.Module):
    """The model plus its LM head (tied to the embedding when the config says so)."""

    # checkpoint name fragment -> (our fused parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # checkpoint name fragment -> ours: the q/k norms live inside the Attention layer
    renamed_modules = {"self_attn.q_norm.": "self_attn.attn.q_norm.",
                       "self_attn.k_norm.": "self_attn.attn.k_norm."}
    # checkpoint expert tensor -> (our stacked parameter, shard id, expert), checked first
    expert_weight = staticmethod(expert_weight_target)

    def __init__(self, config: PretrainedConfig, spec: DecoderSpec):
        super().__init__()
        self.model = DecoderModel(config, spec)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden_states)

"""The decoder shared by Qwen3, Qwen3-MoE, Qwen2, Llama and Mistral; parameter names follow HF
checkpoints.

The families differ only in the flags of a DecoderSpec (models/registry.py): biases, q/k norm,
sliding windows, the RoPE variant and which layers are sparse mixtures of experts.

Kernels are chosen in layers.backends and bound to the layers; the decoder only asks a layer
whether this step runs its fused decode kernel (runs_fused_decode) and then calls it by name.
"""
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.attention import Attention, PendingMerge
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.fused_moe import SparseMoeBlock, expert_weight_target
from nanovllm.layers.layernorm import PendingNorm, RMSNorm
from nanovllm.layers.linear import RowParallelLinear, divide, tp_rank_and_size
from nanovllm.layers.packed_linear import QKVParallelLinear
from nanovllm.layers.quantization import QuantConfig, linear_format
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.models.decoder_mlp import (
    DecoderMLP,
    DownPartials,
    MlpTurns,
    add_norm_partials,
    project_add_norm,
)


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
    quant: QuantConfig | None = None  # the linear layers' weight format (None: model dtype)


class DecoderAttention(nn.Module):
    """QKV projection and attention; DecoderLayer runs o_proj (project_add_norm)."""

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
        prefix = f"model.layers.{layer_idx}.self_attn."  # checkpoint names, for the ignore list
        qkv_names = [prefix + name for name in ("q_proj", "k_proj", "v_proj")]
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim,
                                          config.num_attention_heads,
                                          config.num_key_value_heads, bias=spec.qkv_bias,
                                          quant=linear_format(spec.quant, qkv_names))
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim,
                                        config.hidden_size, bias=spec.o_bias,
                                        quant=linear_format(spec.quant, [prefix + "o_proj"]))
        self.attn = Attention(self.num_heads, head_dim, head_dim ** -0.5, self.num_kv_heads,
                              rotary_emb, config.rms_norm_eps if spec.qk_norm else None,
                              spec.sliding_windows[layer_idx])

    def attend(self, positions: torch.Tensor, hidden_states: torch.Tensor | PendingNorm,
               residual: torch.Tensor) -> tuple[torch.Tensor | PendingMerge, torch.Tensor]:
        """(attention over the tokens: o_proj's input [tokens, q_size], or a decode's left
        unmerged for o_proj's kernel to merge; the residual)."""
        # hidden_states: the normed residual, or a PendingNorm whose add + RMSNorm qkv_proj's
        # GEMV computes first, storing the sum: the residual from here on
        if isinstance(hidden_states, PendingNorm):
            qkv, residual = self.qkv_proj.norm_gemv_rows(hidden_states)
        elif self.attn.runs_decode_new_token(hidden_states, self.qkv_proj):
            qkv = self.qkv_proj.gemv_rows(hidden_states)  # a lone token's GEMV
        elif self.attn.takes_projection() and self.qkv_proj.runs_fused_decode(hidden_states):
            # qkv_proj, q/k norm, RoPE and the K/V write as one kernel
            o = self.attn.decode_projected(
                positions, hidden_states, self.qkv_proj,
                self.o_proj.takes_pending_merge(hidden_states, self.head_dim))
            return _o_proj_input(o), residual
        else:
            return self._attend_qkv(positions, self.qkv_proj(hidden_states)), residual
        if self.attn.can_decode_new_token():  # q/k norm, RoPE and the K/V write in decode
            o = self.attn.decode_new_token(positions, qkv,
                                           self.o_proj.takes_pending_merge(qkv, self.head_dim))
            return _o_proj_input(o), residual
        return self._attend_qkv(positions, qkv), residual

    def _attend_qkv(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Attention over qkv_proj's output [tokens, q + k + v]: [tokens, q_size]."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)      # (N, H, D)
        k = k.view(-1, self.num_kv_heads, self.head_dim)   # (N, Hkv, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        o = self.attn(positions, q, k, v)
        return o.flatten(1, -1)


def _o_proj_input(o: torch.Tensor | PendingMerge) -> torch.Tensor | PendingMerge:
    """A decode's output as o_proj takes it: [tokens, q_size], or left unmerged."""
    return o if isinstance(o, PendingMerge) else o.flatten(1, -1)


class DecoderLayer(nn.Module):
    """Pre-norm block that ends with the next layer's input_layernorm, or the final norm."""

    # Each residual add is fused into the RMSNorm after it, and each o_proj and down_proj into
    # that add (project_add_norm, where split-K partials meet the norm that sums them), so the
    # norm after a layer runs inside it: DecoderModel runs only the first layer's own. A lone
    # token's post-attention norm runs inside gate_up_proj's GEMV (add_norm_gated), and its
    # next layer's input norm inside that layer's qkv_proj GEMV (a PendingNorm handed on).

    def __init__(self, config: PretrainedConfig, spec: DecoderSpec, rotary_emb: RotaryEmbedding,
                 layer_idx: int):
        super().__init__()
        self.self_attn = DecoderAttention(config, spec, rotary_emb, layer_idx)
        moe, prefix = spec.moe, f"model.layers.{layer_idx}.mlp."
        if moe is not None and moe.sparse_layers[layer_idx]:
            # each expert's projections by their own names, as compressed-tensors lists them
            experts = [f"{prefix}experts.{e}.{proj}" for e in range(moe.num_experts)
                       for proj in ("gate_proj", "up_proj", "down_proj")]
            self.mlp = SparseMoeBlock(config.hidden_size, moe.num_experts, moe.top_k,
                                      moe.intermediate_size, moe.norm_topk_prob,
                                      linear_format(spec.quant, experts))
        else:
            self.mlp = DecoderMLP(config, spec.mlp_bias, spec.quant, prefix)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # the projections these norms feed: a decode step may compute their LoRA shrink with
        # the norm, and a lone token's qkv_proj GEMV the input norm itself (forward)
        self.input_layernorm.feeds = (self.self_attn.qkv_proj,)
        if isinstance(self.mlp, DecoderMLP):
            self.post_attention_layernorm.feeds = (self.mlp.gate_up_proj,)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor | PendingNorm,
                residual: torch.Tensor, next_norm: RMSNorm
                ) -> tuple[torch.Tensor | PendingNorm, torch.Tensor]:
        """(next_norm(h), h), h = residual + attention + MLP; hidden_states: normed residual."""
        # After a dense MLP a lone token's pair may be (PendingNorm, the residual before its
        # add), for the next layer's qkv_proj GEMV to compute (attend); never the final norm's,
        # which feeds no projection
        o, residual = self.self_attn.attend(positions, hidden_states, residual)
        o_proj, norm = self.self_attn.o_proj, self.post_attention_layernorm
        if isinstance(self.mlp, SparseMoeBlock):
            hidden_states, residual = project_add_norm(o_proj, o, residual, norm)
            return next_norm(self.mlp(hidden_states), residual)
        gated, residual = self.mlp.add_norm_gated(o_proj, o, residual, norm)
        next_qkv = next_norm.feeds[0].runs_norm_gemv_rows if next_norm.feeds else None
        if isinstance(gated, DownPartials):
            return add_norm_partials(gated.partials, residual, next_norm, next_qkv)
        return project_add_norm(self.mlp.down_proj, gated, residual, next_norm, next_qkv)


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
        # The norm each layer ends with (a tuple: the modules stay registered where they are)
        self.next_norms = (*(layer.input_layernorm for layer in self.layers[1:]), self.norm)
        self.mlp_turns = MlpTurns([layer.mlp for layer in self.layers])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        residual = self.embed_tokens(input_ids)
        hidden_states = self.layers[0].input_layernorm(residual)
        with self.mlp_turns.step():
            for layer, next_norm in zip(self.layers, self.next_norms):
                hidden_states, residual = layer(positions, hidden_states, residual, next_norm)
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

"""A dense model's decode steps of up to 16 tokens as one launch a layer (kernels.persistent),
where layers.backends binds it; every other step, and every model it does not fit, runs the
per-kernel path, which is also the reference it is tested against."""
import torch
from torch import nn

from nanovllm.utils.context import get_context


def persistent_decode_mode(value: str) -> str:
    """NANOVLLM_PERSISTENT_DECODE's mode: "off" ("0", ""), "on" ("1") or "auto"."""
    mode = {"": "off", "0": "off", "1": "on"}.get(value.strip().lower(), value.strip().lower())
    if mode not in ("off", "on", "auto"):
        raise ValueError(f"NANOVLLM_PERSISTENT_DECODE={value!r}: expected 0/off, 1/on or auto")
    return mode


def persistent_fits(model: nn.Module) -> bool:
    """Whether the persistent layer runs every layer of a DecoderModel: dense MLPs, weights
    without biases (16-bit, or FP8 in a format the fused projections take, one format a layer),
    one rank, no LoRA, no sliding window, sizes the kernel takes."""
    from nanovllm.kernels.linear.fused_fp8 import fits_weight
    from nanovllm.kernels.persistent.decode_layer import fits_layer
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not hasattr(mlp, "gate_up_proj") or attn.attn.sliding_window is not None:
            return False
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(lin.bias is not None or lin.lora_a is not None or lin.tp_size != 1
               or lin.quant is not None and not fits_weight(*lin.fused_format())
               for lin in linears):
            return False
        if len({lin.fused_format() for lin in linears}) != 1:
            return False
        hidden, inter = mlp.down_proj.weight.shape
        if not fits_layer(attn.num_heads, attn.num_kv_heads, attn.head_dim, hidden, inter):
            return False
        # one scratch for all layers (sized from the first), one eps for all four norms
        shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim, hidden, inter)
        first = model.layers[0]
        if shape != (first.self_attn.num_heads, first.self_attn.num_kv_heads,
                     first.self_attn.head_dim, *first.mlp.down_proj.weight.shape):
            return False
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [attn.attn.q_norm, attn.attn.k_norm] if attn.attn.q_norm is not None else []
        if len({norm.eps for norm in norms}) != 1:
            return False
    return True


def bound_persistent_decode(model: nn.Module) -> "PersistentDecode | None":
    """The PersistentDecode that layers.backends bound to one of model's modules, if any."""
    return next((module.whole_layer_decode for module in model.modules()
                 if getattr(module, "whole_layer_decode", None) is not None), None)


class PersistentDecode:
    """Runs a DecoderModel's layers in a decode step with kernels.persistent: residual in,
    residual out."""

    def __init__(self, measured: bool = False) -> None:
        # measured: the runner captures each CUDA graph it takes with it and without, and
        # keeps the faster (runner.cuda_graphs); else it runs every step it takes
        self.measured = measured
        self.enabled = not measured  # whether a step it takes runs it (set while capturing)
        self.launches = 0  # steps it ran (capture checks that a variant ran it at all)
        self.kernel = None  # the launch configuration and scratch, made at the first call

    def release(self) -> None:
        """Free the scratch (sleep frees the GPU's memory); the next call makes it again."""
        self.kernel = None

    @staticmethod
    def takes(num_tokens: int) -> bool:
        """Whether a decode step of num_tokens tokens fits the kernel."""
        from nanovllm.kernels.persistent.decode_layer import MAX_TOKENS
        return 0 < num_tokens <= MAX_TOKENS

    def runs(self, x: torch.Tensor, first_layer: nn.Module) -> bool:
        """Whether this step runs it: enabled, a decode step of <= 16 tokens over a 16-bit
        cache that is allocated and not being calibrated."""
        attn = first_layer.self_attn.attn
        return (self.enabled and not get_context().is_prefill and self.takes(x.shape[0])
                and attn.takes_projection() and attn.k_cache.dtype == x.dtype)

    def __call__(self, layers: nn.ModuleList, positions: torch.Tensor,
                 residual: torch.Tensor) -> torch.Tensor:
        """The residual after every layer; a step small enough carries each layer's down_proj
        partials into the next launch (PersistentDecodeLayer: two barriers fewer a layer)."""
        from nanovllm.kernels.persistent.decode_layer import PersistentDecodeLayer
        if self.kernel is None:
            first = layers[0]
            hidden, inter = first.mlp.down_proj.weight.shape
            attn = first.self_attn
            self.kernel = PersistentDecodeLayer(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                                hidden, inter, residual.dtype, residual.device)
        self.launches += 1
        carry = residual.shape[0] <= self.kernel.fuse_max_tokens
        ctx, weights = get_context(), [_layer_weights(layer) for layer in layers]
        for i, layer in enumerate(layers):
            attn = layer.self_attn.attn
            residual = self.kernel(
                residual, weights[i], attn.rotary_emb.cos_sin_cache.squeeze(1), positions,
                ctx.slot_mapping, ctx.context_lens, ctx.block_tables, attn.k_cache,
                attn.v_cache, attn.scale, x_partials=carry and i > 0,
                carry_out=carry and i < len(layers) - 1,
                next_layer=weights[i + 1] if i + 1 < len(layers) else None)
        return residual


def _layer_weights(layer: nn.Module):
    """A DecoderLayer's kernels.persistent LayerWeights (read at every call: sleep and weight
    updates may replace the tensors)."""
    from nanovllm.kernels.persistent.decode_layer import LayerWeights
    attn, mlp = layer.self_attn, layer.mlp
    norm = attn.attn.q_norm is not None
    return LayerWeights(
        layer.input_layernorm.weight, attn.qkv_proj.weight,
        attn.attn.q_norm.weight if norm else None, attn.attn.k_norm.weight if norm else None,
        attn.o_proj.weight, layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight,
        mlp.down_proj.weight, layer.input_layernorm.eps, **_fp8_scales(
            (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)))


def _fp8_scales(linears: tuple[nn.Module, ...]) -> dict:
    """LayerWeights' scales and block for FP8 projections (nothing for 16-bit ones)."""
    scales = [lin.fused_scales() for lin in linears]
    if not scales[0]:
        return {}
    return {"scales": tuple(s["w_scale"] for s in scales), "block": scales[0]["w_block"]}

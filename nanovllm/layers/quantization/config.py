"""What a checkpoint's weights are: config.json's `quantization_config` (or LLM(quantization=...)),
read once into a QuantConfig from which the linear layers build their weight format.

Supported:
  - `quant_method: "fp8"` with `weight_block_size` (Qwen's and DeepSeek's FP8 releases):
    float8_e4m3fn weights, a float32 `weight_scale_inv` per block, dynamic activations;
  - `quant_method: "compressed-tensors"`, `format: "float-quantized"` (llm-compressor's FP8 and
    FP8_DYNAMIC): float8 weights with a `weight_scale` per output channel, per tensor or per
    block; activations always quantized dynamically per token (a static `input_scale` is unused);
  - `LLM(model, quantization="fp8")` over a bf16/fp16/fp32 checkpoint: quantized at load, per
    output channel, activations per token.
"""
import re
from dataclasses import dataclass

QUANTIZATION_OPTIONS = (None, "fp8")  # LLM(quantization=...)
CHECKPOINT_METHODS = ("fp8", "compressed-tensors")  # config.json's quant_method


@dataclass(frozen=True)
class QuantConfig:
    """The weight format of a model's linear layers (the LM head and MoE routers never)."""

    method: str  # "fp8", "compressed-tensors", or "online" (quantized at load)
    # (rows, cols) of weight one scale covers; None: one scale per output channel
    weight_block_size: tuple[int, int] | None
    scale_name: str  # the checkpoint's name of the scale tensor beside each weight
    ignore: tuple[str, ...] = ()  # modules kept unquantized: names, suffixes or "re:" patterns

    def quantizes(self, names: list[str]) -> bool:
        """Whether the module fused from these checkpoint modules is quantized (all or none)."""
        ignored = [self._ignored(name) for name in names]
        if any(ignored) and not all(ignored):
            raise ValueError(f"quantization_config ignores some of {names} but not all; a fused "
                             f"layer is quantized as a whole")
        return not ignored[0]

    def _ignored(self, name: str) -> bool:
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], name):
                    return True
            elif name == entry or name.endswith("." + entry) or name.startswith(entry + "."):
                return True
        return False


def resolve_quant_config(hf_quant: dict | None, quantization: str | None) -> QuantConfig | None:
    """The QuantConfig of a checkpoint's quantization_config and LLM's `quantization`, or a
    ValueError naming what is not supported."""
    if quantization not in QUANTIZATION_OPTIONS:
        raise ValueError(f"quantization={quantization!r} is not supported; choose one of "
                         f"{list(QUANTIZATION_OPTIONS)}")
    if hf_quant is None:
        if quantization is None:
            return None
        return QuantConfig("online", None, "weight_scale")
    if not isinstance(hf_quant, dict):
        raise ValueError(f"config.json's quantization_config must be an object, not {hf_quant!r}")
    method = hf_quant.get("quant_method")
    if quantization not in (None, method) and method in CHECKPOINT_METHODS:  # as vLLM
        raise ValueError(f"quantization={quantization!r} does not match this checkpoint's "
                         f"quantization_config (quant_method={method!r}): its weights are "
                         f"quantized already; leave quantization unset")
    if method == "fp8":
        return _fp8_config(hf_quant)
    if method == "compressed-tensors":
        return _compressed_tensors_config(hf_quant)
    raise ValueError(f"config.json's quant_method={method!r} is not supported; supported: "
                     f"{list(CHECKPOINT_METHODS)} (FP8 weights), or a bf16/fp16 checkpoint with "
                     f"quantization='fp8'")


def _block_size(value, where: str) -> tuple[int, int]:
    """(rows, cols) of a scale block: powers of two of at least 16 (the GEMM tiles' sizes)."""
    ok = (isinstance(value, list | tuple) and len(value) == 2
          and all(isinstance(v, int) and v >= 16 and v & (v - 1) == 0 for v in value))
    if not ok:
        raise ValueError(f"{where}={value!r} is not supported: expected two powers of two "
                         f">= 16, e.g. [128, 128]")
    return tuple(value)


def _fp8_config(cfg: dict) -> QuantConfig:
    """quant_method "fp8": block-scaled e4m3 weights with dynamic activations."""
    if cfg.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quant_method 'fp8' with fmt={cfg['fmt']!r} is not supported (e4m3)")
    if cfg.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"quant_method 'fp8' with activation_scheme="
                         f"{cfg['activation_scheme']!r} is not supported ('dynamic')")
    if cfg.get("weight_block_size") is None:
        raise ValueError("quant_method 'fp8' without weight_block_size (per-tensor scales) is "
                         "not supported; block-scaled checkpoints are")
    block = _block_size(cfg["weight_block_size"], "weight_block_size")
    ignore = (cfg.get("ignored_layers") or []) + (cfg.get("modules_to_not_convert") or [])
    return QuantConfig("fp8", block, "weight_scale_inv", tuple(ignore))


def _compressed_tensors_config(cfg: dict) -> QuantConfig:
    """compressed-tensors float-quantized: one group of FP8 weights (channel, tensor or block)."""
    if cfg.get("format") != "float-quantized":
        raise ValueError(f"compressed-tensors format={cfg.get('format')!r} is not supported; "
                         f"supported: 'float-quantized' (FP8)")
    if cfg.get("kv_cache_scheme"):
        raise ValueError("compressed-tensors kv_cache_scheme is not supported; use "
                         "kv_cache_dtype='fp8' (scales calculated at start-up)")
    # they change what the stored weights mean (rotated, or 2:4-sparse)
    if cfg.get("transform_config"):
        raise ValueError("compressed-tensors transform_config (rotated weights) is not "
                         "supported")
    sparsity = (cfg.get("sparsity_config") or {}).get("format")
    if sparsity not in (None, "dense"):
        raise ValueError(f"compressed-tensors sparsity_config format={sparsity!r} is not "
                         f"supported (dense weights)")
    groups = list((cfg.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors with {len(groups)} config_groups is not supported "
                         f"(one FP8 group)")
    targets = groups[0].get("targets", ["Linear"])
    if targets != ["Linear"]:  # every linear layer but `ignore`'s is what we quantize
        raise ValueError(f"compressed-tensors targets={targets!r} are not supported: "
                         f"['Linear'] (every linear layer, less the ignore list)")
    weights, inputs = groups[0].get("weights") or {}, groups[0].get("input_activations")
    fp8 = weights.get("type") == "float" and weights.get("num_bits") == 8
    if not fp8 or weights.get("dynamic") or not weights.get("symmetric", True):
        raise ValueError(f"compressed-tensors weights {weights} are not supported: FP8 "
                         f"(type 'float', num_bits 8), static and symmetric")
    if not inputs or inputs.get("type") != "float" or inputs.get("num_bits") != 8:
        raise ValueError(f"compressed-tensors input_activations {inputs} are not supported: "
                         f"FP8 activations (W8A8)")
    strategy = weights.get("strategy")
    if strategy in ("channel", "tensor"):
        block = None  # a tensor's one scale is loaded into every channel's
    elif strategy == "block":
        block = _block_size(weights.get("block_structure"), "weights.block_structure")
    else:
        raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not supported; "
                         f"supported: 'channel', 'tensor', 'block'")
    return QuantConfig("compressed-tensors", block, "weight_scale",
                       tuple(cfg.get("ignore") or ()))

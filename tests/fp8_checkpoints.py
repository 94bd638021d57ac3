"""Tiny FP8 checkpoints written by the tests' own converter, and transformers references for them.

`quantize_checkpoint` turns a random checkpoint into one of the formats people download:
  - "block":   quant_method "fp8", float8 weights + `weight_scale_inv` per block (Qwen's release)
  - "channel": compressed-tensors float-quantized, `weight_scale` [N, 1] (llm-compressor FP8)
  - "tensor":  compressed-tensors with one `weight_scale` per tensor
`dequantized_checkpoint` writes its weights back as float32 (what the codes and scales mean), and
`simulate_w8a8` makes a transformers model quantize its projections' inputs as W8A8 does.
Written independently of nanovllm's own quantization code, which they check.
"""
import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
QUANTIZED = re.compile(r".*\.(q|k|v|o|gate|up|down)_proj\.weight$")  # not the router, not heads


def _quantize(weight: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of weight [N, K] for blocks of rows x cols (partial at the edges)."""
    n, k = weight.shape
    scales = torch.empty(-(-n // rows), -(-k // cols))
    codes = torch.empty(n, k, dtype=FP8)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = weight[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols].float()
            scales[i, j] = max(tile.abs().max().item(), 1e-10) / 448.0
            codes[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = (
                tile / scales[i, j]).clamp(-448, 448).to(FP8)
    return codes, scales


def vary_magnitudes(path: str, block: int = 32, seed: int = 0) -> str:
    """Scale each block x block tile of the projections in checkpoint `path` by 2**U(-3, 3), in
    place: iid random weights give every block the same scale, and then a scale applied to the
    wrong block (a transposed layout) would go unnoticed."""
    file = os.path.join(path, "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(file)
    for name, weight in tensors.items():
        if QUANTIZED.match(name):
            n, k = weight.shape
            factors = 2.0 ** (6 * torch.rand(-(-n // block), -(-k // block),
                                             generator=generator) - 3)
            full = factors.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
            tensors[name] = (weight.float() * full).to(weight.dtype)
    save_file(tensors, file)
    return path


def quantization_config(scheme: str, block: int) -> dict:
    """config.json's quantization_config of each scheme, as the real checkpoints write it."""
    if scheme == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [block, block]}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": scheme, "group_size": None, "block_structure": None}
    inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
              "strategy": "token"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": inputs}}}


def quantize_checkpoint(src: str, dst: str, scheme: str, block: int = 32) -> str:
    """Copy checkpoint src to dst with its projections in FP8 `scheme`; returns dst."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = {}
    for name, weight in load_file(os.path.join(src, "model.safetensors")).items():
        if not QUANTIZED.match(name):
            tensors[name] = weight
            continue
        n, k = weight.shape
        if scheme == "block":
            codes, scales = _quantize(weight, block, block)
            tensors[name + "_scale_inv"] = scales
        else:
            codes, scales = _quantize(weight, 1, k) if scheme == "channel" else \
                _quantize(weight, n, k)
            tensors[name + "_scale"] = scales.reshape(n, 1) if scheme == "channel" else \
                scales.reshape(1)
            tensors[name[:-len("weight")] + "input_scale"] = torch.ones(1)  # static: unused
        tensors[name] = codes
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    _edit_config(dst, lambda c: {**c, "quantization_config": quantization_config(scheme, block)})
    return dst


def ignore_module(path: str, module: str) -> None:
    """Put `module` of FP8 checkpoint `path` back in float32 and on its config's ignore list."""
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    codes, scale = tensors[module + ".weight"], tensors.pop(module + ".weight_scale")
    tensors.pop(module + ".input_scale", None)
    tensors[module + ".weight"] = codes.float() * scale.float().reshape(-1, 1)
    save_file(tensors, file)

    def edit(config: dict) -> dict:
        quant = config["quantization_config"]
        return {**config, "quantization_config": {**quant, "ignore": quant["ignore"] + [module]}}
    _edit_config(path, edit)


def dequantized_checkpoint(src: str, dst: str) -> str:
    """Copy FP8 checkpoint src to dst as float32: codes times their scales; returns dst."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        block = json.load(f)["quantization_config"].get("weight_block_size")
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(("_scale", "_scale_inv", "input_scale")):
            continue
        if tensor.dtype == FP8:
            scale = tensors.get(name + "_scale_inv", tensors.get(name + "_scale")).float()
            n, k = tensor.shape
            if block is not None:
                full = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)
                full = full[:, :k]
            else:  # [N, 1] per channel or [1] per tensor: broadcast
                full = scale.reshape(-1, 1)
            tensor = tensor.float() * full
        out[name] = tensor.float()
    save_file(out, os.path.join(dst, "model.safetensors"))
    _edit_config(dst, lambda c: {k: v for k, v in c.items() if k != "quantization_config"}
                 | {"dtype": "float32"})
    return dst


def _edit_config(path: str, edit) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    with open(file, "w") as f:
        json.dump(edit(config), f, indent=1)


def _fake_quant_tokens(x: torch.Tensor, group: int) -> torch.Tensor:
    """x with each token's groups of `group` features quantized to FP8 and back."""
    shape, k = x.shape, x.shape[-1]
    out = x.reshape(-1, k).float().clone()
    for start in range(0, k, group):
        part = out[:, start:start + group]
        scale = part.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
        out[:, start:start + group] = (part / scale).clamp(-448, 448).to(FP8).float() * scale
    return out.to(x.dtype).reshape(shape)


def simulate_w8a8(model: torch.nn.Module, group: int | None, tp_size: int = 1) -> None:
    """Quantize the inputs of model's projections (and experts) per token, in groups of `group`
    features (None: the whole token, or with tensor parallelism each rank's slice of o_proj's and
    down_proj's input), as an FP8 W8A8 engine does."""
    def hook(row_parallel: bool):
        def quantize_input(module, args):
            k = args[0].shape[-1]
            size = group or (k // tp_size if row_parallel else k)
            return (_fake_quant_tokens(args[0], size),) + args[1:]
        return quantize_input

    for name, module in model.named_modules():
        if m := re.match(r".*\.(q|k|v|o|gate|up|down)_proj$", name):
            module.register_forward_pre_hook(hook(m.group(1) in ("o", "down")))
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    for module in experts:  # transformers 5 stacks the experts: patch their matmuls instead
        _simulate_stacked_experts(module, group)


def _simulate_stacked_experts(experts: torch.nn.Module, group: int | None) -> None:
    """Replace a stacked-experts module's forward (transformers 5: gate_up_proj [E, 2I, H],
    down_proj [E, H, I]) by the same loop with both matmuls' inputs quantized."""
    def quantized(x: torch.Tensor) -> torch.Tensor:
        return _fake_quant_tokens(x, group or x.shape[-1])

    def forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in torch.unique(top_k_index).tolist():
            tokens, slot = torch.where(top_k_index == expert)
            gate, up = (quantized(hidden_states[tokens])
                        @ experts.gate_up_proj[expert].t()).chunk(2, dim=-1)
            h = quantized(experts.act_fn(gate) * up) @ experts.down_proj[expert].t()
            out.index_add_(0, tokens, h * top_k_weights[tokens, slot, None])
        return out

    experts.forward = forward

"""PEFT LoRA adapters: read adapter_config.json + adapter_model.safetensors (or the same as an
in-memory state dict and config), check them against the base model, keep them on the host.

PEFT computes y = W x + scaling * B (A x), with A [r, in], B [out, r] per targeted module and
scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora)."""
import json
import math
import os
import re
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from nanovllm.lora.request import LoRARequest
from nanovllm.models.registry import decoder_spec
from nanovllm.utils.field_checks import describe, is_int, is_real

SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (".default" in a live model)
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.default)?\.weight$")


@dataclass
class LoRAAdapter:
    """A checked adapter on the host: (layer, module) -> (A [r, in], B [out, r])."""

    lora_int_id: int
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def lora_specs(adapter: LoRAAdapter) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """An adapter's tensors as specs ("layer.module.A"/"B"), in lora_tensors' order."""
    return [(f"{layer}.{module}.{ab}", tuple(t.shape), t.dtype)
            for (layer, module), pair in adapter.weights.items() for ab, t in zip("AB", pair)]


def lora_tensors(adapter: LoRAAdapter) -> list[torch.Tensor]:
    return [t for pair in adapter.weights.values() for t in pair]


def load_adapter(request: LoRARequest, hf_config: PretrainedConfig,
                 max_lora_rank: int) -> LoRAAdapter:
    """The request's adapter, read and checked; ValueError (FileNotFoundError for a missing
    path) naming the problem."""
    if request.in_memory:
        config, tensors = request.peft_config, request.lora_tensors
        if not isinstance(config, dict) or not isinstance(tensors, dict):
            raise ValueError(f"adapter {request.lora_name!r}: peft_config and lora_tensors must "
                             f"be dicts, got {describe(config, 20)} and {describe(tensors, 20)}")
    else:
        config, tensors = read_peft_dir(request.lora_path)
    where = f"adapter {request.lora_name!r} ({request.source})"
    try:
        rank, scaling = check_peft_config(config, max_lora_rank)
        weights = check_tensors(tensors, hf_config, rank)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return LoRAAdapter(request.lora_int_id, rank, scaling, weights)


def read_peft_dir(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, adapter_model.safetensors) of a PEFT directory."""
    from safetensors.torch import load_file
    path = os.path.expanduser(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"LoRA adapter directory {path!r} does not exist")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not os.path.isfile(os.path.join(path, name)):
            raise FileNotFoundError(f"LoRA adapter directory {path!r} has no {name}")
    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            config = json.load(f)
        tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    except (OSError, ValueError) as e:  # JSON and safetensors errors are ValueError subclasses
        raise ValueError(f"LoRA adapter {path!r} is malformed: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not a JSON object")
    return config, tensors


def check_peft_config(config: dict, max_lora_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a PEFT LoRA config; ValueError for what we do not run."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"peft_type={config.get('peft_type')!r} is not a LoRA adapter")
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if not is_int(rank) or rank < 1:
        raise ValueError(f"r={rank!r} is invalid: expected an int >= 1")
    if rank > max_lora_rank:
        raise ValueError(f"rank r={rank} exceeds max_lora_rank={max_lora_rank}")
    if not is_real(alpha):
        raise ValueError(f"lora_alpha={alpha!r} is invalid: expected a number")
    if config.get("target_parameters"):
        raise ValueError(f"it targets experts (target_parameters="
                         f"{config['target_parameters']}); experts take no LoRA here")
    targets = config.get("target_modules")
    if isinstance(targets, list | tuple):
        bad = sorted(set(targets) - set(SUPPORTED_MODULES))
        if bad:
            raise ValueError(f"unsupported target module(s) {bad}; supported: "
                             f"{list(SUPPORTED_MODULES)}")
    unsupported = {"use_dora": False, "bias": "none", "fan_in_fan_out": False}
    for key, expected in unsupported.items():
        if config.get(key, expected) != expected:
            raise ValueError(f"{key}={config[key]!r} is not supported (only {expected!r})")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layer_replication"):
        if config.get(key):
            raise ValueError(f"{key}={config[key]!r} is not supported")
    root = math.sqrt(rank) if config.get("use_rslora", False) else rank
    return rank, float(alpha) / root


def module_shapes(hf_config: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """module -> (in, out) features of the full (unsharded) projection."""
    hidden, head_dim = hf_config.hidden_size, hf_config.head_dim
    q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    inter = hf_config.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def check_tensors(tensors: dict, hf_config: PretrainedConfig, rank: int
                  ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A, B) on the host, every key and shape checked."""
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    experts, unsupported = [], []
    for key, tensor in tensors.items():
        match = _KEY.search(key) if isinstance(key, str) else None
        if isinstance(key, str) and ".experts." in key:
            experts.append(key)
        elif match is None or match.group(3) not in SUPPORTED_MODULES:
            unsupported.append(key)
        elif not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{key!r} is {describe(tensor, 20)}, not a tensor")
        else:
            layer, _, module, ab = match.groups()
            parts.setdefault((int(layer), module), {})[ab] = tensor
    if experts:
        raise ValueError(f"it targets experts ({experts[0]!r}, ...); experts take no LoRA here")
    if unsupported:
        raise ValueError(f"unsupported target module in {unsupported[:3]}; supported: "
                         f"{list(SUPPORTED_MODULES)}")
    if not parts:
        raise ValueError("it holds no lora_A/lora_B weights")
    moe = decoder_spec(hf_config).moe
    sparse = moe.sparse_layers if moe else (False,) * hf_config.num_hidden_layers
    return {target: _check_pair(target, ab, hf_config, rank, sparse)
            for target, ab in parts.items()}


def _check_pair(target: tuple[int, str], ab: dict[str, torch.Tensor],
                hf_config: PretrainedConfig, rank: int, sparse: tuple[bool, ...]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    layer, module = target
    if not 0 <= layer < hf_config.num_hidden_layers:
        raise ValueError(f"layer {layer} is outside the model's {hf_config.num_hidden_layers}")
    if module in ("gate_proj", "up_proj", "down_proj") and sparse[layer]:
        raise ValueError(f"it targets {module} of layer {layer}, whose MLP is experts; experts "
                         f"take no LoRA here")
    if set(ab) != {"A", "B"}:
        raise ValueError(f"layer {layer} {module} has lora_{''.join(ab)} only")
    fan_in, fan_out = module_shapes(hf_config)[module]
    a, b = ab["A"], ab["B"]
    if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
        raise ValueError(f"layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B "
                         f"{tuple(b.shape)} do not match r={rank} and the module's "
                         f"[{fan_out}, {fan_in}] weight")
    return a.detach().to("cpu", copy=True), b.detach().to("cpu", copy=True)

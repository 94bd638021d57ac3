"""Load HF safetensors into a model whose parameters carry their own weight loaders."""
import glob
import os

import torch
from safetensors import safe_open
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    param.data.copy_(loaded_weight)


def load_model(model: nn.Module, path: str) -> None:
    """Copy every tensor of every *.safetensors file into the matching parameter.

    `packed_modules_mapping` maps a checkpoint name fragment (q_proj) to our fused
    parameter (qkv_proj) and the shard it fills (q); `renamed_modules` maps a checkpoint name
    fragment to where that module lives in our model; `expert_weight` maps a mixture-of-experts
    checkpoint tensor to the stacked parameter, shard and expert it fills.
    """
    expert_weight = getattr(model, "expert_weight", lambda name: None)
    packed = getattr(model, "packed_modules_mapping", {})
    renamed = getattr(model, "renamed_modules", {})
    params = dict(model.named_parameters())
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}")
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                ours = name
                for fragment, replacement in renamed.items():
                    ours = ours.replace(fragment, replacement)
                if target := expert_weight(ours):
                    param_name, shard_id, expert_id = target
                    if param_name not in params:
                        raise ValueError(f"checkpoint tensor {name!r} has no matching "
                                         f"parameter ({param_name!r})")
                    param = params[param_name]
                    param.weight_loader(param, f.get_tensor(name), shard_id, expert_id)
                    continue
                _load_one(params, packed, ours, f.get_tensor(name))


def _load_one(params: dict, packed: dict, name: str, weight: torch.Tensor) -> None:
    for fragment, (fused, shard_id) in packed.items():
        if fragment in name:
            param = params[name.replace(fragment, fused)]
            param.weight_loader(param, weight, shard_id)
            return
    if name not in params:
        if name == "lm_head.weight":
            return  # tied embeddings: some checkpoints still store the head
        raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
    param = params[name]
    getattr(param, "weight_loader", default_weight_loader)(param, weight)


@torch.no_grad()
def load_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights in [-1e-3, 1e-3] (vLLM's load_format="dummy"): for benchmarks, where
    speed does not depend on the values; norm weights stay 1 so activations keep their scale."""
    device = next(model.parameters()).device  # drawn where the weights live: 8B values
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if not name.endswith("norm.weight"):
            param.uniform_(-1e-3, 1e-3, generator=generator)

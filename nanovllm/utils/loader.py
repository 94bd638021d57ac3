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
    parameter (qkv_proj) and the shard it fills (q).
    """
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}")
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                _load_one(params, packed, name, f.get_tensor(name))


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

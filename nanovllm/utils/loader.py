"""Load HF safetensors into a model whose parameters carry their own weight loaders."""
import glob
import os
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    param.data.copy_(loaded_weight)


def load_model(model: nn.Module, path: str) -> None:
    """Copy every tensor of every *.safetensors file into the matching parameter."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}")
    load_weights(model, _safetensors_weights(files))


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy (checkpoint name, tensor) pairs, on any device, through the parameters' loaders.

    `packed_modules_mapping` maps a checkpoint name fragment (q_proj) to our fused
    parameter (qkv_proj) and the shard it fills (q).
    """
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())
    for name, weight in weights:
        _load_one(params, packed, name, weight)


def _safetensors_weights(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def check_weight_names(model: nn.Module, names: Iterable[str]) -> None:
    """Raise ValueError for the first name no parameter of `model` takes."""
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())
    for name in names:
        if not isinstance(name, str) or _resolve(params, packed, name) is None:
            raise ValueError(f"weight {name!r} has no matching parameter")


def _resolve(params: dict, packed: dict, name: str) -> tuple[nn.Parameter | None, tuple] | None:
    """(parameter, extra loader args) for a checkpoint name; (None, ()) to skip it; None if
    no parameter takes it."""
    for fragment, (fused, shard_id) in packed.items():
        if fragment in name:
            param = params.get(name.replace(fragment, fused))
            return None if param is None else (param, (shard_id,))
    if name in params:
        return params[name], ()
    if name == "lm_head.weight":
        return None, ()  # tied embeddings: some checkpoints still store the head
    return None


def _load_one(params: dict, packed: dict, name: str, weight: torch.Tensor) -> None:
    resolved = _resolve(params, packed, name)
    if resolved is None:
        raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
    param, shard = resolved
    if param is not None:
        getattr(param, "weight_loader", default_weight_loader)(param, weight, *shard)

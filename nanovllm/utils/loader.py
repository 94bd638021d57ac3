"""Load HF safetensors into a model whose parameters carry their own weight loaders."""
import glob
import os
from collections.abc import Callable, Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn

FP8_CODES = torch.float8_e4m3fn  # FP8 weights' codes (layers.quantization)
FP8_MAX = 448.0


def check_shape(loaded: torch.Tensor, expected: torch.Size | tuple) -> None:
    """ValueError unless the checkpoint tensor (or this rank's part of it) has the shape its
    destination needs: copy_ would broadcast a [1] or cut nothing of a larger tensor."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"shape {list(loaded.shape)} where {list(expected)} is expected")


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    check_shape(loaded_weight, param.shape)
    param.data.copy_(loaded_weight)


def load_model(model: nn.Module, path: str) -> None:
    """Copy every tensor of every *.safetensors file into the matching parameter; a parameter
    that none of them fills is a ValueError naming it (a missing FP8 scale would otherwise
    keep uninitialised memory)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}")
    filled = load_weights(model, _safetensors_weights(files))
    missing = [name for name, param in model.named_parameters() if id(param) not in filled]
    if missing:
        raise ValueError(f"the checkpoint in {path!r} has no tensor for {len(missing)} "
                         f"parameter(s): {missing[:5]}")


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[int]:
    """Copy (checkpoint name, tensor) pairs, on any device, through the parameters' loaders;
    return the ids of the parameters written (a float weight quantized into FP8 codes writes
    its scales too)."""
    resolve = _resolver(model)
    filled: set[int] = set()
    for name, weight in weights:
        resolved = resolve(name)
        if resolved is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
        param, shard = resolved
        if param is not None:
            try:
                getattr(param, "weight_loader", default_weight_loader)(param, weight, *shard)
            except (ValueError, RuntimeError) as e:  # a shape torch's narrow or copy_ refuses
                raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
            filled |= _fills(param, weight)
    return filled


def _fills(param: nn.Parameter, weight: torch.Tensor) -> set[int]:
    """Ids of the parameters a tensor loaded into param writes: param, and the scales of FP8
    codes that a float tensor is quantized into."""
    if getattr(param, "quant_format", None) is not None and weight.dtype != FP8_CODES:
        return {id(param), id(param.quant_scale)}
    return {id(param)}


def check_weight_names(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> set[int]:
    """Raise ValueError for the first name no parameter of `model` takes; else the ids of the
    parameters the weights fill, as load_weights returns them."""
    resolve, filled = _resolver(model), set()
    for name, weight in weights:
        resolved = resolve(name) if isinstance(name, str) else None
        if resolved is None:
            raise ValueError(f"weight {name!r} has no matching parameter")
        if resolved[0] is not None:
            filled |= _fills(resolved[0], weight)
    return filled


def _safetensors_weights(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


Resolved = tuple[nn.Parameter | None, tuple] | None


def _resolver(model: nn.Module) -> Callable[[str], Resolved]:
    """checkpoint name -> (parameter, extra loader args); (None, ()) to skip it; None when no
    parameter takes it. The model's maps are documented in models/decoder.py."""
    expert_weight = getattr(model, "expert_weight", lambda name: None)
    packed = getattr(model, "packed_modules_mapping", {})
    renamed = getattr(model, "renamed_modules", {})
    params = dict(model.named_parameters())

    def resolve(name: str) -> Resolved:
        for fragment, replacement in renamed.items():
            name = name.replace(fragment, replacement)
        if name.endswith(".input_scale"):
            return None, ()  # llm-compressor's static FP8 activation scale: ours are dynamic
        if target := expert_weight(name):
            param_name, shard_id, expert_id = target
            param = params.get(param_name)
            return None if param is None else (param, (shard_id, expert_id))
        for fragment, (fused, shard_id) in packed.items():
            if fragment in name:
                param = params.get(name.replace(fragment, fused))
                return None if param is None else (param, (shard_id,))
        if name in params:
            return params[name], ()
        if name == "lm_head.weight":
            return None, ()  # tied embeddings: some checkpoints still store the head
        return None

    return resolve


@torch.no_grad()
def load_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights in [-1e-3, 1e-3] (vLLM's load_format="dummy"); norm weights stay 1. FP8
    codes are drawn over their range and their scales (parameters with a `scale_block`) map it
    to the same [-1e-3, 1e-3]."""
    device = next(model.parameters()).device  # drawn where the weights live: 8B values
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            continue
        if param.dtype == FP8_CODES:
            for row in param.view(-1, param.shape[-1]).split(4096):  # bounded bf16 scratch
                row.copy_(torch.empty_like(row, dtype=torch.bfloat16).uniform_(
                    -FP8_MAX, FP8_MAX, generator=generator))
        elif hasattr(param, "scale_block"):
            param.fill_(1e-3 / FP8_MAX)
        else:
            param.uniform_(-1e-3, 1e-3, generator=generator)

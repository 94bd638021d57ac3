"""Weight formats: what quantization_config and LLM(quantization=...) accept, the errors for what
they do not, and which FP8 layers take the fused decode kernels."""
import json
import os
import shutil

import pytest
import torch

from nanovllm.config import Config
from nanovllm.layers.backends import (
    FUSED_GATE_UP_MAX_TOKENS,
    FUSED_QKV_MAX_TOKENS,
    FUSED_SPLIT_K_MAX_TOKENS,
    FastPath,
    TorchBackend,
    bind_backend,
)
from nanovllm.layers.fused_calibration import layer_class
from nanovllm.layers.linear import RowParallelLinear
from nanovllm.layers.packed_linear import MergedColumnParallelLinear, QKVParallelLinear
from nanovllm.layers.quantization import Fp8Format, QuantConfig, resolve_quant_config
from tests.fp8_checkpoints import quantization_config

BLOCK = QuantConfig("fp8", (128, 128), "weight_scale_inv")
CHANNEL = QuantConfig("online", None, "weight_scale")


def with_quantization_config(src: str, dst: str, quant: dict | None) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quant
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def test_the_released_formats_resolve():
    block = resolve_quant_config(quantization_config("block", 128), None)
    assert (block.method, block.weight_block_size, block.scale_name) == \
        ("fp8", (128, 128), "weight_scale_inv")
    channel = resolve_quant_config(quantization_config("channel", 128), None)
    assert (channel.method, channel.weight_block_size, channel.scale_name, channel.ignore) == \
        ("compressed-tensors", None, "weight_scale", ("lm_head",))
    assert resolve_quant_config(None, "fp8").method == "online"
    # "fp8" over an FP8 checkpoint names its own method (vLLM too): the checkpoint's scales
    assert resolve_quant_config(quantization_config("block", 128), "fp8").method == "fp8"
    assert resolve_quant_config(None, None) is None


def _with_targets(quant: dict, targets: list[str]) -> dict:
    quant = json.loads(json.dumps(quant))
    quant["config_groups"]["group_0"]["targets"] = targets
    return quant


@pytest.mark.parametrize("quant,quantization,message", [
    ({"quant_method": "awq", "bits": 4}, None, "quant_method='awq' is not supported"),
    ({"quant_method": "gptq"}, "fp8", "quant_method='gptq' is not supported"),
    # quantization="fp8" (per channel at load) over weights already FP8: refused, not ignored
    (quantization_config("channel", 128), "fp8",
     "quantization='fp8' does not match .*quant_method='compressed-tensors'"),
    ({"quant_method": "bitsandbytes"}, None, "'fp8', 'compressed-tensors'"),
    (None, "int8", "quantization='int8' is not supported"),
    ({**quantization_config("block", 128), "activation_scheme": "static"}, None,
     "activation_scheme='static'"),
    ({**quantization_config("block", 128), "weight_block_size": [100, 128]}, None,
     "weight_block_size=\\[100, 128\\]"),
    ({**quantization_config("block", 128), "weight_block_size": None}, None, "per-tensor"),
    ({**quantization_config("channel", 128), "format": "pack-quantized"}, None,
     "format='pack-quantized'"),
    # they change what the stored weights mean: rotated, or 2:4-sparse
    ({**quantization_config("channel", 128), "transform_config": {"config_groups": {}}}, None,
     "transform_config"),
    ({**quantization_config("channel", 128),
      "sparsity_config": {"format": "sparse-24-bitmask"}}, None, "sparsity_config"),
    (_with_targets(quantization_config("channel", 128), ["re:.*self_attn.*"]), None,
     "targets"),
])
def test_unsupported_quantization_is_a_value_error_before_loading(tiny_model, tmp_path, quant,
                                                                  quantization, message):
    path = with_quantization_config(tiny_model, str(tmp_path / "ckpt"), quant)
    with pytest.raises(ValueError, match=message):
        Config(path, device="cpu", quantization=quantization)


def test_lora_over_fp8_weights_is_refused(tiny_model):
    with pytest.raises(ValueError, match="enable_lora=True with FP8 weights"):
        Config(tiny_model, device="cpu", quantization="fp8", enable_lora=True)


def test_compressed_tensors_int_weights_are_refused():
    quant = quantization_config("channel", 128)
    quant["config_groups"]["group_0"]["weights"].update(type="int", num_bits=4)
    with pytest.raises(ValueError, match="FP8"):
        resolve_quant_config(quant, None)


def test_the_ignore_list_matches_names_suffixes_and_patterns():
    config = QuantConfig("compressed-tensors", None, "weight_scale",
                         ("lm_head", "re:.*layers\\.1\\..*", "self_attn.o_proj"))
    assert config.quantizes(["model.layers.0.mlp.down_proj"])
    assert not config.quantizes(["model.layers.1.mlp.down_proj"])
    assert not config.quantizes(["model.layers.0.self_attn.o_proj"])
    with pytest.raises(ValueError, match="as a whole"):
        QuantConfig("fp8", None, "w", ("q_proj",)).quantizes(["a.q_proj", "a.k_proj"])


def test_a_shard_that_starts_inside_a_block_is_a_value_error():
    with pytest.raises(ValueError, match="does not divide"):
        MergedColumnParallelLinear(256, [96, 96], quant=Fp8Format(BLOCK))
    RowParallelLinear(96, 100, quant=Fp8Format(BLOCK))  # one rank: partial edge blocks are fine


def fp8_projections(block: tuple[int, int] | None, dtype: torch.dtype) -> list:
    """qkv_proj, gate_up_proj and o_proj with FP8 weights in a model of `dtype` (the dtype the
    runner builds it in, its activations')."""
    quant = Fp8Format(QuantConfig("fp8", block, "weight_scale_inv") if block else CHANNEL)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return [QKVParallelLinear(256, 128, 2, 1, quant=quant),
                MergedColumnParallelLinear(256, [256, 256], quant=quant),
                RowParallelLinear(256, 256, quant=quant)]
    finally:
        torch.set_default_dtype(default)


@pytest.mark.parametrize("block", [(128, 128), None])
def test_fp8_layers_take_the_fused_decode_kernels(block):
    """With fused projections on, bind_backend gives the FP8 layers of a 16-bit model the fused
    kernels' limits (fixed, or the measured ones of their class) beside their FP8 GEMM."""
    layers = fp8_projections(block, torch.bfloat16)
    model = torch.nn.ModuleList(layers)
    backend = TorchBackend(FastPath(fused_ops=True, fused_projections=True))
    bind_backend(model, backend)
    assert [layer.fused_decode_max_tokens for layer in layers] == \
        [FUSED_QKV_MAX_TOKENS, FUSED_GATE_UP_MAX_TOKENS, FUSED_SPLIT_K_MAX_TOKENS]
    for layer in layers:
        assert layer.fits_fused_decode() and layer.fp8_linear is not None
        assert layer.weight.dtype == torch.float8_e4m3fn
        assert layer.fused_scales()["w_block"] == block
        assert layer.fused_scales()["w_scale"] is getattr(layer, layer.quant.scale_name)
    bind_backend(model, backend, {layer_class(layer): 8 for layer in layers})
    assert all(layer.fused_decode_max_tokens == 8 for layer in layers)
    bind_backend(model, TorchBackend(FastPath(fused_ops=True)))
    assert not any(layer.fused_decode_max_tokens for layer in layers)


@pytest.mark.parametrize("block,dtype", [((128, 64), torch.bfloat16), ((32, 128), torch.float16),
                                         ((128, 128), torch.float32), (None, torch.float32)])
def test_fp8_layers_the_kernels_do_not_take_run_their_fp8_gemm(block, dtype):
    """Blocks other than (a multiple of 64, 128), and float32 activations, keep the FP8 GEMM."""
    layers = fp8_projections(block, dtype)
    bind_backend(torch.nn.ModuleList(layers),
                 TorchBackend(FastPath(fused_ops=True, fused_projections=True)))
    for layer in layers:
        assert not layer.fits_fused_decode()
        assert layer.fused_decode_max_tokens == 0
        assert layer.fp8_linear is not None


def test_a_checkpoint_missing_a_scale_is_a_value_error(tiny_model, tmp_path):
    """An FP8 checkpoint without one weight's scale fails the load, naming the parameter,
    where it loaded with uninitialised scales."""
    from safetensors.torch import load_file, save_file

    from nanovllm import LLM
    from tests.fp8_checkpoints import quantize_checkpoint
    path = quantize_checkpoint(tiny_model, str(tmp_path / "fp8"), "block")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    name = next(n for n in sorted(tensors) if n.endswith("down_proj.weight_scale_inv"))
    del tensors[name]
    save_file(tensors, file)
    with pytest.raises(ValueError, match=f"no tensor for 1 parameter.*{name}"):
        LLM(path, device="cpu", num_kvcache_blocks=8)

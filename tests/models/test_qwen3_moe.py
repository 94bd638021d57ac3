"""Qwen3-MoE: greedy tokens equal transformers' (float32, CPU), alone, TP=2 and with the Triton
backend interpreted; config reading and both checkpoint forms of the experts."""
import json
import os
import shutil

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.config import check_tensor_parallel, read_config_json  # noqa: E402
from nanovllm.layers.fused_moe import expert_weight_target  # noqa: E402
from nanovllm.models.registry import decoder_spec  # noqa: E402
from tests.conftest import MOE_CHECKPOINTS  # noqa: E402
from tests.models.test_families import generate, hf_tokens, prompts  # noqa: E402
from tests.reference import hf_greedy, load_hf  # noqa: E402


@pytest.mark.parametrize("name", list(MOE_CHECKPOINTS))
def test_greedy_tokens_match_transformers(moe_checkpoints, name):
    path, batch = moe_checkpoints[name], prompts()[:3]
    ours = generate(path, batch)
    assert ours == hf_tokens(path, batch)
    assert len(set(ours[1])) > 3, "degenerate checkpoint: greedy repeats a token"


@pytest.mark.parametrize("name", ["moe_norm_dense", "moe_raw_sparse"])
def test_tensor_parallel_matches_transformers(moe_checkpoints, name):
    """TP=2 over gloo (on CPU, also where a GPU is: one GPU cannot hold two ranks): each rank
    holds half of every expert's intermediate dimension."""
    path, batch = moe_checkpoints[name], prompts(seed=1)[:3]
    assert generate(path, batch, tensor_parallel_size=2, device="cpu") == hf_tokens(path, batch)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU: the interpreter (tests/gpu on CUDA)")
def test_triton_backend_runs_the_fused_kernel_in_the_model(moe_checkpoints):
    """The Triton backend's experts (the fused MoE kernel, interpreted) inside the model."""
    path, batch = moe_checkpoints["moe_raw_sparse"], [[5, 6, 7, 8, 9, 10, 11], prompts()[2]]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(path, attention_backend="triton", num_kvcache_blocks=8)
    try:
        assert llm.model_runner.backend.fused_moe.__module__ == "nanovllm.kernels.moe.fused_moe"
        ours = [o["token_ids"] for o in llm.generate(batch, greedy, use_tqdm=False)]
    finally:
        llm.shutdown()
    hf = load_hf(path)
    assert ours == [hf_greedy(hf, p, 6) for p in batch]


def test_sparse_layers_follow_transformers_rule(moe_checkpoints):
    specs = {name: decoder_spec(read_config_json(path)).moe
             for name, path in moe_checkpoints.items()}
    assert specs["moe_norm_dense"].sparse_layers == (True, False)
    assert specs["moe_raw_sparse"].sparse_layers == (True, True, True)
    assert specs["moe_step2"].sparse_layers == (False, True, False)
    assert (specs["moe_raw_sparse"].num_experts, specs["moe_raw_sparse"].top_k) == (16, 4)


def _rewrite_config(src: str, dst: str, **changes) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def test_num_experts_read_from_either_name(moe_checkpoints, tmp_path):
    src = moe_checkpoints["moe_norm_dense"]
    released = _rewrite_config(src, str(tmp_path / "a"), num_local_experts=None, num_experts=8)
    assert decoder_spec(read_config_json(released)).moe.num_experts == 8
    clash = _rewrite_config(src, str(tmp_path / "b"), num_experts=4)
    with pytest.raises(ValueError, match="expert counts disagree"):
        read_config_json(clash)
    too_many = _rewrite_config(src, str(tmp_path / "c"), num_experts_per_tok=9)
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        read_config_json(too_many)
    bad_layer = _rewrite_config(src, str(tmp_path / "d"), mlp_only_layers=[2])
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[2\]"):
        read_config_json(bad_layer)


def test_tensor_parallel_must_divide_the_expert_width(moe_checkpoints, tmp_path):
    odd = _rewrite_config(moe_checkpoints["moe_norm_dense"], str(tmp_path / "odd"),
                          moe_intermediate_size=33)
    with pytest.raises(ValueError, match="does not divide moe_intermediate_size=33"):
        check_tensor_parallel(2, "cpu", read_config_json(odd))


def test_stacked_expert_checkpoint_gives_the_same_tokens(moe_checkpoints, tmp_path):
    """transformers' in-memory form (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]) loads into the same parameters as one tensor per expert."""
    src = moe_checkpoints["moe_norm_dense"]
    dst = _rewrite_config(src, str(tmp_path / "stacked"))
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    stacked, per_expert = {}, {}
    for name, weight in tensors.items():
        if (target := expert_weight_target(name)) is None:
            stacked[name] = weight
        else:
            per_expert.setdefault((name.split(".experts.")[0], target[1]), {})[target[2]] = weight
    for (prefix, shard), by_expert in per_expert.items():
        experts = torch.stack([by_expert[e] for e in sorted(by_expert)])
        if shard == "w2":
            stacked[f"{prefix}.experts.down_proj"] = experts
        elif shard == "w1":
            up = torch.stack([w for _, w in sorted(per_expert[(prefix, "w3")].items())])
            stacked[f"{prefix}.experts.gate_up_proj"] = torch.cat([experts, up], dim=1)
    assert "model.layers.0.mlp.experts.gate_up_proj" in stacked
    assert not any(".experts.0." in name for name in stacked)
    save_file(stacked, os.path.join(dst, "model.safetensors"))
    batch = prompts()[:2]
    assert generate(dst, batch) == generate(src, batch)


@pytest.mark.parametrize("ignored, quantized", [
    ([], True),
    ([f"model.layers.0.mlp.experts.{e}.{p}" for e in range(8)
      for p in ("gate_proj", "up_proj", "down_proj")], False),  # compressed-tensors' names
    (["re:.*mlp\\.experts\\..*"], False),
    (["model.layers.0.mlp.experts"], False),
    (["model.layers.0.mlp.experts.3.down_proj"], None),  # one expert: not as a whole
])
def test_ignored_experts_are_matched_by_their_own_names(moe_checkpoints, ignored, quantized):
    """An ignore list names each expert's projections (llm-compressor writes every unquantized
    Linear): all of a layer's experts ignored keep it unquantized, some of them are a
    ValueError (the fused experts are quantized as a whole)."""
    from nanovllm.layers.fused_moe import FusedMoE
    from nanovllm.layers.quantization import QuantConfig
    from nanovllm.models.registry import build_model
    hf_config = read_config_json(moe_checkpoints["moe_norm_dense"])
    quant = QuantConfig("compressed-tensors", None, "weight_scale", tuple(ignored))
    if quantized is None:
        with pytest.raises(ValueError, match="as a whole"):
            build_model(hf_config, quant)
        return
    experts = next(m for m in build_model(hf_config, quant).modules()
                   if isinstance(m, FusedMoE))
    assert (experts.quant is not None) == quantized

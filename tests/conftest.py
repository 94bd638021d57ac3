"""Shared fixtures: tiny random checkpoints of every family, built once per test session."""
import os

# The interpreter runs tl.dot on numpy: threaded OpenBLAS on a small busy CPU is slower for
# these tiny matmuls. Takes effect only before numpy's first import.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run interpreted on CPU. Set before anything imports triton: some
    # transformers versions import it with their models, and triton 3.6 reads the flag then.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from benchmarks.random_checkpoints import build_checkpoint  # noqa: E402
from nanovllm.utils.context import reset_context  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreted_bf16_dots(monkeypatch) -> None:
    """The Triton 3.8 interpreter's tl.dot multiplies bf16 operands' bit patterns (numpy holds
    bf16 as uint16): under the interpreter they are widened to float32 first, exactly."""
    builder = getattr(interpreter, "InterpreterBuilder", None)
    dot = getattr(builder, "create_dot", None)
    if not triton.knobs.runtime.interpret or dot is None or not hasattr(builder, "cast_impl"):
        return

    def create_dot(self, a, b, *args):
        a, b = (self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x
                for x in (a, b))
        return dot(self, a, b, *args)
    monkeypatch.setattr(builder, "create_dot", create_dot)


@pytest.fixture(autouse=True)
def _interpreted_integer_masks(monkeypatch) -> None:
    """The Triton 3.9 interpreter can hold a mask anded from a tensor and a scalar condition as
    integers (its comparisons keep their operands' type), which its C++ load and store refuse:
    they get the mask as bools, as 3.8's took it (compiled kernels never see this)."""
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if not triton.knobs.runtime.interpret or builder is None:
        return
    for name, at in (("create_masked_load", 1), ("create_masked_store", 2)):
        op = getattr(builder, name, None)
        if op is None:
            continue

        def masked(self, *args, op=op, at=at, **kwargs):
            mask = args[at]  # its data: numpy, or (3.8, some loads) a memoryview, left alone
            if getattr(getattr(mask, "data", None), "dtype", np.bool_) != np.bool_:
                mask = interpreter.TensorHandle(mask.data.astype(np.bool_), tl.int1)
            return op(self, *args[:at], mask, *args[at + 1:], **kwargs)
        monkeypatch.setattr(builder, name, masked)


# name -> shape overrides of TINY_SHAPE; together they cover tied/untied embeddings,
# GQA ratios 1, 2 and 4, and head_dim 16..64.
CHECKPOINTS = {
    "untied_gqa2_d16": dict(),
    "tied_mha_d32": dict(tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=4,
                         head_dim=32, hidden_size=96),
    "untied_gqa4_d64": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                            hidden_size=128, num_hidden_layers=3),
}

# name -> (family, config fields): biases, explicit head_dim, tied/untied, every RoPE variant,
# sliding windows (64: smaller than a 256-token block) and Qwen2's max_window_layers rule.
FAMILY_CHECKPOINTS = {
    "qwen2_yarn": ("Qwen2", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64))),
    "qwen2_window": ("Qwen2", dict(use_sliding_window=True, sliding_window=64,
                                   max_window_layers=1)),
    "llama3_bias_tied": ("Llama", dict(
        attention_bias=True, mlp_bias=True, tie_word_embeddings=True, head_dim=32,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=64))),
    "llama_linear": ("Llama", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                   hidden_size=128, rope_parameters=dict(
                                       rope_type="linear", rope_theta=10000.0, factor=4.0))),
    "mistral_window": ("Mistral", dict(sliding_window=64)),
}

# name -> Qwen3-MoE config fields: renormalised top-k with a dense layer (mlp_only_layers), raw
# top-k with every layer sparse (decoder_sparse_step 1), and a dense odd layer via the step.
MOE_CHECKPOINTS = {
    "moe_norm_dense": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                           norm_topk_prob=True, mlp_only_layers=[1]),
    "moe_raw_sparse": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=48,
                           norm_topk_prob=False, num_hidden_layers=3),
    "moe_step2": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                      norm_topk_prob=True, decoder_sparse_step=2, num_hidden_layers=3),
}


@pytest.fixture(scope="session")
def moe_checkpoints(tmp_path_factory) -> dict[str, str]:
    """Build every Qwen3-MoE checkpoint once; returns name -> directory."""
    root = tmp_path_factory.mktemp("moe")
    return {name: build_checkpoint(str(root / name), seed=20 + i, family="Qwen3Moe", **fields)
            for i, (name, fields) in enumerate(MOE_CHECKPOINTS.items())}


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory) -> dict[str, str]:
    """Build every family checkpoint once; returns name -> directory."""
    root = tmp_path_factory.mktemp("family")
    return {name: build_checkpoint(str(root / name), seed=10 + i, family=family, **fields)
            for i, (name, (family, fields)) in enumerate(FAMILY_CHECKPOINTS.items())}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Build every tiny checkpoint once; returns name -> directory."""
    root = tmp_path_factory.mktemp("ckpt")
    return {name: build_checkpoint(str(root / name), seed=i, **shape)
            for i, (name, shape) in enumerate(CHECKPOINTS.items())}


@pytest.fixture(scope="session")
def tiny_model(checkpoints) -> str:
    return checkpoints["untied_gqa2_d16"]


@pytest.fixture(autouse=True)
def _fresh_context():
    """No test sees another test's forward context."""
    reset_context()
    yield
    reset_context()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)

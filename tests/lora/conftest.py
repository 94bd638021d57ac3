"""Tiny adapters of the session's tiny checkpoints, built once."""
import pytest

from tests.lora.helpers import build_adapter

# name -> build_adapter options: every target, a subset with rsLoRA, attention only at rank 8
ADAPTERS = {
    "all_r4": dict(seed=1, r=4, alpha=8),
    "qv_rslora": dict(seed=2, r=2, alpha=4, target_modules=["q_proj", "v_proj", "down_proj"],
                      use_rslora=True),
    "attn_r8": dict(seed=3, r=8, alpha=16, target_modules=["k_proj", "o_proj", "up_proj"]),
    "mlp_r4": dict(seed=4, r=4, alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"]),
}


@pytest.fixture(scope="session")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    """name -> PEFT directory of an adapter of tiny_model."""
    root = tmp_path_factory.mktemp("lora")
    return {name: build_adapter(tiny_model, str(root / name), **options)
            for name, options in ADAPTERS.items()}

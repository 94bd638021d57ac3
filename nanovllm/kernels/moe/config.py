"""Launch configurations of the fused MoE GEMMs: a tuned table per shape, else the default rule.

_TUNED holds configs/<shape>.json, the fastest correct launch per slot-count bucket that
`python -m benchmarks.moe_sweep` measured on the GPU; a shape or size it lacks falls back to
default_config, the fixed configuration the kernels launched with before the tables existed.
"""
import json
import os
from pathlib import Path
from typing import NamedTuple


class MoEConfig(NamedTuple):
    """Tile sizes and launch options of both grouped GEMMs of one fused_moe call."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3  # Triton's own launch defaults on CUDA (4 warps, 3 stages)


CONFIG_DIR = Path(__file__).with_name("configs")


def load_tuned(config_dir: Path = CONFIG_DIR) -> dict[tuple[str, int], MoEConfig]:
    """The tuned tables in config_dir: <shape_key>.json, {"configs": {max slots: [block_m,
    block_n, block_k, num_warps, num_stages]}}, as the GPU sweep writes them."""
    tuned = {}
    for path in sorted(config_dir.glob("*.json")):
        for slots, config in json.loads(path.read_text())["configs"].items():
            tuned[path.stem, int(slots)] = MoEConfig(*config)
    return tuned


# (shape_key(...), max slots) -> config, for calls of up to that many slots (tokens x top_k)
# and more than the next smaller bucket's; above the largest bucket, the largest's
_TUNED: dict[tuple[str, int], MoEConfig] = load_tuned()


def block_m_for(num_slots: int, num_experts: int) -> int:
    """Rows per block: small when each expert gets few slots (decode), to waste little padding."""
    per_expert = num_slots / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def shape_key(num_experts: int, hidden: int, inter: int, fp8: bool) -> str:
    """_TUNED's shape part: experts, hidden size, (this rank's) intermediate size, weight kind."""
    return f"E{num_experts}_H{hidden}_I{inter}_{'fp8' if fp8 else 'bf16'}"


def default_config(num_slots: int, num_experts: int, fp8: bool) -> MoEConfig:
    """64-wide column tiles; FP8 experts step K 128 wide (a weight-scale block's width): half a
    16-bit tile's bytes per step at 64 would leave too few bytes in flight for the halved
    weights to pay."""
    return MoEConfig(block_m_for(num_slots, num_experts), 64, 128 if fp8 else 64)


def _tuned(key: str, num_slots: int) -> MoEConfig | None:
    """The table's entry for the smallest bucket that holds num_slots, or its largest bucket."""
    buckets = sorted(bucket for k, bucket in _TUNED if k == key)
    if not buckets:
        return None
    return _TUNED[key, next((b for b in buckets if num_slots <= b), buckets[-1])]


def moe_config(num_slots: int, num_experts: int, hidden: int, inter: int, fp8: bool,
               act_bytes: int = 2) -> MoEConfig:
    """The launch configuration for these shapes: a tuned one where _TUNED has the shape. The
    tables hold 16-bit activations' launches (act_bytes 2): float32 tiles take twice the
    shared memory, so wider activations keep the default."""
    # NANOVLLM_MOE_TUNED=0: the default everywhere (A/B runs), read per call
    if _TUNED and act_bytes == 2 and os.environ.get("NANOVLLM_MOE_TUNED", "1") != "0":
        tuned = _tuned(shape_key(num_experts, hidden, inter, fp8), num_slots)
        if tuned is not None:
            return tuned
    return default_config(num_slots, num_experts, fp8)

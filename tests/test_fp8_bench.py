"""benchmarks/fp8.py on CPU: one engine's figures from FP8 dummy weights, and the report."""
import json
import os

from benchmarks import fp8, workloads
from benchmarks.random_checkpoints import build_checkpoint
from benchmarks.shapes import WEIGHT_FORMATS


def test_fp8_benchmark_figures_and_report(tmp_path, monkeypatch, capsys):
    path = build_checkpoint(str(tmp_path / "tiny"), hidden_size=128, intermediate_size=256,
                            head_dim=32)
    os.remove(os.path.join(path, "model.safetensors"))  # dummy weights: config.json alone
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = dict(WEIGHT_FORMATS["fp8-block"], weight_block_size=[32, 32])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    monkeypatch.setattr(fp8, "TPOT_SHAPES", ("tiny",))
    monkeypatch.setattr(fp8, "TPOT_TOKENS", 8)
    standard = workloads.standard(num_seqs=3, input_len=(10, 20), output_len=(4, 6), max_id=300,
                                  seed=0)
    row = fp8.run_engine(path, "tiny", None, standard)
    assert set(row) == {"weights_gib", "kv_blocks", "tpot_b1_ms", "standard_tok_s"}
    assert row["tpot_b1_ms"] > 0 and row["kv_blocks"] > 0
    bf16 = dict(row, weights_gib=2 * row["weights_gib"], tpot_b1_ms=2 * row["tpot_b1_ms"])
    fp8.report({("tiny", "bf16"): [bf16] * 3, ("tiny", "fp8-block"): [row] * 3})
    out = capsys.readouterr().out
    assert "weights 0.50x" in out and "batch-1 TPOT 2.00x faster" in out

"""benchmarks.decode_step: every host phase is timed, nested phases fit in their parents, and
the phase floors add up to the step's floor (CPU, tiny model)."""
import pytest

from benchmarks.decode_step import (
    PHASES,
    HostPhases,
    exclusive_times,
    main,
    phase_floors,
    phase_of,
)
from benchmarks.floor import BYTES, kv_bytes_per_token, step_params
from benchmarks.shapes import SHAPES


@pytest.mark.parametrize("lora_rank", [0, 8])
def test_tiny_run_times_every_phase(lora_rank, capsys):
    result = main(["--tiny", "--tokens", "12", "--batch", "2", "--lora-rank", str(lora_rank)])
    host = result["host_us"]
    # 12 tokens: the prefill samples the first, then 11 decode steps and the last commit
    assert result["steps"] == 12
    assert set(host) == {label for label, *_ in PHASES}
    assert all(us > 0 for us in host.values())
    for parent, child in (("step", "launch"), ("launch", "sample"), ("sample", "sampler launch"),
                          ("decode inputs: pack, copy, carry", "pack"),
                          ("commit", "wait for the ids")):
        assert host[parent] >= host[child]
    assert result["gpu_us"] > 0
    # a step's median wall time: at least half the 12 steps take as long, so 6 of them fit
    # in the run's total
    assert 0 < 6 * result["wall_median_us"] <= result["wall_us"] * result["steps"]
    out = capsys.readouterr().out
    assert "| - - - pack |" in out and "(median " in out


def test_max_model_len_reaches_the_engine():
    """--max-model-len sets the engine's (a graph's decode splits follow it); 1024 for --tiny."""
    assert main(["--tiny", "--tokens", "3", "--max-model-len", "640"])["max_model_len"] == 640
    assert main(["--tiny", "--tokens", "3"])["max_model_len"] == 1024


def test_wrapped_methods_are_restored():
    class Owner:
        def method(self):
            return 1

    owner, phases = Owner(), HostPhases()
    phases.wrap(owner, "method", "m")
    phases.wrap(Owner, "method", "class")
    assert owner.method() == 1 and set(phases.totals) == {"m"}
    phases.restore()
    assert "method" not in vars(owner) and Owner().method() == 1
    Owner().method()
    assert set(phases.totals) == {"m"}  # the class's timer is gone too


def test_phase_floors_cover_the_dense_step():
    """qkv, o + down, gate_up, the K/V and the LM head are all a dense decode step reads (but
    the norms' few weights)."""
    shape, batch, context, bw = SHAPES["llama-3.1-8b"], 1, 256, 4.27e12
    floors = phase_floors(shape, batch, context, BYTES, bw)
    total = 1e6 * (step_params(shape, batch) * BYTES
                   + batch * context * kv_bytes_per_token(shape)) / bw
    assert sum(floors.values()) == pytest.approx(total, rel=1e-3)


def test_overlapping_kernels_count_once():
    """A kernel launched early (PDL) is charged only from its predecessor's end; gaps and a
    kernel inside another's span add nothing."""
    times = exclusive_times([("gemm", 0.0, 10.0), ("norm", 4.0, 13.0), ("gemm", 20.0, 25.0),
                             ("tiny", 21.0, 22.0)])
    assert times == {"gemm": [15.0, 2], "norm": [3.0, 1], "tiny": [0.0, 1]}
    assert sum(us for us, _ in times.values()) == 18.0  # the GPU's busy time


def test_kernel_names_map_to_their_phases():
    assert phase_of("_split_k_kernel") == "o_proj, down_proj (split K)"
    assert phase_of("_w8a8_gemm_kernel").startswith("FP8 GEMMs")
    assert phase_of("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n").startswith("FP8 GEMMs")
    assert phase_of("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_TNN") == "LM head, other GEMMs"
    assert phase_of("_rms_norm_kernel") == "add + RMSNorm"
    assert phase_of("_gemv_rows_kernel").startswith("qkv")  # with the input norm or without

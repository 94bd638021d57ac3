"""Launch configurations of the fused MoE kernel: the default and tuned-table choice, the tables
shipped, every configuration the GPU sweep tries agreeing with the default (TRITON_INTERPRET on
CPU), and every shipped configuration compiling for sm_90 within its shared memory."""
import json
import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402

from nanovllm.kernels.linear.fp8_reference import quantize_groups  # noqa: E402
from nanovllm.kernels.moe import config as moe_cfg  # noqa: E402
from nanovllm.kernels.moe import fused_moe as module  # noqa: E402
from nanovllm.kernels.moe.config import MoEConfig, moe_config  # noqa: E402
from nanovllm.kernels.moe.fused_moe import fused_moe  # noqa: E402
from nanovllm.kernels.moe.reference import select_experts_torch as select_experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_default_config_is_the_fixed_launch(monkeypatch):
    """Without a table entry: block_m_for's rows, 64 columns, K steps of 64 (FP8: 128), and
    Triton's default 4 warps and 3 stages."""
    monkeypatch.setattr(moe_cfg, "_TUNED", {})
    assert moe_config(8, 128, 2048, 768, False) == MoEConfig(16, 64, 64, 4, 3)
    assert moe_config(512 * 8, 128, 2048, 768, True) == MoEConfig(32, 64, 128, 4, 3)
    assert moe_config(8192 * 8, 128, 2048, 768, True) == MoEConfig(64, 64, 128, 4, 3)


def test_tuned_table_is_consulted_by_slot_bucket(monkeypatch):
    """An entry serves up to its bucket's slots (above the next smaller one); past the largest
    bucket the largest's; other shapes and weight kinds keep the default."""
    small, large = MoEConfig(16, 128, 128, 8, 4), MoEConfig(64, 128, 128, 4, 5)
    key = moe_cfg.shape_key(128, 2048, 768, True)
    assert key == "E128_H2048_I768_fp8"
    monkeypatch.setattr(moe_cfg, "_TUNED", {(key, 64): small, (key, 1024): large})
    assert [moe_config(s, 128, 2048, 768, True) for s in (1, 64, 65, 1024, 99999)] == \
        [small, small, large, large, large]
    assert moe_config(64, 128, 2048, 768, False) == MoEConfig(16, 64, 64, 4, 3)
    assert moe_config(64, 128, 4096, 768, True) == MoEConfig(16, 64, 128, 4, 3)


def test_fused_moe_launches_the_tuned_config(monkeypatch):
    """fused_moe asks moe_config when given no config (16-bit activations: the tables' own),
    and takes a given one as it is."""
    tuned = MoEConfig(64, 128, 64, 8, 2)
    monkeypatch.setattr(moe_cfg, "_TUNED", {(moe_cfg.shape_key(4, 64, 32, False), 1 << 20): tuned})
    seen, align = [], module.moe_align_block_size
    monkeypatch.setattr(module, "moe_align_block_size",
                        lambda ids, e, block_m: seen.append(block_m) or align(ids, e, block_m))
    x, w13, w2, weights, ids = _inputs("bfloat16", 3, 4, 2, 64, 32)
    fused_moe(x, w13, w2, weights, ids)
    fused_moe(x, w13, w2, weights, ids, config=MoEConfig(32, 64, 64))
    fused_moe(x.float(), w13.float(), w2.float(), weights.float(), ids)  # float32: the default
    assert seen == [64, 32, 16]


def _inputs(kind: str, tokens: int, experts: int, top_k: int, hidden: int, inter: int):
    """(x, w13, w2, weights, ids[, w13_scale, w2_scale, block]) of random experts."""
    g = torch.Generator().manual_seed(tokens)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5
    x = torch.randn(tokens, hidden, generator=g) * 2.0 ** torch.randint(-4, 5, (tokens, 1),
                                                                         generator=g)
    weights, ids = select_experts(torch.randn(tokens, experts, generator=g), top_k, True)
    if not kind.startswith("fp8"):
        dtype = getattr(torch, kind)
        return [t.to(DEVICE, dtype) for t in (x, w13, w2, weights)] + [ids.to(DEVICE)]
    block, quantized = (128, 128), []
    for w in (w13, w2):
        codes, scales = zip(*(quantize_groups(e, *block) for e in w))
        quantized += [torch.stack(codes), torch.stack(scales)]
    w13_q, w13_s, w2_q, w2_s = (t.to(DEVICE) for t in quantized)
    return [x.to(DEVICE), w13_q, w2_q, weights.to(DEVICE), ids.to(DEVICE), w13_s, w2_s, block]


# every value the sweep tries, each changed alone from a default of (32, 64, K step, 4, 3)
SWEEP = [(16, 64, 4, 3), (64, 64, 4, 3), (32, 128, 4, 3), (32, 64, 8, 3), (32, 64, 4, 2),
         (32, 64, 4, 4)]


@pytest.mark.parametrize("config", SWEEP, ids=lambda c: "m{}_n{}_w{}_s{}".format(*c))
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "fp8"])
def test_every_config_matches_the_default(kind, config, monkeypatch):
    """Same result as the default configuration: float32 and bf16 experts (bf16 also with K
    steps of 128: float32's overflow shared memory on the GPU), block-scaled FP8 experts at
    128 x 128 (I = 192: a partial last K group, up rows in a gate row's block)."""
    fp8 = kind.startswith("fp8")
    args = _inputs(kind, 9, 4, 2, *((256, 192) if fp8 else (96, 80)))
    block_k = 128 if fp8 else 64
    default = fused_moe(*args, config=MoEConfig(32, 64, block_k))
    block_m, block_n, warps, stages = config
    outs = [fused_moe(*args, config=MoEConfig(block_m, block_n, block_k, warps, stages))]
    if kind == "bfloat16":
        outs.append(fused_moe(*args, config=MoEConfig(block_m, block_n, 128, warps, stages)))
    # bf16 sums in another order at K steps of 128 and rounds h from it
    rtol = {"float32": 1e-5, "bfloat16": 1e-2}.get(kind, 1e-3)
    for out in outs:
        torch.testing.assert_close(out, default, rtol=rtol,
                                   atol=rtol * default.abs().max().item())


def test_tables_load_and_the_switch(tmp_path, monkeypatch):
    """load_tuned reads <shape key>.json tables; NANOVLLM_MOE_TUNED=0 keeps the default."""
    (tmp_path / "E4_H64_I32_bf16.json").write_text(json.dumps(
        {"measured_on": "test", "configs": {"16": [64, 128, 64, 8, 2]}}))
    table = moe_cfg.load_tuned(tmp_path)
    assert table == {("E4_H64_I32_bf16", 16): MoEConfig(64, 128, 64, 8, 2)}
    monkeypatch.setattr(moe_cfg, "_TUNED", table)
    assert moe_config(8, 4, 64, 32, False) == MoEConfig(64, 128, 64, 8, 2)
    monkeypatch.setenv("NANOVLLM_MOE_TUNED", "0")
    assert moe_config(8, 4, 64, 32, False) == moe_cfg.default_config(8, 4, False)


def test_shipped_tables():
    """The package ships the H200 sweep's table of Qwen3-30B-A3B's bf16 experts, every entry a
    valid launch (FP8 entries step K by a whole 128-wide scale block)."""
    assert ("E128_H2048_I768_bf16", 8) in moe_cfg._TUNED
    for (key, slots), c in moe_cfg._TUNED.items():
        assert c.block_m in (16, 32, 64) and c.block_n in (64, 128) and slots > 0
        assert c.block_k == 128 if key.endswith("fp8") else c.block_k in (64, 128)


_COMPILE_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nanovllm.kernels.moe import config, fused_moe as m
for kernel in (m._gate_up_silu_kernel, m._down_kernel):
    names = [p.name for p in kernel.params]
    for (key, slots), c in sorted(config._TUNED.items()):
        fp8 = key.endswith("fp8")
        consts = dict(PRECISION="tf32", FP8=fp8, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
                      BLOCK_K=c.block_k)
        w = "fp8e4nv" if fp8 else "bf16"
        types = {n: "*fp32" for n in ("xs_ptr", "hs_ptr", "ws_ptr", "weights_ptr")}
        types.update(h_ptr="*bf16", out_ptr="*bf16")
        types.update({names[0]: "*" + w, names[1]: "*" + w})
        sig = {n: "constexpr" if n in consts else types.get(n, "*i32" if n.endswith("_ptr")
                                                           else "i32") for n in names}
        # pointers, strides and sizes divisible by 16, as a launch specialises them: the loads
        # are then pipelined at the entry's stages, as on the GPU
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                 if n not in consts and n not in ("num_slots", "top_k")}
        src = ASTSource(fn=kernel, signature=sig, attrs=attrs,
                        constexprs={(names.index(n),): v for n, v in consts.items()})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=c.num_warps, num_stages=c.num_stages))
        print(key, slots, k.metadata.shared)
"""


def test_sm90_shipped_configs_fit():
    """Compiled for sm_90 (no GPU needed; a process without the interpreter), both GEMMs at
    every shipped table entry fit an H200 SM's 227 KB of shared memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line.split() for line in out.stdout.splitlines()]
    assert len(lines) == 2 * len(moe_cfg._TUNED), out.stdout
    assert all(int(shared) <= 227 * 1024 for *_, shared in lines), out.stdout


def test_sweep_writes_what_the_loader_reads(tmp_path, capsys):
    """benchmarks.moe_sweep's table of the fastest configurations loads back as _TUNED entries
    keyed by slots; its dry run lists a grid with each default in it."""
    from benchmarks import moe_sweep
    best = dict(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=2)
    summary = [dict(mode="bf16", tokens=32, best=best), dict(mode="fp8", tokens=32, best=None),
               dict(mode="bf16", tokens=8192, best=None)]
    moe_sweep.write_table(summary, "bf16", tmp_path)
    assert moe_cfg.load_tuned(tmp_path) == {("E128_H2048_I768_bf16", 256): MoEConfig(**best)}
    assert all(moe_sweep.default_for(m, t) in moe_sweep.grid(m, t, quick=True)
               for m in moe_sweep.MODES for t in moe_sweep.TOKENS)


@pytest.mark.parametrize("budget,max_num_seqs", [(16384, 512), (3000, 64), (512, 256)])
def test_warm_up_reaches_every_tuned_bucket(budget, max_num_seqs):
    """Each table entry is one kernel variant: start-up's steps (runner.warmup's prefill
    lengths, the decode graphs' batch sizes) reach every bucket a run can reach, so no tuned
    variant first compiles inside a user's run (top 8 of Qwen3-30B-A3B)."""
    from nanovllm.runner.cuda_graphs import graph_batch_sizes
    from nanovllm.runner.warmup import prefill_lengths
    top_k = 8
    warm = {top_k * n for n in [1, *graph_batch_sizes(max_num_seqs), *prefill_lengths(budget)]}
    reachable = range(top_k, top_k * max(budget, max_num_seqs) + 1, top_k)
    for key in {k for k, _ in moe_cfg._TUNED}:
        buckets = sorted(b for k, b in moe_cfg._TUNED if k == key)
        bounds = list(zip([0, *buckets[:-1]], buckets[:-1] + [float("inf")]))
        for low, high in bounds:  # a bucket's slot range (the largest serves everything above)
            if any(low < s <= high for s in reachable):
                assert any(low < s <= high for s in warm), (key, low, high)

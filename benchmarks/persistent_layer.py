"""The persistent decode layer (kernels.persistent) against the per-kernel decode path, GPU time.

python -m benchmarks.persistent_layer [--shape qwen3-0.6b] [--batches 1 16] [--context 384]
                                      [--rounds 3] [--tiny]

A stack of the shape's dense layers (random bf16 weights in the layouts the model keeps) runs
one decode step as a CUDA graph, each way alternated per round: the per-kernel path (the
production kernels: add + RMSNorm over split-K partials, fused qkv + RoPE + K/V write, split
decode attention, split-K o_proj and down_proj, fused gate_up + SiLU), and the persistent layer
with and without its L2 prefetch. Also: one grid barrier against one PDL kernel boundary, and
the layers' outputs against each other, and each phase alone beside its floor. Prints tables
of us per step and per layer. --tiny: a two-layer toy shape on CPU under the interpreter (a
smoke run; its times mean nothing).
"""
import argparse
import os
import statistics
from time import perf_counter

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float16 on CPU: the Triton interpreter's bfloat16 arithmetic is wrong
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # --tiny: before triton is imported
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.floor import BYTES  # noqa: E402
from benchmarks.shapes import SHAPES  # noqa: E402
from nanovllm.kernels.attention.decode import decode_attention_triton  # noqa: E402
from nanovllm.kernels.fused_ops import add_partials_rms_norm, rms_norm  # noqa: E402
from nanovllm.kernels.linear.fused import gate_up_silu, qkv_rope_store  # noqa: E402
from nanovllm.kernels.linear.split_k import split_k_linear  # noqa: E402
from nanovllm.kernels.pdl import launch_options, wait_then_release  # noqa: E402
from nanovllm.kernels.persistent.decode_layer import (  # noqa: E402
    LayerWeights,
    PersistentDecodeLayer,
)
from nanovllm.kernels.persistent.sync import grid_sync  # noqa: E402

BLOCK = 256
DENSE = ("qwen3-0.6b", "llama-3.2-1b", "llama-3.1-8b")  # no bias, no experts, no window
TINY = dict(architectures=["Qwen3ForCausalLM"], hidden_size=256, intermediate_size=384,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128)


@triton.jit
def _barriers_kernel(bar_ptr, P, ROUNDS: tl.constexpr, POLL: tl.constexpr):
    """ROUNDS empty phases, each ended by a grid barrier."""
    for _ in range(ROUNDS):
        grid_sync(bar_ptr, P, POLL)


@triton.jit
def _pdl_kernel(USE_PDL: tl.constexpr):
    """An empty phase as its own PDL launch."""
    wait_then_release(USE_PDL)


def make_layers(cfg: dict, n: int) -> list[LayerWeights]:
    """Random layers: qkv and gate_up [out, in]; o and down stored k-major (RowParallelLinear)."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rand(*shape, scale=0.02):
        return torch.randn(*shape, device=DEVICE).mul_(scale).to(DTYPE)

    def kmajor(w):
        return w.t().contiguous().t()

    norm = cfg["architectures"][0].startswith("Qwen3")  # q/k norm
    return [LayerWeights(1 + rand(h, scale=0.1), rand((hq + 2 * hkv) * d, h),
                         1 + rand(d, scale=0.1) if norm else None,
                         1 + rand(d, scale=0.1) if norm else None, kmajor(rand(h, hq * d)),
                         1 + rand(h, scale=0.1), rand(2 * i, h), kmajor(rand(h, i)), 1e-6)
            for _ in range(n)]


def per_kernel_step(x, layers, cfg, inputs, caches, scale):
    """The production kernels' decode layers; returns the last layer's output."""
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    cos_sin, pos, slots, ctx, tables = inputs
    t = x.shape[0]
    parts, resid = None, x
    for w, (kc, vc) in zip(layers, caches):
        if parts is None:
            h = rms_norm(x, w.input_norm, w.eps)
        else:
            h, resid = add_partials_rms_norm(parts, resid, w.input_norm, w.eps)
        q = qkv_rope_store(h, w.qkv, None, hq, hkv, pos, w.q_norm, w.k_norm, w.eps,
                           cos_sin, kc, vc, slots)
        attn = decode_attention_triton(q, kc, vc, ctx, tables, scale)
        parts = split_k_linear(attn.view(t, -1), w.o)
        h, resid = add_partials_rms_norm(parts, resid, w.post_norm, w.eps)
        parts = split_k_linear(gate_up_silu(h, w.gate_up, None), w.down)
    return (parts.sum(0) + resid.float()).to(DTYPE)


def persistent_step(x, layers, kernels, inputs, caches, scale, kernel="default", **options):
    """The persistent layers as the engine runs them (layers.persistent_decode: a step small
    enough carries down_proj's partials between layers); options: prefetch, poll."""
    cos_sin, pos, slots, ctx, tables = inputs
    layer = kernels[kernel]
    carry = x.shape[0] <= layer.fuse_max_tokens
    for i, (w, (kc, vc)) in enumerate(zip(layers, caches)):
        x = layer(x, w, cos_sin, pos, slots, ctx, tables, kc, vc, scale,
                  x_partials=carry and i > 0, carry_out=carry and i < len(layers) - 1,
                  next_layer=layers[i + 1] if i + 1 < len(layers) else None, **options)
    return x


def graph_us(fn, replays: int = 20) -> tuple[float, torch.cuda.CUDAGraph, torch.Tensor]:
    """GPU us per replay of fn captured as a CUDA graph (and the graph's output); on CPU
    (--tiny, the interpreter) the wall time of one call."""
    if DEVICE == "cpu":
        start = perf_counter()
        out = fn()
        return (perf_counter() - start) * 1e6, None, out
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays, graph, out


def barrier_us(programs: int, rounds: int = 200) -> tuple[float, float, float]:
    """us per grid barrier (polled by volatile loads, by one thread's atomics) and per empty
    PDL kernel boundary, each in a CUDA graph."""
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    loads, atomics = (graph_us(lambda poll=poll: _barriers_kernel[(programs,)](
        counter, programs, rounds, poll))[0] for poll in (0, 1))
    pdl, _, _ = graph_us(lambda: [_pdl_kernel[(programs,)](**launch_options())
                                  for _ in range(rounds)])
    return loads / rounds, atomics / rounds, pdl / rounds


def step_inputs(batch: int, cfg: dict, context: int) -> tuple:
    """(x, (cos_sin, positions, slots, context_lens, block_tables), caches, scale) of a decode
    step of `batch` sequences holding `context` keys each (the last one this step's)."""
    n, d, hkv = cfg["num_hidden_layers"], cfg["head_dim"], cfg["num_key_value_heads"]
    pages = -(-context // BLOCK)
    caches = [torch.randn(2, batch * pages, BLOCK, hkv, d, device=DEVICE).to(DTYPE)
              for _ in range(n)]
    tables = torch.arange(batch * pages, device=DEVICE, dtype=torch.int32).view(batch, pages)
    ctx = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    pos = (ctx - 1).long()
    slots = tables[:, -1].long() * BLOCK + (context - 1) % BLOCK
    theta = 1e6 ** (-torch.arange(0, d, 2, device=DEVICE).float() / d)
    freqs = torch.outer(torch.arange(context + 1, device=DEVICE).float(), theta)
    inputs = (torch.cat((freqs.cos(), freqs.sin()), -1).contiguous(), pos, slots, ctx, tables)
    x = torch.randn(batch, cfg["hidden_size"], device=DEVICE).to(DTYPE)
    return x, inputs, caches, d ** -0.5


def run_batch(batch: int, cfg: dict, layers: list[LayerWeights],
              layer: dict[str, PersistentDecodeLayer], context: int, rounds: int) -> list[tuple]:
    """Each way's step, alternated for `rounds` rounds: rows of the table."""
    n = cfg["num_hidden_layers"]
    x, inputs, caches, scale = step_inputs(batch, cfg, context)
    ways = {"per-kernel": lambda: per_kernel_step(x, layers, cfg, inputs, caches, scale)}
    for name, options in PERSISTENT_WAYS.items():
        ways[name] = (lambda options=options: persistent_step(x, layers, layer, inputs, caches,
                                                                scale, **options))
    times: dict[str, list[float]] = {name: [] for name in ways}
    outs = {}
    for _ in range(rounds):
        for name, fn in ways.items():
            us, _, outs[name] = graph_us(fn)
            times[name].append(us)
    ref = outs["per-kernel"].float()
    rows = []
    for name, ts in times.items():
        err = (outs[name].float() - ref).abs().max().item() / ref.abs().max().item()
        med = statistics.median(ts)
        rows.append((batch, name, ts, med, med / n, err))
    return rows


PHASE_NAMES = ("qkv_proj + input norm", "q/k norm + RoPE + K/V write + attention",
               "o_proj + merge", "residual add", "gate_up_proj + post norm",
               "down_proj + SiLU-and-mul", "residual add")
# the persistent layer's variants: L2 prefetch (1 after the PDL wait, 2 before, 0 none) and the
# barrier's polling (1 one thread's atomics, 0 every thread's loads)
PERSISTENT_WAYS = {"persistent": dict(prefetch=3, poll=1),
                   "persistent, layer prefetched after the wait": dict(prefetch=1, poll=1),
                   "persistent, layer prefetched before the wait": dict(prefetch=2, poll=1),
                   "persistent, no prefetch": dict(prefetch=0, poll=1),
                   "persistent, barrier polled by loads": dict(prefetch=3, poll=0),
                   "persistent, 2 stages": dict(prefetch=3, poll=1, kernel="2 stages"),
                   "persistent, no fusing": dict(prefetch=3, poll=1, kernel="no fusing")}
# PersistentDecodeLayer's keyword arguments of each kernel the ways name
KERNELS = {"default": {}, "2 stages": dict(num_stages=2), "no fusing": dict(fuse_max_tokens=0)}


def phase_floors_bytes(cfg: dict, batch: int, context: int) -> tuple[float, ...]:
    """Bytes each phase must read at least (weights, K/V), per layer."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    kv = batch * context * hkv * d * 2 * BYTES
    return ((hq + 2 * hkv) * d * h * BYTES, kv, h * hq * d * BYTES, 0, 2 * i * h * BYTES,
            h * i * BYTES, 0)


def phase_table(batch: int, cfg: dict, layers: list[LayerWeights],
                layer: PersistentDecodeLayer, context: int, bandwidth: float) -> list[str]:
    """Each phase alone (no barrier, no prefetch) for every layer in a graph: us per layer
    beside its bandwidth floor."""
    x, inputs, caches, scale = step_inputs(batch, cfg, context)
    cos_sin, pos, slots, ctx, tables = inputs
    lines = []
    for p, (name, nbytes) in enumerate(zip(PHASE_NAMES, phase_floors_bytes(cfg, batch, context)),
                                       start=1):
        def run(p=p):
            for w, (kc, vc) in zip(layers, caches):
                layer(x, w, cos_sin, pos, slots, ctx, tables, kc, vc, scale, prefetch=0,
                      phase=p)
        us = statistics.median(graph_us(run)[0] for _ in range(3)) / len(layers)
        lines.append(f"| {batch} | {p} {name} | {us:.1f} | {nbytes / bandwidth * 1e6:.1f} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-0.6b", choices=DENSE)
    p.add_argument("--tiny", action="store_true", help="a two-layer toy shape on CPU (smoke)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=384, help="keys each sequence holds")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bandwidth", type=float, default=4.27e12, help="bytes/s (H200 copy)")
    args = p.parse_args()
    cfg = dict(TINY if args.tiny else SHAPES[args.shape])
    if args.tiny:
        args.batches, args.context, args.rounds = [b for b in args.batches if b <= 2], 40, 1
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    assert DEVICE == "cuda" or args.tiny, "a CUDA GPU, or --tiny"
    torch.manual_seed(0)
    layers = make_layers(cfg, cfg["num_hidden_layers"])
    layer = {name: PersistentDecodeLayer(
        cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
        cfg["hidden_size"], cfg["intermediate_size"], DTYPE, torch.device(DEVICE),
        programs=None if DEVICE == "cuda" else 4, **kwargs) for name, kwargs in KERNELS.items()}
    rows = []
    programs = layer["default"].programs
    loads, atomics, pdl = barrier_us(programs) if DEVICE == "cuda" else (float("nan"),) * 3
    print(f"grid barrier {loads:.2f} us polled by loads, {atomics:.2f} us by atomics; PDL "
          f"kernel boundary {pdl:.2f} us ({programs} programs)", flush=True)
    phases = []
    for batch in args.batches:
        rows += run_batch(batch, cfg, layers, layer, args.context, args.rounds)
        phases += phase_table(batch, cfg, layers, layer["no fusing"], args.context,
                              args.bandwidth)
    print("| batch | path | us per step (rounds) | median | us per layer | max diff vs "
          "per-kernel (of max) |\n|---|---|---|---|---|---|")
    for batch, name, ts, med, per_layer, err in rows:
        print(f"| {batch} | {name} | {' '.join(f'{t:.0f}' for t in ts)} | {med:.0f} | "
              f"{per_layer:.1f} | {err:.2e} |")
    print("\n| batch | phase alone (no barrier, no prefetch) | us per layer | floor us |\n"
          "|---|---|---|---|")
    print("\n".join(phases))


if __name__ == "__main__":
    main()

"""Paged decode attention alone on CUDA: time per layer and K/V read bandwidth.

Qwen3-0.6B's attention shape (16 query heads, 8 KV heads, head_dim 128, block 256) over a bf16 or
FP8 cache, every sequence at the same context length, blocks scattered over the pool; the
shipped Triton launch and, for bf16, FlashAttention when importable. Timed inside CUDA graphs.
--varied draws each sequence's length (uniform over 1..2*ctx-1, same mean), as in a decode batch
of the standard bench: equal lengths hide the load imbalance between programs. --splits-sweep adds
the Triton launch at other program targets (so other split counts); --fp8-sweep, FP8 launches at
other tile sizes, warp and stage counts. --orders adds each kernel over the same varied lengths
sorted longest first (/lf) and shortest first (/sf): kernels start their programs in some order.

    python -m benchmarks.decode_kernel [--json out.json] [--varied [--orders [lf,sf,unsorted]]]
        [--splits-sweep] [--fp8-sweep] [--shapes 32x1500,64x1400]
"""

import argparse
import json
from functools import partial
from itertools import product
from unittest import mock

import torch
import triton

from nanovllm.kernels import attention_triton_decode
from nanovllm.kernels.attention_triton_decode import decode_attention_triton

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 256
SHAPES = [(256, 840), (256, 1300), (128, 1000), (64, 1100), (16, 1200), (1, 1500)]
# programs the split count aims for (shipped: _TARGET_PROGRAMS)
TARGETS_SWEEP = [256, 1024, 2048, 4096]


def make_inputs(batch: int, ctx: int, kv_dtype: torch.dtype, varied: bool = False):
    """bf16 queries, a paged cache of random K/V (scattered blocks), context lengths, tables."""
    max_ctx = 2 * ctx - 1 if varied else ctx
    num_blocks = batch * triton.cdiv(max_ctx, BLOCK_SIZE)
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = (torch.randn(shape, device="cuda") * 0.5).to(kv_dtype)
    v_cache = (torch.randn(shape, device="cuda") * 0.5).to(kv_dtype)
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    gen = torch.Generator(device="cuda").manual_seed(0)
    lens = (torch.randint(1, max_ctx + 1, (batch,), device="cuda", dtype=torch.int32, generator=gen)
            if varied else torch.full((batch,), ctx, dtype=torch.int32, device="cuda"))
    return q, k_cache, v_cache, lens, tables


def flash_attn_decode():
    """FlashAttention's paged decode as a function of the same inputs, or None if absent."""
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        return None
    return lambda q, k, v, lens, tables: flash_attn_with_kvcache(
        q.unsqueeze(1), k, v, cache_seqlens=lens, block_table=tables,
        softmax_scale=HEAD_DIM ** -0.5, causal=True)


def patched_launch(**constants):
    """The shipped Triton launch with some of the module's launch constants replaced."""
    def run(q, k, v, lens, tables):
        with mock.patch.multiple(attention_triton_decode, **constants):
            return decode_attention_triton(q, k, v, lens, tables, HEAD_DIM ** -0.5)
    return run


def main() -> None:
    """Time each shape x cache x kernel; print a table, optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--varied", action="store_true")
    parser.add_argument("--orders", nargs="?", const="unsorted,lf,sf", default="unsorted",
                        help="comma list of unsorted, lf, sf (bare --orders: all three)")
    parser.add_argument("--shapes", default=None,
                        help="batch x ctx list, e.g. 32x1500,64x1400 (default: SHAPES)")
    parser.add_argument("--splits-sweep", action="store_true")
    parser.add_argument("--fp8-sweep", action="store_true",
                        help="also FP8 launches at tiles 64/128, 4/8 warps, 2-4 stages")
    args = parser.parse_args()
    triton_decode = lambda q, k, v, lens, tables: decode_attention_triton(  # noqa: E731
        q, k, v, lens, tables, HEAD_DIM ** -0.5)
    both = (torch.bfloat16, torch.float8_e4m3fn)
    kernels = [("triton", triton_decode, both)]
    if args.splits_sweep:
        kernels += [(f"triton/{t}", patched_launch(_TARGET_PROGRAMS=t), both)
                    for t in TARGETS_SWEEP]
    if args.fp8_sweep:
        kernels += [(f"t/{n}w{w}s{st}", patched_launch(_FP8_BLOCK_N=n, _FP8_NUM_WARPS=w,
                                                       _FP8_NUM_STAGES=st),
                     (torch.float8_e4m3fn,))
                    for n in (64, 128) for w in (4, 8) for st in (2, 3, 4)]
    if (fa := flash_attn_decode()) is not None:
        kernels.append(("flash-attn", fa, (torch.bfloat16,)))
    rows = []
    print(f"{'batch':>5} {'ctx':>5} {'kernel':<12} {'cache':<6} {'us':>7} {'TB/s':>6}")
    shapes = ([tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes
              else SHAPES)
    for batch, ctx in shapes:
        for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            inputs = make_inputs(batch, ctx, kv_dtype, args.varied)
            q, k, v, lens, tables = inputs
            by_length = lens.sort(descending=True).values
            torch.cuda.synchronize()  # the benches run on their own stream: inputs must be ready
            gbytes = 2 * inputs[3].sum().item() * KV_HEADS * HEAD_DIM * kv_dtype.itemsize / 1e9
            orders = {"unsorted": ("", inputs), "lf": ("/lf", (q, k, v, by_length, tables)),
                      "sf": ("/sf", (q, k, v, by_length.flip(0), tables))}
            orders = [orders[o] for o in args.orders.split(",")]
            for (name, fn, dtypes), (suffix, run_inputs) in product(kernels, orders):
                if kv_dtype not in dtypes:
                    continue
                name += suffix
                ms = triton.testing.do_bench_cudagraph(partial(fn, *run_inputs), rep=200)
                cache = "fp8" if kv_dtype.itemsize == 1 else "bf16"
                rows.append(dict(batch=batch, ctx=ctx, kernel=name, cache=cache, ms=ms,
                                 tb_s=gbytes / ms))
                print(f"{batch:>5} {ctx:>5} {name:<12} {cache:<6} {ms * 1e3:7.1f} "
                      f"{gbytes / ms:6.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

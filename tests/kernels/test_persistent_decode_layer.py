"""The persistent decode layer (kernels.persistent) against a torch decoder layer: its output
and the K/V it writes; Qwen3 (q/k norm) and Llama (none), 1 to 16 tokens, several attention
splits, padding rows, contexts shorter than a split, GQA groups 2 to 7, any program count."""
import os
import subprocess
import sys
from dataclasses import dataclass

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # tiny interpreter dots: see test_attention

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nanovllm.kernels.attention.reference import decode_attention_torch  # noqa: E402
from nanovllm.kernels.linear.fp8_reference import (  # noqa: E402
    dequantize_groups,
    quantize_groups,
)
from nanovllm.kernels.persistent.decode_layer import (  # noqa: E402
    LayerWeights,
    PersistentDecodeLayer,
)
from nanovllm.layers.rotary_embedding import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Shape:
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    inter: int = 384
    block: int = 16  # keys a cache page


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm.rms_forward."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def weights(s: Shape, norm: bool, dtype: torch.dtype, k_major: bool) -> LayerWeights:
    """Random weights; with k_major o and down stored [in, out] (RowParallelLinear's layout)."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=0.08):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)

    def stored(w: torch.Tensor) -> torch.Tensor:
        return w.t().contiguous().t() if k_major else w

    return LayerWeights(
        input_norm=1 + rand(s.hidden, scale=0.3),
        qkv=rand((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden),
        q_norm=1 + rand(s.head_dim, scale=0.3) if norm else None,
        k_norm=1 + rand(s.head_dim, scale=0.3) if norm else None,
        o=stored(rand(s.hidden, s.heads * s.head_dim)), post_norm=1 + rand(s.hidden, scale=0.3),
        gate_up=rand(2 * s.inter, s.hidden), down=stored(rand(s.hidden, s.inter)), eps=1e-6)


def reference(s: Shape, x, w: LayerWeights, rope: RotaryEmbedding, pos, slots, ctx, tables,
              k_cache, v_cache, scale):
    """The per-kernel path's math in torch; writes the new K/V (slot >= 0) into the caches."""
    t, d = x.shape[0], s.head_dim
    qkv = rms(x, w.input_norm, w.eps) @ w.qkv.T
    q, k, v = qkv.split([s.heads * d, s.kv_heads * d, s.kv_heads * d], dim=-1)
    q, k, v = q.view(t, s.heads, d), k.view(t, s.kv_heads, d), v.view(t, s.kv_heads, d)
    if w.q_norm is not None:
        q, k = rms(q, w.q_norm, w.eps), rms(k, w.k_norm, w.eps)
    q, k = rope(pos, q, k)
    real = slots >= 0
    k_cache.view(-1, s.kv_heads, d)[slots[real]] = k[real]
    v_cache.view(-1, s.kv_heads, d)[slots[real]] = v[real]
    attn = decode_attention_torch(q, k_cache, v_cache, ctx, tables, scale).view(t, -1)
    resid2 = (x.float() + (attn @ w.o.T).float()).to(x.dtype)
    gate, up = (rms(resid2, w.post_norm, w.eps) @ w.gate_up.T).chunk(2, dim=-1)
    return (resid2.float() + ((F.silu(gate) * up) @ w.down.T).float()).to(x.dtype)


def run(s: Shape, contexts: list[int], norm: bool, k_major: bool, programs: int | None,
        dtype: torch.dtype = torch.float32, pages: int | None = None, relaunch: int = 0,
        w: LayerWeights | None = None, w_ref: LayerWeights | None = None):
    """The layer (weights w, else random ones) and the reference (weights w_ref, else w) on one
    decode step whose token i's sequence holds contexts[i] keys with its own (0: a padding
    row, slot -1, position 0); returns (got, expected, caches, reference caches, splits)."""
    g = torch.Generator().manual_seed(len(contexts))
    n = len(contexts)
    ctx = torch.tensor(contexts, dtype=torch.int32)
    pages = pages or (max(contexts) + s.block - 1) // s.block
    tables = torch.randperm(n * pages, generator=g).view(n, pages).int()
    cache = torch.randn(2, n * pages, s.block, s.kv_heads, s.head_dim, generator=g).to(dtype)
    pos = (ctx - 1).clamp(min=0).long()
    slots = tables[torch.arange(n), pos // s.block].long() * s.block + pos % s.block
    slots[ctx == 0] = -1
    x = torch.randn(n, s.hidden, generator=g).to(dtype)
    x, pos, slots, ctx, tables, cache = (t.to(DEVICE) for t in (x, pos, slots, ctx, tables, cache))
    w = w or weights(s, norm, dtype, k_major)
    rope = RotaryEmbedding(s.head_dim, 4096, {"rope_type": "default", "rope_theta": 1e4})
    rope = rope.to(DEVICE)
    ref_cache = cache.clone()
    scale = s.head_dim ** -0.5
    expected = reference(s, x, w_ref or w, rope, pos, slots, ctx, tables, *ref_cache, scale)
    layer = PersistentDecodeLayer(s.heads, s.kv_heads, s.head_dim, s.hidden, s.inter, dtype,
                                  x.device, programs=programs)
    cos_sin = rope.cos_sin_cache.squeeze(1)
    got = layer(x, w, cos_sin, pos, slots, ctx, tables, cache[0], cache[1], scale)
    for _ in range(relaunch):  # the barrier counter carries over launches
        assert torch.equal(layer(x, w, cos_sin, pos, slots, ctx, tables, cache[0], cache[1],
                                 scale), got)
    return got, expected, cache, ref_cache, layer.attention_splits(n, pages * s.block)


@pytest.mark.parametrize("shape,contexts,norm,k_major,programs,splits", [
    (Shape(), [6], True, True, 3, 1),
    (Shape(), [6 + 23 * i for i in range(5)], False, False, 4, 1),
    (Shape(), [6 + 23 * i for i in range(16)], True, False, 2, 1),
    (Shape(), [300, 323], True, True, 16, 4),  # the new tokens in the third split, one empty
    # a context shorter than a split (most of its splits empty) and a padding row
    (Shape(heads=8, head_dim=128, inter=256), [300, 5, 0], False, True, 64, 8),
    (Shape(heads=8, head_dim=128, inter=256), [1, 17, 129, 0, 511], True, False, 64, 6),
    (Shape(heads=14), [200, 0, 33], True, True, 32, 4),  # GQA 7 (Qwen2.5-7B's 28 / 4)
])
def test_matches_the_torch_layer_and_writes_the_same_kv(shape, contexts, norm, k_major,
                                                        programs, splits):
    pages = 32 if programs == 64 else None
    got, expected, cache, ref_cache, ns = run(shape, contexts, norm, k_major, programs,
                                              pages=pages)
    assert ns == splits
    torch.testing.assert_close(cache, ref_cache, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_pages_of_256_keys_16_tokens_and_132_programs():
    """The production launch's shape of things: 132 programs, 16 tokens (some padding), pages of
    256 keys (64-key tiles)."""
    contexts = [0 if i % 5 == 4 else 1 + 37 * i for i in range(16)]
    got, expected, cache, ref_cache, ns = run(
        Shape(heads=16, kv_heads=8, inter=256, block=256), contexts, True, True, 132, pages=3)
    assert ns == 1
    torch.testing.assert_close(cache, ref_cache, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def fp8_weights(s: Shape, block: tuple[int, int] | None, dtype: torch.dtype
                ) -> tuple[LayerWeights, LayerWeights]:
    """(FP8 weights per channel or per block, the same dequantized to dtype): random float32
    projections quantized by the reference's rule (kernels.linear.fp8_reference)."""
    master = weights(s, True, torch.float32, False)
    names = ("qkv", "o", "gate_up", "down")
    quantized = {}
    for name in names:
        full = getattr(master, name)
        gn, gk = block or (1, full.shape[1])
        quantized[name] = quantize_groups(full, gn, gk) + ((gn, gk),)
    small = {f: getattr(master, f).to(dtype) for f in ("input_norm", "q_norm", "k_norm",
                                                      "post_norm")}
    fp8 = LayerWeights(**small, **{n: q[0] for n, q in quantized.items()}, eps=master.eps,
                       scales=tuple(quantized[n][1] for n in names), block=block)
    dequantized = LayerWeights(**small, eps=master.eps, **{
        n: dequantize_groups(q[0], q[1], *q[2]).to(dtype) for n, q in quantized.items()})
    return fp8, dequantized


@pytest.mark.parametrize("block,num_tokens", [(None, 1), ((128, 128), 3)])
def test_fp8_weights_match_the_layer_on_their_dequantized_values(block, num_tokens):
    """W8A16: FP8 codes per channel or per 128 x 128 block, 16-bit activations, against the
    torch layer on the dequantized weights (rounding apart; a wrong scale is off by far more).
    float16 (bfloat16 on the GPU): the interpreter's bfloat16 arithmetic is wrong."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    fp8, dequantized = fp8_weights(Shape(), block, dtype)
    got, expected, cache, ref_cache, _ = run(
        Shape(), [30 + 17 * i for i in range(num_tokens)], True, False, 3, dtype=dtype, w=fp8,
        w_ref=dequantized)
    torch.testing.assert_close(cache.float(), ref_cache.float(), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got.float(), expected.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_bf16_on_every_sm_within_bf16_rounding_of_the_torch_layer(num_tokens):
    """One program an SM (the production launch), bf16, relaunched: the K/V and output within
    a few bf16 steps of torch's (rounding points differ: the norm is applied per tile)."""
    contexts = [300 + 23 * i for i in range(num_tokens)]
    got, expected, cache, ref_cache, _ = run(Shape(), contexts, True, True, None,
                                             dtype=torch.bfloat16, relaunch=3)
    torch.testing.assert_close(cache.float(), ref_cache.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), expected.float(), rtol=3e-2, atol=3e-2)


def test_splits_spread_items_over_programs_and_divide_k():
    """Qwen3-0.6B on an H200's 132 SMs: each GEMM phase has 96-128 items (a gate_up item is a
    gate tile with its up tile), and attention at most one item a program."""
    layer = PersistentDecodeLayer(16, 8, 128, 1024, 3072, torch.bfloat16, DEVICE, programs=132)
    assert (layer.s1, layer.s3, layer.s5, layer.s6) == (2, 8, 2, 8)
    assert [layer.attention_splits(t, 4096) for t in (1, 2, 4, 8, 16)] == [16, 8, 4, 2, 1]
    assert layer.attention_splits(1, 256) == 4  # >= 64 keys a split


CARRY_CASES = {  # name: (shape, contexts, dtype, FP8 block (None: 16-bit), programs)
    "fp32, one split": (Shape(), [40], torch.float32, False, 3),
    "fp32, two tokens": (Shape(), [40, 49], torch.float32, False, 3),
    "fp16, 2-8 splits, a padding row": (Shape(hidden=512, head_dim=128, inter=512), [40, 0],
                                        torch.float16, False, 64),
    "FP8 per channel": (Shape(), [33], torch.float16, None, 32),
    "FP8 blocks": (Shape(), [33], torch.float16, (128, 128), 32),
}


@pytest.mark.parametrize("case", CARRY_CASES)
def test_carried_partials_give_the_same_bits_as_whole_layers(case):
    """Layers of a small step (fuse_max_tokens=16: gate_up adds o_proj's partials itself,
    down_proj's carry into the next layer's launch) against the plain phases
    (fuse_max_tokens=0): the same roundings in the same order, so the same bits and K/V."""
    s, contexts, dtype, fp8, programs = CARRY_CASES[case]
    n, g = len(contexts), torch.Generator().manual_seed(7)
    ctx = torch.tensor(contexts, dtype=torch.int32)
    pos = (ctx - 1).clamp(min=0).long()
    tables = torch.arange(n * 4).view(n, 4).int()
    slots = tables[torch.arange(n), pos // s.block].long() * s.block + pos % s.block
    slots[ctx == 0] = -1
    caches = torch.randn(3, 2, n * 4, s.block, s.kv_heads, s.head_dim, generator=g).to(dtype)
    x = torch.randn(n, s.hidden, generator=g).to(dtype)
    layers = ([fp8_weights(s, fp8, dtype)[0] for _ in range(3)] if fp8 is not False else
              [weights(s, norm, dtype, k_major) for norm, k_major in
               ((True, True), (False, False), (True, False))])
    rope = RotaryEmbedding(s.head_dim, 4096, {"rope_type": "default", "rope_theta": 1e4})
    x, pos, slots, ctx, tables, caches = (t.to(DEVICE) for t in (x, pos, slots, ctx, tables,
                                                                  caches))
    cos_sin = rope.to(DEVICE).cos_sin_cache.squeeze(1)
    outs = []
    for fuse in (0, 16):
        layer = PersistentDecodeLayer(s.heads, s.kv_heads, s.head_dim, s.hidden, s.inter,
                                      dtype, x.device, programs=programs, fuse_max_tokens=fuse)
        kv, h = caches.clone(), x
        for i, w in enumerate(layers):
            h = layer(h, w, cos_sin, pos, slots, ctx, tables, kv[i, 0], kv[i, 1],
                      s.head_dim ** -0.5, x_partials=bool(fuse and i), carry_out=bool(
                          fuse and i < len(layers) - 1))
        outs.append((h.clone(), kv))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert not torch.equal(outs[0][0], x)
    if programs == 64:
        assert max(layer.s1, layer.s3, layer.s5, layer.s6) > 1


_COMPILE_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nanovllm.kernels.persistent.decode_layer import _decode_layer_kernel as kernel
names = [p.name for p in kernel.params]
floats = {"eps", "qk_scale"}
bf16 = {"cos_sin_ptr": "*fp32", "pos_ptr": "*i64", "slot_ptr": "*i64", "ctx_ptr": "*i32",
        "bt_ptr": "*i32", "bar_ptr": "*i32"}
weights = ("wqkv_ptr", "wo_ptr", "wgu_ptr", "wd_ptr", "next_qkv_ptr", "next_o_ptr")
scales = ("sq_ptr", "so_ptr", "sg_ptr", "sd_ptr")
for prefetch, poll, w_scale in ((3, 1, 0), (1, 0, 0), (3, 1, 1), (3, 1, 2)):
    consts = dict(S1=2, S3=8, S5=2, S6=8, H=1024, HQ=16, HKV=8, G_P2=16, D=128, INTER=3072,
                  BLOCK_SIZE=256, BLOCK_N=64, NORM=True, PRECISION="tf32", PHASE=0,
                  PREFETCH=prefetch + 4 * 15, POLL=poll, W_SCALE=w_scale, USE_PDL=True,
                  s_qkv_k=1, s_o_n=1 if not w_scale else None, s_o_k=1 if w_scale else None,
                  s_gu_k=1, s_d_n=1 if not w_scale else None, s_d_k=1 if w_scale else None)
    consts = {n: v for n, v in consts.items() if v is not None}
    types = {**bf16, **{n: "*fp8e4nv" for n in weights if w_scale},
             **{n: "*fp32" if w_scale else "*bf16" for n in scales}}
    sig = {n: "constexpr" if n in consts else "fp32" if n in floats else
           types.get(n, "*fp32" if n.startswith(("part", "m_", "l_", "acc")) else "*bf16")
           if n.endswith("_ptr") else "i32" for n in names}
    hints = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n not in consts and (n.endswith("_ptr") or n.startswith(("s_", "stride")))}
    src = ASTSource(fn=kernel, signature=sig, attrs=hints,
                    constexprs={(names.index(n),): v for n, v in consts.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=8, num_stages=3, launch_pdl=True)).asm["ptx"]
    print(ptx.count("prefetch.global.L2"), ptx.count("atom.global.gpu.release.add"),
          ptx.count("fence.acq_rel.gpu"),
          "prefetch.global.L2" in ptx, "griddepcontrol.wait" in ptx, "cp.async" in ptx,
          ("ld.global.gpu.relaxed" if poll else "ld.volatile.global") in ptx)
"""


def test_sm90_code_has_its_barriers_prefetches_and_pipelines() -> None:
    """Compiled for sm_90 (no GPU needed; a process without the interpreter, which runs the
    phases as launches of their own and so never compiles the barriers): six barriers (the
    seventh is skipped at runtime when partials carry), each released by an atomic and fenced,
    L2 prefetches, the PDL wait, weight loads pipelined by cp.async, each polling mode, 16-bit
    and FP8 (per channel, per block) weights."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # prefetch loops: mode 3 six (this layer's four, the next layer's qkv and o), mode 1 four
    assert out.stdout.split("\n")[:4] == ["6 6 6 True True True True", "4 6 6 True True True True"
                                           ] + ["6 6 6 True True True True"] * 2

"""Warm-up compiles every kernel variant a run reaches (runner.warmup).

Each Triton launch is recorded, under the interpreter, by the specialisation key Triton's JIT
would compile it under: the kernel, its constexprs, its argument types, the alignment classes of
its pointers and integers (multiple of 16, equal to 1) and its launch options. The keys a varied
workload launches after LLM() must all have been launched by LLM()'s warm-up. Every fused path
is forced on (on CPU the engine binds none), float16 so that the fused projections take it.

The warm-up's steps under a compile-only pass (kernels.compile_ahead: no kernel runs, outputs
stay garbage) must finish and launch the variants their real run does."""
import ast
import inspect
import os
from collections.abc import Callable

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import KernelParam, create_function_from_signature  # noqa: E402

from benchmarks.random_checkpoints import build_checkpoint  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.kernels.compile_ahead import launches_compile_only  # noqa: E402
from nanovllm.kernels.linear.gemv import _gemv_rows_kernel  # noqa: E402
from nanovllm.layers import backends  # noqa: E402
from nanovllm.layers.backends import FastPath  # noqa: E402
from nanovllm.runner import warmup  # noqa: E402

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="records interpreted launches; on CUDA benchmarks.cold_compiles counts compiles")
# head_dim 128: the fused projections' half heads are whole 64-row MMA tiles; two layers: a
# lone token's layer 1 takes its input norm inside qkv_proj's GEMV (norm_gemv_rows)
SHAPE = dict(hidden_size=128, head_dim=128, num_attention_heads=2, num_key_value_heads=1,
             intermediate_size=256, vocab_size=512, num_hidden_layers=2)


class VariantRecorder:
    """The specialisation key of every interpreted launch, in launch order."""

    def __init__(self) -> None:
        self.keys: list[tuple] = []
        self.runs = 0  # launches that ran (not warmup launches)
        self._binders: dict[InterpretedFunction, object] = {}

    def _binder(self, fn: InterpretedFunction):
        """Triton's own argument binder for fn, with fn's do_not_specialize lists."""
        if fn not in self._binders:
            sig = inspect.signature(fn.fn)
            plain = fn.kwargs.get("do_not_specialize") or []
            unaligned = fn.kwargs.get("do_not_specialize_on_alignment") or []
            params = [KernelParam(i, p, i in plain or p.name in plain,
                                  i in unaligned or p.name in unaligned)
                      for i, p in enumerate(sig.parameters.values())]
            self._binders[fn] = create_function_from_signature(sig, params, BaseBackend)
        return self._binders[fn]

    def record(self, fn: InterpretedFunction, args: tuple, kwargs: dict) -> None:
        _, specialization, options = self._binder(fn)(*args, **kwargs)
        self.keys.append((fn.fn.__name__, repr(specialization), repr(sorted(options.items()))))


def launched_after_start_up(recorder: VariantRecorder, llm: LLM,
                            workload: Callable[[LLM], None]) -> tuple[list[tuple], set[tuple]]:
    """(the variants workload(llm) launched, those start-up compiled); llm shut down after."""
    try:
        warmed, start = set(recorder.keys), len(recorder.keys)
        workload(llm)
        return recorder.keys[start:], warmed
    finally:
        llm.shutdown()


def assert_all_warmed(launched: list[tuple], warmed: set[tuple]) -> None:
    """Every variant launched was compiled by start-up."""
    cold = sorted(set(launched) - warmed)
    assert not cold, "variants the warm-up never compiled:\n" + "\n".join(map(str, cold))


def norm_rows(keys: list[tuple]) -> list[tuple]:
    """The keys of whole-row GEMVs that compute the add + RMSNorm before them (PARTIALS)."""
    partials = list(inspect.signature(_gemv_rows_kernel.fn).parameters).index("PARTIALS")
    return [key for key in keys if key[0] == "_gemv_rows_kernel"
            and ast.literal_eval(key[1])[partials][1]]


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> VariantRecorder:
    """Record every launch; bind every fused path (kernels run interpreted)."""
    recorder, run = VariantRecorder(), InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        recorder.record(self, args, kwargs)
        recorder.runs += not warmup
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    monkeypatch.setattr(warmup, "WARM_UP_INTERPRETED", True)
    monkeypatch.setattr(backends, "plan_fast_path",
                        lambda name, device: FastPath(True, True, True))
    return recorder


GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def _workload(llm: LLM) -> None:
    """Chunked prompts (a later chunk reads its prefix from the cache, as a prefix-cache hit or
    a recomputed preempted sequence does), batch sizes 1 to 4, n > 1, logprobs, prompt
    logprobs, temperature, top-k/top-p, seeds and penalties (interpreted kernels run ~10
    tokens/s: prompts stay short)."""
    llm.generate([[1, 2, 3], [(5 * i) % 400 + 3 for i in range(37)]], GREEDY, use_tqdm=False)
    llm.generate([[4] * 9, [5] * 6], [
        SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True, n=2, logprobs=2),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=3, max_tokens=3,
                       ignore_eos=True)], use_tqdm=False)
    # alone in its batch, a penalised row takes the fast path on float32 logits
    llm.generate([[6] * 5], SamplingParams(temperature=0.7, presence_penalty=0.5, max_tokens=3,
                                           ignore_eos=True, prompt_logprobs=1), use_tqdm=False)
    assert llm.stats()["prefill_steps"] >= 4  # the 37-token prompt took 3 chunks


def _short_workload(llm: LLM, second: list[int] | None = None) -> None:
    """Three prompts of greedy decoding (`second` the middle one's tokens), then one alone."""
    llm.generate([[1, 2, 3], second or [4] * 9, [5] * 6], GREEDY, use_tqdm=False)
    llm.generate([[6] * 5], GREEDY, use_tqdm=False)


def test_moe_workload_launches_only_warmed_variants(recorder: VariantRecorder,
                                                    tmp_path) -> None:
    """A Qwen3-MoE model: the router's top-k and the experts' grouping, in one program up to
    ONE_PROGRAM_SLOTS slots and in three kernels beyond (lowered here so that both run); its
    layer 0 dense (mlp_only_layers), so a lone token's sparse layer 1 takes its input norm
    inside qkv_proj's GEMV."""
    from nanovllm.kernels.moe import fused_moe
    checkpoint = build_checkpoint(str(tmp_path / "moe"), family="Qwen3Moe", num_experts=8,
                                  num_experts_per_tok=2, moe_intermediate_size=64,
                                  norm_topk_prob=True, mlp_only_layers=[0], **SHAPE)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused_moe, "ONE_PROGRAM_SLOTS", 4)
        llm = LLM(checkpoint, device="cpu", attention_backend="triton", dtype="float16",
                  num_kvcache_blocks=4, max_num_seqs=4, max_num_batched_tokens=16,
                  max_model_len=512)
        launched, warmed = launched_after_start_up(recorder, llm, _short_workload)
    kernels = {key[0] for key in launched}
    assert {"_topk_softmax_kernel", "_align_one_program_kernel", "_count_kernel",
            "_scatter_kernel", "_gate_up_silu_kernel", "_down_kernel"} <= kernels
    assert norm_rows(launched)
    assert_all_warmed(launched, warmed)


def _llm(tmp_path, **lora) -> LLM:
    checkpoint = build_checkpoint(str(tmp_path / "ckpt"), **SHAPE)
    return LLM(checkpoint, device="cpu", attention_backend="triton", dtype="float16",
               num_kvcache_blocks=4, max_num_seqs=4, max_num_batched_tokens=16,
               max_model_len=512, **lora)


def test_workload_launches_only_warmed_variants(recorder: VariantRecorder, tmp_path) -> None:
    launched, warmed = launched_after_start_up(recorder, _llm(tmp_path), _workload)
    kernels = {key[0] for key in launched}
    # the workload reaches every kernel family but split decode's reduce (contexts of more
    # than one block): attention, fused ops, projections, the sampler
    assert {"_prefill_kernel", "_decode_split_kernel", "_qk_norm_rope_kernel", "_rms_norm_kernel",
            "_qkv_rope_store_kernel", "_gate_up_silu_kernel", "_split_k_kernel",
            "_race_kernel"} <= kernels
    assert norm_rows(launched)  # a lone token's layer 1: qkv_proj's GEMV with its input norm
    assert_all_warmed(launched, warmed)


@pytest.mark.parametrize("lora", [{}, dict(enable_lora=True, max_loras=2, max_lora_rank=8)])
def test_compile_only_pass_reaches_the_warm_up_variants(recorder: VariantRecorder, tmp_path,
                                                        lora) -> None:
    """The warm-up's steps with every launch compile-only run no kernel, finish on the garbage
    their kernels leave, and launch the same variants as the steps run for real (with LoRA,
    its variants too)."""
    llm = _llm(tmp_path, **lora)
    try:
        steps = warmup.warm_up_steps(llm.model_runner, graph_sizes=[])
        start, runs = len(recorder.keys), recorder.runs
        with launches_compile_only(InterpretedFunction):
            for step in steps:
                step()
        assert recorder.runs == runs, "a kernel ran in the compile-only pass"
        middle = len(recorder.keys)
        for step in steps:
            step()
        assert recorder.runs > runs
        compiled, ran = recorder.keys[start:middle], recorder.keys[middle:]
    finally:
        llm.shutdown()
    kernels = {key[0] for key in compiled}
    assert {"_prefill_kernel", "_decode_split_kernel", "_qkv_rope_store_kernel",
            "_race_kernel"} | ({"_shrink_kernel"} if lora else set()) <= kernels
    assert set(compiled) == set(ran)
    assert norm_rows(compiled)  # a lone token's layer 1 (in a step without adapters)


def test_lora_workload_launches_only_warmed_variants(recorder: VariantRecorder,
                                                     tmp_path) -> None:
    """With LoRA: prefill's shrink, decode with the shrink in the fused projections' K loops
    and, up to 16 rows, computed by the norm before them (kernels.linear.lora), mixed with base
    rows and rows of two adapters."""
    from nanovllm.lora import LoRARequest
    from tests.lora.helpers import build_adapter
    checkpoint = build_checkpoint(str(tmp_path / "ckpt"), **SHAPE)
    loras = [LoRARequest(f"a{i}", i, build_adapter(checkpoint, str(tmp_path / f"a{i}"), i, r=8))
             for i in (1, 2)]
    llm = LLM(checkpoint, device="cpu", attention_backend="triton", dtype="float16",
              num_kvcache_blocks=4, max_num_seqs=4, max_num_batched_tokens=16,
              max_model_len=512, enable_lora=True, max_loras=2, max_lora_rank=8)

    def workload(llm: LLM) -> None:
        llm.generate([[1, 2, 3], [4] * 20, [5] * 6], GREEDY, use_tqdm=False,
                     lora_request=[loras[0], None, loras[1]])
        llm.generate([[6] * 5], GREEDY, use_tqdm=False, lora_request=loras[1])
    launched, warmed = launched_after_start_up(recorder, llm, workload)
    kernels = {key[0] for key in launched}
    assert {"_shrink_kernel", "_qkv_rope_store_kernel", "_gate_up_silu_kernel",
            "_split_k_kernel", "_rms_norm_kernel"} <= kernels
    assert_all_warmed(launched, warmed)


@pytest.mark.parametrize("quantization", ["fp8", None])
def test_fp8_workload_launches_only_warmed_variants(recorder: VariantRecorder, tmp_path,
                                                    quantization) -> None:
    """FP8 weights per channel (quantized at load) and in 128 x 128 blocks: decode up to 16
    tokens as W8A16 (fused and split-K), and steps of more tokens as W8A8 (the activations'
    quantization and the swapped GEMM)."""
    from tests.fp8_checkpoints import quantize_checkpoint
    checkpoint = build_checkpoint(str(tmp_path / "ckpt"), **SHAPE)
    if quantization is None:
        checkpoint = quantize_checkpoint(checkpoint, str(tmp_path / "block"), "block", 128)
    llm = LLM(checkpoint, device="cpu", attention_backend="triton", dtype="float16",
              num_kvcache_blocks=4, max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=512, quantization=quantization)
    launched, warmed = launched_after_start_up(
        recorder, llm, lambda llm: _short_workload(llm, [(7 * i) % 400 + 3 for i in range(45)]))
    kernels = {key[0] for key in launched}
    # per channel the norms and SiLU-and-mul hand the 32-token steps' projections TokenCodes,
    # and only o_proj quantizes its input; blocks quantize per 128-column group in the GEMM
    handed = {"_silu_and_mul_codes_kernel"} if quantization else set()
    assert {"_group_quant_kernel", "_w8a8_swap_kernel", "_split_k_kernel",
            "_qkv_rope_store_kernel"} | handed <= kernels, kernels
    assert_all_warmed(launched, warmed)

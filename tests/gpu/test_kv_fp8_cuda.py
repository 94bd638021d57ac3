"""FP8 KV cache on CUDA: the Triton kernels (eager and CUDA graphs) against the bf16 cache and
against the torch reference, teacher-forced (tests.accuracy.fp8_accuracy)."""
import pytest

from tests.accuracy.fp8_accuracy import compare, engine, prompts, teacher_forced

pytestmark = pytest.mark.gpu


def tokens_and_logits(path: str, options: dict, forced: list[list[int]] | None):
    """One engine teacher-forced along `forced` (None: its own greedy tokens)."""
    backend, kv = options.pop("backend"), options.pop("kv")
    llm = engine(path, backend, kv, **options)
    try:
        if kv == "fp8":  # 'auto' never picks flash-attn for an FP8 cache
            assert llm.model_runner.backend.name == (backend if backend != "auto" else "triton")
        batch = prompts(llm.config.hf_config.vocab_size, 8)
        return teacher_forced(llm, batch, forced)
    finally:
        llm.shutdown()


def teacher_forced_pair(path: str, ref: dict, fp8: dict) -> dict:
    """The reference engine greedy, the FP8 engine fed its tokens; compare() of the two."""
    tokens, ref_logits = tokens_and_logits(path, dict(ref), None)
    _, fp8_logits = tokens_and_logits(path, dict(fp8), tokens)
    result = compare(tokens, ref_logits, fp8_logits)
    print(f"{fp8}: {result}")
    return result


@pytest.mark.parametrize("calculate", [False, True])
@pytest.mark.parametrize("eager", [True, False])
def test_triton_fp8_agrees_with_the_bf16_cache(tiny_model, eager, calculate):
    """bf16 model, 'auto' backend: the FP8 cache goes to Triton; argmax agreement with the bf16
    cache and the logit error stay near what the CPU reference measures (~90%, ~0.2)."""
    result = teacher_forced_pair(
        tiny_model, dict(backend="triton", kv="auto", enforce_eager=eager),
        dict(backend="auto", kv="fp8", calculate_kv_scales=calculate, enforce_eager=eager))
    assert result["pct"] >= 80 and result["mean_err"] < 0.4, result


@pytest.mark.parametrize("eager", [True, False])
def test_triton_fp8_equals_the_torch_reference(tiny_model, eager):
    """float32 model, scale 1.0: Triton (IEEE dots) and the torch reference read the same FP8
    cache, so their logits differ only by float32 rounding and the rare e4m3 rounding flip it
    causes (a flip moves later logits of its sequence: the bound is on the mean, ~1/6 of the
    FP8-vs-bf16 error)."""
    result = teacher_forced_pair(
        tiny_model, dict(backend="torch", kv="fp8", dtype="float32"),
        dict(backend="triton", kv="fp8", dtype="float32", enforce_eager=eager))
    assert result["pct"] >= 95 and result["mean_err"] < 0.03, result

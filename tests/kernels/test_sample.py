"""Fused race_sample kernel: exact greedy argmax, sampled frequencies, seeding (runs under
TRITON_INTERPRET=1 without a GPU)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nanovllm.kernels.sample import _HW_LOG, _gumbel_log2, race_sample  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Small chunks so that short test rows still span several chunks and loop iterations; the
# interpreter costs ~20 ms a program, so keep the program count low there.
CHUNK, BLOCK = 256, 64
# Upper 0.1% point of chi-square with 9 degrees of freedom (from tables): a correct sampler
# fails with probability 0.001, and the seed is fixed, so the outcome is too.
CHI2_CRIT_999_DF9 = 27.877
# softmax(LOGITS / 0.7) = PROBS: every p >= 2.5%, and spread enough that sampling at the wrong
# temperature (e.g. T = 1) fails the test with probability ~0.95.
PROBS = torch.tensor([0.025, 0.225, 0.05, 0.225, 0.025, 0.025, 0.225, 0.05, 0.025, 0.225])
LOGITS = 0.7 * PROBS.log()
NUM_DRAWS = 20000 if DEVICE == "cuda" else 600  # 600: every expected count is >= 15


def sample(logits: torch.Tensor, temps: list[float] | torch.Tensor, seed: int = 0,
           **kw) -> torch.Tensor:
    temps = torch.as_tensor(temps, dtype=torch.float32, device=DEVICE)
    return race_sample(logits.to(DEVICE), temps, seed, **{"chunk": CHUNK, "block": BLOCK, **kw})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_equal_torch_argmax(dtype: torch.dtype) -> None:
    """V not a multiple of the chunk; bf16 rounding makes ties of the max likely, too."""
    logits = torch.randn(4, 3 * CHUNK + 37, generator=torch.Generator().manual_seed(0))
    logits = logits.to(dtype)
    assert torch.equal(sample(logits, [0.0] * 4).cpu(), logits.argmax(-1))


@pytest.mark.parametrize("ties", [
    [CHUNK - 1, CHUNK + 3],  # across chunks: late lane of chunk 0, early lane of chunk 1
    [2 * CHUNK + 5, 3 * CHUNK + 1],  # chunk 2 vs the last, partial chunk
    [BLOCK + 5, 2],  # one chunk, different lanes and loop iterations
    [BLOCK + 2, 2 * BLOCK + 1, 3 * BLOCK + 2]])
def test_greedy_ties_go_to_the_lowest_index(ties: list[int]) -> None:
    logits = torch.randn(2, 3 * CHUNK + 37, generator=torch.Generator().manual_seed(1))
    logits[:, ties] = 10.0
    assert sample(logits, [0.0, 0.0]).tolist() == [min(ties)] * 2


def test_all_minus_inf_row_gives_index_zero_like_torch() -> None:
    logits = torch.full((1, CHUNK + 3), float("-inf"))
    assert sample(logits, [0.0]).tolist() == logits.argmax(-1).tolist() == [0]


def test_default_chunking_on_a_real_vocab_size() -> None:
    """The wrapper's default chunk/block, on Qwen3's vocab size (greedy rows: cheap to run)."""
    logits = torch.randn(1, 151936, generator=torch.Generator().manual_seed(2)).bfloat16()
    got = race_sample(logits.to(DEVICE), torch.zeros(1, device=DEVICE), 0)
    assert torch.equal(got.cpu(), logits.argmax(-1))


def test_mixed_batch_greedy_rows_exact_sampled_rows_in_support() -> None:
    """Sampled rows only ever pick finite logits; greedy rows stay exact."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 2 * CHUNK + 11, generator=gen)
    support = [3, CHUNK + 7, 2 * CHUNK + 10]
    masked = torch.full_like(logits[0], float("-inf"))
    masked[support] = 0.0
    logits[1::2] = masked  # odd rows sample from 3 tokens
    temps = [0.0, 1.0, 0.0, 0.7, 0.0, 1e-6]
    for seed in range(2):
        ids = sample(logits, temps, seed).cpu()
        assert torch.equal(ids[0::2], logits[0::2].argmax(-1))
        assert set(ids[1::2].tolist()) <= set(support)


def test_sampled_frequencies_match_softmax() -> None:
    """Identical rows with one seed: rows must get independent noise, drawing softmax(l / T)."""
    temperature = 0.7
    ids = sample(LOGITS.repeat(NUM_DRAWS, 1), [temperature] * NUM_DRAWS, seed=1234,
                 chunk=16, block=16).cpu()
    counts = torch.bincount(ids, minlength=LOGITS.numel()).double()
    expected = torch.softmax(LOGITS.double() / temperature, -1) * NUM_DRAWS
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert counts.sum() == NUM_DRAWS and stat < CHI2_CRIT_999_DF9, (stat, counts)


def test_same_seed_same_ids_different_seed_different_ids() -> None:
    """Near-flat logits over a large vocab: a new seed changes (almost) every row's draw."""
    logits = torch.randn(4, 50000, generator=torch.Generator().manual_seed(4)).bfloat16()
    temps = [1.0] * 4
    kw = dict(chunk=16384, block=16384)  # few, wide programs: cheap under the interpreter
    first = sample(logits, temps, 7, **kw)
    assert torch.equal(sample(logits, temps, 7, **kw), first)
    assert (sample(logits, temps, 8, **kw) != first).sum() >= 3


@triton.jit
def _noise_kernel(out_ptr, HW_LOG: tl.constexpr, BLOCK: tl.constexpr):
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + k, _gumbel_log2((k.to(tl.float32) + 0.5) * 1.1920928955078125e-07, HW_LOG))


def test_fast_noise_is_accurate_for_every_u() -> None:
    """All 2**23 values of u, the top ones (series) included: within 4e-5 of float64 in log2
    units (lg2.approx on CUDA, whose bound gives < 2e-5; the accurate log2 on CPU)."""
    block = 2**20 if DEVICE == "cpu" else 1024  # few programs for the interpreter
    out = torch.empty(2**23, device=DEVICE)
    _noise_kernel[(2**23 // block,)](out, HW_LOG=_HW_LOG, BLOCK=block)
    u = (torch.arange(2**23, dtype=torch.float64) + 0.5) / 2**23
    err = (out.cpu().double() + (-u.log2()).log2()).abs().max().item()
    assert err < 4e-5, err


@pytest.mark.gpu
def test_cuda_sampler_fast_path_uses_the_kernel_seeded_by_torch_rng() -> None:
    """Sampler.race on CUDA: torch.manual_seed reproduces the draw; greedy rows stay exact."""
    from nanovllm.layers.sampling.sampler import Sampler

    logits = torch.randn(8, 151936, generator=torch.Generator().manual_seed(5)).bfloat16().cuda()
    temps = torch.tensor([0.0, 1.0] * 4, device="cuda")
    draws = []
    for _ in range(2):
        torch.manual_seed(0)
        draws.append(Sampler(fused=True)(logits, temps).token_ids)
    assert torch.equal(draws[0], draws[1])
    assert torch.equal(draws[0][0::2], logits[0::2].argmax(-1))

"""Sampler on handcrafted logits: exact filter sets, sampling frequencies, seeded noise."""
import pytest
import torch

from nanovllm.layers.sampling.penalties import Penalties, TokenCounts
from nanovllm.layers.sampling.sampler import (
    Sampler,
    SamplingTensors,
    compute_logprobs,
    seeded_uniform,
    stream_steps,
)
from nanovllm.sampling_params import SamplingParams

# Upper 0.1% points of the chi-square distribution (from tables): a correct sampler fails a
# test with probability 0.001, and the seeds below are fixed, so the outcome is too.
CHI2_CRIT_999 = {3: 16.266, 4: 18.467, 7: 24.322}
LOGITS = torch.tensor([1.0, 3.0, 2.0, 3.0, 0.0, -1.0, 2.5, 0.5])  # ties at 1 and 3
NUM_DRAWS = 20000


def full(params: list[SamplingParams], positions: list[int] | None = None) -> SamplingTensors:
    positions = positions if positions is not None else [0] * len(params)
    return SamplingTensors.build(params, positions, torch_tensor)


def torch_tensor(rows: list, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


def kept(logits: torch.Tensor) -> set[int]:
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


@pytest.mark.parametrize("k, expected", [(1, {1}), (2, {1, 3}), (3, {1, 3, 6}),
                                         (5, {1, 2, 3, 6, 0}), (-1, set(range(8)))])
def test_top_k_keeps_exactly_k_ties_to_the_lower_index(k, expected):
    out = Sampler().mask_top_k_top_p(LOGITS[None], torch.tensor([k]), torch.tensor([1.0]))
    assert kept(out) == expected
    assert torch.equal(out[0, list(expected)], LOGITS[list(expected)])


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None]
    sampler = Sampler()
    for top_p, expected in [(0.49, {0}), (0.51, {0, 1}), (0.79, {0, 1}), (0.81, {0, 1, 2}),
                            (1e-6, {0}), (1.0, {0, 1, 2, 3})]:
        out = sampler.mask_top_k_top_p(logits, torch.tensor([-1]), torch.tensor([top_p]))
        assert kept(out) == expected, top_p


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    # top-2 renormalised: 0.625, 0.375; top_p 0.6 keeps only the first
    out = Sampler().mask_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.6]))
    assert kept(out) == {0}


@pytest.mark.parametrize("min_p, expected", [(0.0, set(range(8))), (1.0, {1, 3}),
                                             (0.5, {1, 3, 6}), (0.3, {1, 3, 6, 2})])
def test_min_p_keeps_tokens_with_p_at_least_min_p_times_p_max(min_p, expected):
    # p_i / p_max = exp(l_i - 3): 2.5 -> 0.61, 2 -> 0.37, 1 -> 0.14
    out = Sampler().mask_min_p(LOGITS[None], torch.tensor([min_p]))
    assert kept(out) == expected


def test_rows_keep_their_own_parameters():
    params = [SamplingParams(top_k=1), SamplingParams(top_p=0.99), SamplingParams(),
              SamplingParams(temperature=0, top_k=3)]
    logits = LOGITS.repeat(4, 1)
    s = full(params)
    assert s.use_top_k_top_p and not s.use_min_p
    out = Sampler().mask_top_k_top_p(logits, s.top_ks, s.top_ps)
    # top_p 0.99: sorted cumulative .31 .61 .80 .91 .95 .98 | .994 -> 7 tokens
    assert [len(kept(row[None])) for row in out] == [1, 7, 8, 3]


def chi_square(ids: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(ids, minlength=probs.numel()).double()
    expected = probs.double() * ids.numel()
    assert (counts[probs == 0] == 0).all(), "drew a token that has probability 0"
    nz = probs > 0
    return float(((counts[nz] - expected[nz]) ** 2 / expected[nz]).sum())


def test_fast_path_frequencies_match_softmax():
    torch.manual_seed(0)
    temperature = 0.7
    logits = LOGITS.repeat(NUM_DRAWS, 1)
    ids = Sampler()(logits, torch.full((NUM_DRAWS,), temperature)).token_ids
    stat = chi_square(ids, torch.softmax(LOGITS / temperature, -1))
    assert stat < CHI2_CRIT_999[7], stat


@pytest.mark.parametrize("params, support", [
    (dict(temperature=0.7), list(range(8))),
    (dict(temperature=1.3, top_k=4), [1, 3, 6, 2]),
    (dict(temperature=1.0, min_p=0.3), [1, 3, 6, 2]),
    (dict(temperature=1.0, top_p=0.9), [1, 3, 6, 2])])  # cumulative .31 .61 .80 | .91
def test_seeded_frequencies_match_the_filtered_softmax(params, support):
    """One draw from each of NUM_DRAWS seeds: the hashed noise must be a fair U(0, 1)."""
    sps = [SamplingParams(seed=i, **params) for i in range(NUM_DRAWS)]
    ids = Sampler()(LOGITS.repeat(NUM_DRAWS, 1), full(sps)).token_ids
    masked = torch.full_like(LOGITS, float("-inf"))
    masked[support] = LOGITS[support]
    stat = chi_square(ids, torch.softmax(masked / params["temperature"], -1))
    assert stat < CHI2_CRIT_999[len(support) - 1], stat


def test_greedy_rows_take_the_argmax_on_both_paths():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, top_k=5, seed=1),
              SamplingParams(temperature=0, min_p=0.5)]
    expected = logits.argmax(-1)
    assert torch.equal(Sampler()(logits, torch.zeros(3)).token_ids, expected)
    assert torch.equal(Sampler()(logits, full(params)).token_ids, expected)


def test_seeded_draw_ignores_batch_mates_and_row():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    me = SamplingParams(seed=42, top_p=0.95)
    alone = Sampler()(logits[2:3], full([me], [17])).token_ids
    mates = [SamplingParams(top_k=3), SamplingParams(temperature=0), me, SamplingParams(min_p=.1)]
    together = Sampler()(logits, full(mates, [5, 9, 17, 30])).token_ids
    assert together[2] == alone[0]


def test_seeded_noise_is_splitmix64():
    """The vectorised hash equals splitmix64 written with Python ints (logical shifts)."""
    mask = (1 << 64) - 1

    def mix(x: int) -> int:
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    seeds, positions, vocab = [0, 1, 12345, 2**63 - 1], [0, 3, 999, 7], 16
    expected = [[((mix((mix(mix(s) ^ p) + (i + 1) * 0x9E3779B97F4A7C15) & mask) >> 41) + 0.5)
                 / 2**23 for i in range(vocab)] for s, p in zip(seeds, positions)]
    got = seeded_uniform(torch.tensor(seeds), torch.tensor(positions),
                         stream_steps(vocab, torch.device("cpu")))
    assert torch.equal(got, torch.tensor(expected, dtype=torch.float32))
    assert 0 < got.min() and got.max() < 1


def processed_reference(logits: list[float], p: SamplingParams) -> list[float]:
    """log_softmax of l / T after min_p, top_k, then top_p over the top-k renormalised."""
    import math
    if p.temperature == 0:
        scaled = list(logits)
    else:
        scaled = [x / p.temperature for x in logits]
        top = max(scaled)
        keep = [math.exp(x - top) >= p.min_p for x in scaled]
        order = sorted(range(len(scaled)), key=lambda v: (-scaled[v], v))
        if p.top_k > 0:
            for v in order[p.top_k:]:
                keep[v] = False
        mass = sum(math.exp(scaled[v]) for v in order if keep[v])
        before = 0.0
        for v in order:
            if keep[v]:
                keep[v] = before < p.top_p
                before += math.exp(scaled[v]) / mass
        scaled = [x if k else -math.inf for x, k in zip(scaled, keep)]
    lse = math.log(sum(math.exp(x) for x in scaled if x > -math.inf))
    return [x - lse for x in scaled]


def test_raw_logprobs_are_log_softmax_of_the_model_logits_on_both_paths():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 40, generator=gen) * 2
    expected = torch.log_softmax(logits.double(), -1)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.5, top_k=3, seed=1),
              SamplingParams(), SamplingParams(temperature=0.9, min_p=0.2)]
    counts = TokenCounts(40, torch.device("cpu"))
    penalties = Penalties.build(counts, [counts.slot(0, [1, 2])] + [0] * 3,
                                [SamplingParams(repetition_penalty=2.0)] + params[1:],
                                torch_tensor)
    for sample_params, pen in [(torch.tensor([p.temperature for p in params]), None),
                               (full(params), penalties)]:
        out = Sampler()(logits, sample_params, pen, num_logprobs=3)
        ids, lps = out.logprobs.token_ids, out.logprobs.logprobs
        assert torch.equal(ids[:, 0], out.token_ids)
        assert torch.equal(ids[:, 1:], expected.topk(3, -1).indices)
        torch.testing.assert_close(lps.double(), expected.gather(1, ids), rtol=0, atol=1e-5)
    for r, (d, k) in enumerate(zip(out.logprobs.to_dicts([0, 1, 3, 2]), [0, 1, 3, 2])):
        top = expected[r].topk(k).indices.tolist()
        assert set(d) == set(top) | {out.token_ids[r].item()} and list(d)[:k] == top
        assert all(abs(lp - expected[r, t].item()) < 1e-5 for t, lp in d.items())
    assert Sampler()(logits, full(params)).logprobs is None


def test_processed_logprobs_are_the_distribution_sampled_from():
    """Penalties, temperature and every filter, against a reference applying them in loops;
    greedy rows: log_softmax of the penalised logits."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 30, generator=gen) * 3
    params = [SamplingParams(temperature=0.7, top_k=5, seed=2),
              SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05, seed=3),
              SamplingParams(temperature=0, repetition_penalty=1.5),
              SamplingParams(temperature=0.9, top_k=8, top_p=0.9, presence_penalty=1.0,
                             frequency_penalty=0.5),
              SamplingParams(temperature=1.0)]
    counts = TokenCounts(30, torch.device("cpu"))
    rows = [counts.slot(r, [r, 7]) if p.uses_penalties else 0 for r, p in enumerate(params)]
    counts.record(torch.tensor(rows), torch.tensor([1, 1, 7, 2, 2]))
    counts.record(torch.tensor(rows), torch.tensor([1, 1, 3, 2, 2]))
    penalties = Penalties.build(counts, rows, params, torch_tensor)
    penalised = Sampler().apply_penalties(logits, counts.output_counts, counts.prompt_mask,
                                          penalties.rows, penalties.repetition,
                                          penalties.presence, penalties.frequency)
    out = Sampler("processed")(logits, full(params), penalties, num_logprobs=4)
    expected = torch.tensor([processed_reference(penalised[r].tolist(), p)
                             for r, p in enumerate(params)], dtype=torch.float64)
    got = out.logprobs.logprobs.double()
    want = expected.gather(1, out.logprobs.token_ids)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[got.isfinite()], want[want.isfinite()], rtol=0, atol=1e-5)
    assert torch.isfinite(got[:, 0]).all()  # the sampled token is always in the support
    fast = Sampler("processed")(logits, torch.tensor([0.5, 0.0, 2.0, 1.0, 1.0]),
                                num_logprobs=2).logprobs
    scaled = logits / torch.tensor([0.5, 1.0, 2.0, 1.0, 1.0]).unsqueeze(1)
    torch.testing.assert_close(fast.logprobs, torch.log_softmax(scaled, -1).gather(
        1, fast.token_ids), rtol=0, atol=1e-5)


def test_compute_logprobs_for_given_tokens_with_k_zero():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(5))
    got = compute_logprobs(logits, torch.tensor([4, 0, 9]), 0)
    assert got.token_ids.tolist() == [[4], [0], [9]]
    torch.testing.assert_close(got.logprobs[:, 0], torch.log_softmax(logits, -1)[[0, 1, 2],
                                                                              [4, 0, 9]])
    assert got.to_dicts([0, 0, 0])[1] == {0: got.logprobs[1, 0].item()}
    everything = compute_logprobs(logits, torch.tensor([4, 0, 9]), 50).to_dicts([50] * 3)
    assert [len(d) for d in everything] == [10] * 3


def test_unknown_logprobs_mode_is_rejected():
    with pytest.raises(ValueError, match="logprobs_mode='softmax'"):
        Sampler("softmax")


@pytest.mark.gpu
def test_compiled_cuda_sampler_matches_cpu_masks_and_noise():
    """On CUDA the sampler's pieces run through torch.compile: same bits as eager CPU."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 1000, generator=gen) * 3
    params = [SamplingParams(seed=i, top_k=k, top_p=p, min_p=m) for i, (k, p, m) in
              enumerate([(1, 1.0, 0.0), (50, 0.9, 0.0), (-1, 0.5, 0.05), (-1, 1.0, 0.2),
                         (10, 1.0, 0.0), (-1, 1.0, 0.0)])]
    cpu, gpu = Sampler(), Sampler()
    s_cpu = full(params, list(range(6)))
    s_gpu = SamplingTensors.build(params, list(range(6)),
                                  lambda rows, dtype: torch.tensor(rows, dtype=dtype).cuda())
    s_gpu.seeds.copy_(s_cpu.seeds)
    assert torch.equal(gpu.mask_min_p(logits.cuda(), s_gpu.min_ps).cpu(),
                       cpu.mask_min_p(logits, s_cpu.min_ps))
    m_gpu = gpu.mask_top_k_top_p(logits.cuda(), s_gpu.top_ks, s_gpu.top_ps).cpu()
    assert torch.equal(torch.isinf(m_gpu),
                       torch.isinf(cpu.mask_top_k_top_p(logits, s_cpu.top_ks, s_cpu.top_ps)))
    steps = stream_steps(1000, torch.device("cpu"))
    u_gpu = torch.compile(seeded_uniform)(s_gpu.seeds, s_gpu.positions, steps.cuda()).cpu()
    assert torch.equal(u_gpu, seeded_uniform(s_cpu.seeds, s_cpu.positions, steps))
    assert gpu(logits.cuda(), s_gpu).token_ids.tolist() == cpu(logits, s_cpu).token_ids.tolist()

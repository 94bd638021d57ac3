"""Penalties against reference loops, and the device token counts they read."""
import torch

from nanovllm.layers.sampling.penalties import Penalties, TokenCounts
from nanovllm.layers.sampling.sampler import Sampler
from nanovllm.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 12


def to_cpu(rows: list, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


def reference(logits: list[float], prompt: list[int], generated: list[int],
              params: SamplingParams) -> list[float]:
    """transformers' RepetitionPenaltyLogitsProcessor, then OpenAI's penalties, one by one."""
    out = list(logits)
    for v in set(prompt) | set(generated):
        r = params.repetition_penalty
        out[v] = out[v] / r if out[v] > 0 else out[v] * r
    for v in set(generated):
        out[v] -= params.frequency_penalty * generated.count(v) + params.presence_penalty
    return out


def test_penalties_match_the_reference_loop_and_counts_follow_sampling():
    """Greedy decoding of 6 steps over fixed logits: each penalty changes the argmax path,
    rows without penalties are untouched, and the device counts track the sampled ids."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(6, 4, VOCAB, generator=gen) * 2  # [step, row, V]
    params = [SamplingParams(temperature=0, repetition_penalty=1.7),
              SamplingParams(temperature=0, presence_penalty=1.5),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0, frequency_penalty=0.8, repetition_penalty=0.6)]
    prompts = [[1, 2, 3], [4, 4, 5], [6], [7, 8, 1]]
    counts, sampler = TokenCounts(VOCAB, CPU), Sampler()
    rows = [counts.slot(i, prompts[i]) if p.uses_penalties else 0 for i, p in enumerate(params)]
    assert rows == [1, 2, 0, 3]
    penalties = Penalties.build(counts, rows, params, to_cpu)
    generated: list[list[int]] = [[] for _ in params]
    for step in range(6):
        expected = [int(torch.tensor(reference(table[step, r].tolist(), prompts[r],
                                               generated[r], params[r])).argmax())
                    for r in range(4)]
        got = sampler(table[step], torch.zeros(4), penalties).token_ids.tolist()
        assert got == expected, step
        for r, token in enumerate(got):
            generated[r].append(token)
    for r, row in enumerate(rows):
        if row:
            assert counts.output_counts[row].tolist() == torch.bincount(
                torch.tensor(generated[r]), minlength=VOCAB).tolist()
    assert counts.output_counts[0].eq(0).all() and not counts.prompt_mask[0].any()
    plain = table.argmax(-1).T.tolist()
    assert generated[2] == plain[2] and all(generated[r] != plain[r] for r in (0, 1, 3))


def test_penalised_logits_equal_the_reference_elementwise():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=-0.5,
                             frequency_penalty=0.25), SamplingParams(repetition_penalty=0.7)]
    prompts, generated = [[0, 1, 1], [2]], [[1, 3, 3, 3], [5, 2]]
    counts = TokenCounts(VOCAB, CPU)
    rows = [counts.slot(10 + i, prompts[i]) for i in range(2)]
    for r, tokens in enumerate(generated):
        for t in tokens:
            counts.record(torch.tensor([rows[r]]), torch.tensor([t]))
    p = Penalties.build(counts, rows, params, to_cpu)
    got = Sampler().apply_penalties(logits, counts.output_counts, counts.prompt_mask, p.rows,
                                    p.repetition, p.presence, p.frequency)
    expected = [reference(logits[r].tolist(), prompts[r], generated[r], params[r])
                for r in range(2)]
    torch.testing.assert_close(got, torch.tensor(expected), rtol=0, atol=1e-6)


def test_slots_are_reused_cleared_and_survive_growth():
    counts = TokenCounts(VOCAB, CPU)
    slots = [counts.slot(i, [i]) for i in range(9)]  # 9 > the first capacity of 8 - 1
    assert slots == list(range(1, 10)) and counts.output_counts.size(0) == 16
    assert counts.slot(3, [0]) == slots[3]  # a known sequence keeps its row and counts
    assert counts.prompt_mask[slots[8]].nonzero().flatten().tolist() == [8]
    counts.record(torch.tensor(slots[:2]), torch.tensor([5, 6]))
    counts.release(0)
    counts.release(0)  # releasing twice is harmless
    assert counts.slot(100, [2]) == slots[0]
    assert counts.output_counts[slots[0]].eq(0).all()
    assert counts.prompt_mask[slots[0]].nonzero().flatten().tolist() == [2]
    assert counts.output_counts[slots[1], 6] == 1


def test_a_tiny_repetition_penalty_gives_finite_logits_and_logprobs():
    """1e-46 is 0 in float32: seen positive logits divide by it; they must stay finite so the
    softmax (logprobs) has no NaN, and the penalised token still wins."""
    logits = torch.tensor([[1.0, 3.0, -2.0, 0.5] + [0.0] * (VOCAB - 4)])
    params = [SamplingParams(temperature=0, repetition_penalty=1e-46)]
    counts = TokenCounts(VOCAB, CPU)
    rows = [counts.slot(0, [0, 2])]
    p = Penalties.build(counts, rows, params, to_cpu)
    got = Sampler().apply_penalties(logits, counts.output_counts, counts.prompt_mask, p.rows,
                                    p.repetition, p.presence, p.frequency)
    assert not torch.isnan(torch.log_softmax(got, -1)).any()
    assert got.isfinite()[0, :2].all() and int(got.argmax()) == 0

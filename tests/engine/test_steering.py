"""logit_bias, allowed_token_ids, min_tokens and bad_words through the whole engine, against
transformers' logits steered by hand (vLLM's semantics)."""
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.reference import hf_last_logits, ids, load_hf, token_prompts

N = 12
EOS = 0  # the tiny tokenizer's
HELLO, SPACE_HELLO = 345, 383  # "hello", " hello": single tokens
FOX = [274, 90]  # "fox": two tokens (" fox" is one, of another length: not banned, as vLLM)
PROMPTS = token_prompts(3, (7, 19, 11))


def greedy(max_tokens: int = N, **kwargs) -> SamplingParams:
    kwargs.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


def has_run(tokens: list[int], run: list[int]) -> bool:
    return any(tokens[i:i + len(run)] == run for i in range(len(tokens) - len(run) + 1))


@pytest.fixture(scope="module")
def llm(tiny_model):
    engine = LLM(tiny_model, num_kvcache_blocks=64)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf(tiny_model):
    return load_hf(tiny_model)


def hf_steered(hf, prompt: list[int], steer: Callable[[torch.Tensor, list[int]], torch.Tensor],
               num_tokens: int = N) -> list[int]:
    """Greedy tokens of transformers' logits, each step's steered by steer(logits, completion)."""
    out: list[int] = []
    for _ in range(num_tokens):
        out.append(int(steer(hf_last_logits(hf, prompt + out).clone(), out).argmax()))
    return out


def masked(logits: torch.Tensor, banned) -> torch.Tensor:
    logits[list(banned)] = float("-inf")
    return logits


def test_bias_of_100_forces_the_token_and_minus_100_bans(llm):
    forced = llm.generate(PROMPTS, greedy(logit_bias={300: 100}), use_tqdm=False)
    assert ids(forced) == [[300] * N] * len(PROMPTS)
    plain = ids(llm.generate(PROMPTS, greedy(), use_tqdm=False))
    banned = {t for row in plain for t in row}
    out = ids(llm.generate(PROMPTS, greedy(logit_bias={t: -100 for t in banned}),
                           use_tqdm=False))
    assert not banned & {t for row in out for t in row}


def test_bias_adds_to_the_logits_like_transformers(llm, hf):
    bias = {300: 9.0, 5: 4.5, 17: -3.0}
    out = ids(llm.generate(PROMPTS, greedy(logit_bias=bias), use_tqdm=False))

    def steer(logits, _):
        for t, b in bias.items():
            logits[t] += b
        return logits
    assert out == [hf_steered(hf, p, steer) for p in PROMPTS]


def test_allowed_token_ids_are_argmax_over_the_set(llm, hf):
    allowed = [5, 17, 42, 99, 300]
    out = ids(llm.generate(PROMPTS, greedy(allowed_token_ids=allowed), use_tqdm=False))
    assert all(t in allowed for row in out for t in row)
    outside = [t for t in range(512) if t not in allowed]
    assert out == [hf_steered(hf, p, lambda lg, _: masked(lg, outside)) for p in PROMPTS]


def test_min_tokens_holds_back_stop_ids_then_stops(llm, hf):
    x, m = 300, 5
    sp = greedy(16, ignore_eos=False, stop_token_ids=[x], min_tokens=m, logit_bias={x: 100})
    out = llm.generate(PROMPTS, sp, use_tqdm=False)

    def steer(logits, done):
        logits[x] += 100
        return masked(logits, [x, EOS] if len(done) < m else [])
    for o, p in zip(out, PROMPTS):
        assert o["token_ids"] == hf_steered(hf, p, steer, m + 1)
        assert x not in o["token_ids"][:m] and o["token_ids"][m] == x
        assert o["finish_reason"] == "stop"
    eos = llm.generate(PROMPTS, greedy(16, ignore_eos=False, min_tokens=3,
                                       logit_bias={EOS: 100}), use_tqdm=False)
    assert [o["token_ids"][3:] for o in eos] == [[EOS]] * len(PROMPTS)


def test_min_tokens_keeps_stop_strings_out_of_the_first_tokens(llm):
    forced = dict(logit_bias={HELLO: 100}, stop="hello")
    assert llm.generate(PROMPTS[0], greedy(**forced), use_tqdm=False)[0]["text"] == ""
    out = llm.generate(PROMPTS[0], greedy(min_tokens=3, **forced), use_tqdm=False)[0]
    # vLLM: the first 3 tokens' text is never searched; the 4th brings the match
    assert out["token_ids"] == [HELLO] * 4 and out["text"] == "hello" * 3
    assert out["finish_reason"] == "stop"


def test_single_token_bad_words_are_always_banned(llm, hf):
    sp = greedy(logit_bias={HELLO: 100, SPACE_HELLO: 90}, bad_words=["hello"])
    out = ids(llm.generate(PROMPTS, sp, use_tqdm=False))
    assert not {HELLO, SPACE_HELLO} & {t for row in out for t in row}

    def steer(logits, _):
        logits[HELLO] += 100
        logits[SPACE_HELLO] += 90
        return masked(logits, [HELLO, SPACE_HELLO])
    assert out == [hf_steered(hf, p, steer) for p in PROMPTS]


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_bad_word_of_two_tokens_never_appears(llm, hf, pipelined):
    llm._pipelined = pipelined
    try:
        free = ids(llm.generate(PROMPTS, greedy(allowed_token_ids=FOX), use_tqdm=False))
        out = ids(llm.generate(PROMPTS, greedy(allowed_token_ids=FOX, bad_words=["fox"]),
                               use_tqdm=False))
    finally:
        llm._pipelined = True
    assert any(has_run(row, FOX) for row in free)  # the word appears without bad_words
    assert not any(has_run(row, FOX) for row in out)
    outside = [t for t in range(512) if t not in FOX]

    def steer(logits, done):
        return masked(logits, outside + ([FOX[1]] if done[-1:] == FOX[:1] else []))
    assert out == [hf_steered(hf, p, steer) for p in PROMPTS]


STEERED = [greedy(logit_bias={300: 100}), greedy(allowed_token_ids=[5, 17]),
           greedy(bad_words=["hello"], logit_bias={HELLO: 50}), greedy(min_tokens=4)]


def test_unaffected_rows_of_a_mixed_batch_keep_their_tokens(llm):
    plain = [greedy(), SamplingParams(temperature=1.0, seed=11, max_tokens=N, ignore_eos=True)]
    alone = ids(llm.generate(PROMPTS[:2], plain, use_tqdm=False))
    mixed = ids(llm.generate(PROMPTS[:2] + [PROMPTS[2]] * 4, plain + STEERED, use_tqdm=False))
    assert mixed[:2] == alone
    assert mixed[2] == [300] * N and set(mixed[3]) <= {5, 17} and HELLO not in mixed[4]


def test_n_completions_with_seeds_keep_their_steering(llm):
    sp = SamplingParams(n=3, seed=5, temperature=1.0, max_tokens=N, ignore_eos=True,
                        allowed_token_ids=FOX + [5], bad_words=["fox"])
    out = llm.generate(PROMPTS[:2], sp, use_tqdm=False)
    again = llm.generate(PROMPTS[:2], sp, use_tqdm=False)
    rows = [c["token_ids"] for o in out for c in o["outputs"]]
    assert rows == [c["token_ids"] for o in again for c in o["outputs"]]
    assert all(set(r) <= {*FOX, 5} and not has_run(r, FOX) for r in rows)
    one = replace(sp, n=1)
    assert ids(llm.generate(PROMPTS[:2], one, use_tqdm=False)) == ids(out)


def test_bias_comes_before_the_penalties_as_in_vllm(llm, hf):
    bias, rep, freq = {300: 6.0, 5: 3.0}, 1.5, 0.5
    sp = greedy(logit_bias=bias, repetition_penalty=rep, frequency_penalty=freq)
    out = ids(llm.generate(PROMPTS, sp, use_tqdm=False))

    def steer(logits, done, prompt):
        for t, b in bias.items():
            logits[t] += b
        seen = list(set(prompt + done))
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / rep, logits[seen] * rep)
        for t in done:
            logits[t] -= freq
        return logits
    assert out == [hf_steered(hf, p, lambda lg, d, p=p: steer(lg, d, p)) for p in PROMPTS]


def test_raw_logprobs_stay_the_models(llm, hf):
    out = llm.generate(PROMPTS[0], greedy(6, logit_bias={300: 100}, logprobs=2),
                       use_tqdm=False)[0]
    for i, entry in enumerate(out["logprobs"]):
        expected = hf_last_logits(hf, PROMPTS[0] + [300] * i).log_softmax(-1)[300]
        assert entry[300] == pytest.approx(float(expected), abs=1e-4)


def test_chunked_prefill_gives_the_same_tokens(tiny_model, llm):
    prompts = token_prompts(4, (40, 9))
    expected = ids(llm.generate(prompts * 2, STEERED[:2] * 2, use_tqdm=False))
    chunked = LLM(tiny_model, num_kvcache_blocks=64, max_num_batched_tokens=16)
    try:
        assert ids(chunked.generate(prompts * 2, STEERED[:2] * 2, use_tqdm=False)) == expected
        assert ids(chunked.generate([prompts[0]] * 2, STEERED[2:], use_tqdm=False)) == ids(
            llm.generate([prompts[0]] * 2, STEERED[2:], use_tqdm=False))
    finally:
        chunked.shutdown()


def test_tensor_parallel_gives_the_same_tokens(tiny_model, llm):
    prompts = PROMPTS + PROMPTS[:1]
    expected = ids(llm.generate(prompts, STEERED, use_tqdm=False))
    tp = LLM(tiny_model, tensor_parallel_size=2, num_kvcache_blocks=64)
    try:
        assert ids(tp.generate(prompts, STEERED, use_tqdm=False)) == expected
    finally:
        tp.shutdown()


@pytest.mark.parametrize("kwargs, name", [
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={1: float("nan")}), "logit_bias"),
    (dict(logit_bias=[1]), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"), (dict(bad_words=[" "]), "bad_words"),
    (dict(bad_words="fox"), "bad_words")])
def test_bad_values_name_the_field(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}=.* expected"):
        SamplingParams(**kwargs)


def test_bias_is_clipped_and_ids_outside_the_vocab_are_refused(llm):
    """Before any work: an id the model cannot sample is a ValueError naming its field."""
    assert SamplingParams(logit_bias={3: 1e9, 4: -1e9}).logit_bias == {3: 100.0, 4: -100.0}
    for kwargs, name in [(dict(logit_bias={512: 1.0}), "logit_bias"),
                         (dict(allowed_token_ids=[3, 600]), "allowed_token_ids"),
                         # with min_tokens its ids index the logits: 10**6 failed every step
                         (dict(stop_token_ids=[10**6], min_tokens=2), "stop_token_ids"),
                         (dict(stop_token_ids=[512]), "stop_token_ids")]:
        with pytest.raises(ValueError, match=rf"^request 0: {name}: token id \d+ is outside"):
            llm.generate(PROMPTS[:1], SamplingParams(**kwargs), use_tqdm=False)


def test_penalties_with_deferred_sampling_run_and_free_their_rows(tiny_model):
    """bad_words (like a grammar) defers a step's sampling until the step before is committed,
    outside launch()'s inference mode: with a penalty a request joining a step in flight, or a
    chunked prefill, failed on the penalty rows' in-place updates. Rows of sequences that
    finished just before such a sample were taken again and never freed."""
    engine = LLM(tiny_model, num_kvcache_blocks=16, max_num_batched_tokens=12)
    params = SamplingParams(temperature=1.0, max_tokens=12, repetition_penalty=1.2, seed=3,
                            bad_words=["zzqx"], stop_token_ids=list(range(3, 200)))
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                            repetition_penalty=1.2, bad_words=["zzqx"])
    try:
        engine.add_request(PROMPTS[0], greedy)
        engine.step()  # sampled at launch: no step in flight
        engine.add_request(PROMPTS[1], greedy)  # its prefill's sample waits for that step
        while not engine.is_finished():
            engine.step()
        for _ in range(2):
            outputs = engine.generate([p * 2 for p in PROMPTS], params, use_tqdm=False)
            assert all(out["token_ids"] for out in outputs)
        assert engine.model_runner.token_counts.slots == {}
    finally:
        engine.shutdown()

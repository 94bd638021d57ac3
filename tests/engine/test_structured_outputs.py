"""Structured outputs end to end on a random model (the hardest client): every output conforms,
greedy equals transformers' masked argmax, and the sampling options, chunked prefill,
preemption and TP=2 all keep the grammar."""
import json
import re
import sys

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.structured_outputs import StructuredOutputs
from nanovllm.sampling_params import StructuredOutputsParams as Structured
from tests.reference import load_hf

xgrammar = pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "pet": {"enum": ["cat", "dog"]},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["ok", "pet", "n"]}
REGEX = r"(cat|dog)-[0-9]{2}"
CHOICES = ["yes", "no way", "maybe"]
GRAMMAR = 'root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [a-z]{1,8}'
PROMPTS = ["hello world", "the cache", "a quick brown fox", "one two three"]
# one per kind of KINDS; json_object's prompt is one where the random model closes its object
FIVE_PROMPTS = [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[1]]


@pytest.fixture(scope="module")
def llm(tiny_model):
    engine = LLM(tiny_model, num_kvcache_blocks=16)
    yield engine
    engine.shutdown()


def params(structured: Structured, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 40, **kwargs},
                          structured_outputs=structured)


def assert_conforms(llm, structured: Structured, out: dict) -> None:
    """The output's text meets its constraint, and xgrammar's own matcher accepts its tokens."""
    assert out["finish_reason"] == "stop", out
    matcher = xgrammar.GrammarMatcher(llm.grammars.compile(structured))
    assert all(matcher.accept_token(t) for t in out["token_ids"]) and matcher.is_terminated()
    text, kind = out["text"], structured.kind
    if kind == "json":
        jsonschema = pytest.importorskip("jsonschema")
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    else:
        assert re.fullmatch(r"(hello|hi) [a-z]{1,8}!", text), text


KINDS = [Structured(json=SCHEMA), Structured(json_object=True), Structured(regex=REGEX),
         Structured(choice=CHOICES), Structured(grammar=GRAMMAR)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_kind_conforms_beside_an_unchanged_unconstrained_request(llm, temperature):
    alone = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12),
                         use_tqdm=False)[0]
    structured = [params(s, temperature=temperature) for s in KINDS]
    outs = llm.generate(PROMPTS[:1] + FIVE_PROMPTS,
                        [SamplingParams(temperature=0, max_tokens=12)] + structured,
                        use_tqdm=False)
    assert outs[0]["token_ids"] == alone["token_ids"]
    for s, out in zip(KINDS, outs[1:]):
        assert_conforms(llm, s, out)


def test_json_has_no_free_whitespace_unless_asked(llm):
    tight = llm.generate(PROMPTS[0], params(Structured(json=SCHEMA)), use_tqdm=False)[0]
    assert not re.search(r"\s{2}|[\r\n\t]", tight["text"])
    loose = Structured(json=SCHEMA, disable_any_whitespace=False)
    assert llm.grammars.compile(loose) is not llm.grammars.compile(Structured(json=SCHEMA))


@torch.inference_mode()
def test_greedy_regex_is_transformers_masked_argmax(llm, tiny_model):
    """Teacher-forced: at each step transformers' logits on prompt + tokens so far, masked by
    an xgrammar matcher built here, argmax."""
    out = llm.generate(PROMPTS[2], params(Structured(regex=REGEX)), use_tqdm=False)[0]
    info = xgrammar.TokenizerInfo.from_huggingface(llm.tokenizer, vocab_size=512,
                                                   stop_token_ids=[llm.tokenizer.eos_token_id])
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_regex(REGEX))
    hf, tokens = load_hf(tiny_model), llm.tokenizer.encode(PROMPTS[2])
    expected, bitmask = [], xgrammar.allocate_token_bitmask(1, 512)
    while not matcher.is_terminated():
        logits = hf(torch.tensor([tokens + expected])).logits[0, -1:].float()
        matcher.fill_next_token_bitmask(bitmask)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask)
        expected.append(int(logits.argmax()))
        assert matcher.accept_token(expected[-1])
    assert out["token_ids"] == expected


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "exactly one of .* got none"),
    (dict(regex="a", choice=["a"]), "exactly one of .* got regex and choice"),
    (dict(choice=[]), "structured_outputs.choice="),
    (dict(json=3), "structured_outputs.json="),
    (dict(json_object=False), "structured_outputs.json_object="),
    (dict(regex="a", disable_any_whitespace=None), "disable_any_whitespace")])
def test_bad_params_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Structured(**kwargs)


@pytest.mark.parametrize("structured, match", [
    (Structured(json={"type": "objectx"}), "structured_outputs.json does not compile"),
    (Structured(json="{bad"), "structured_outputs.json does not compile"),
    (Structured(regex="[a-z"), "structured_outputs.regex does not compile: .*Unclosed"),
    (Structured(grammar="root ::= "), "structured_outputs.grammar does not compile")])
def test_bad_specs_are_refused_before_queueing(llm, structured, match):
    good = params(Structured(choice=CHOICES))
    with pytest.raises(ValueError, match="request 1: " + match):
        llm.generate(PROMPTS[:2], [good, params(structured)], use_tqdm=False)
    with pytest.raises(ValueError, match=match):
        llm.add_request(PROMPTS[0], params(structured))
    assert llm.is_finished()
    mutated = params(Structured(regex=REGEX))
    mutated.structured_outputs.choice = CHOICES  # set after construction: checked again
    with pytest.raises(ValueError, match="got regex and choice"):
        llm.generate(PROMPTS[0], mutated, use_tqdm=False)
    assert_conforms(llm, good.structured_outputs,
                    llm.generate(PROMPTS[0], good, use_tqdm=False)[0])


def test_missing_xgrammar_names_the_extra(llm, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    grammars = StructuredOutputs(llm.tokenizer, 512, (llm.tokenizer.eos_token_id,))
    with pytest.raises(ValueError, match=r'regex needs xgrammar.*install -e "\.\[structured\]"'):
        grammars.compile(Structured(regex=REGEX))


def test_grammar_steps_stay_pipelined_and_equal_lockstep(llm):
    """A constrained batch keeps a step in flight (its sampler waits for the previous commit,
    not its forward), and gives what the lockstep engine gives, sampling with seeds too."""
    sps = [params(s, temperature=0.8, seed=i) for i, s in enumerate(KINDS)]
    sps.append(SamplingParams(temperature=0.8, seed=9, max_tokens=12))
    prompts = FIVE_PROMPTS + PROMPTS[:1]
    in_flight = []
    for seq_params in sps[:2]:
        llm.add_request(PROMPTS[0], seq_params)
    while not llm.is_finished():
        llm.step()
        in_flight.append(llm._in_flight is not None)
    assert sum(in_flight) > 5  # launched steps left uncommitted, as in an unconstrained batch
    pipelined = llm.generate(prompts, sps, use_tqdm=False)
    llm._pipelined = False
    try:
        lockstep = llm.generate(prompts, sps, use_tqdm=False)
    finally:
        llm._pipelined = True
    assert [o["token_ids"] for o in pipelined] == [o["token_ids"] for o in lockstep]
    for s, out in zip(KINDS, pipelined):
        assert_conforms(llm, s, out)


def test_an_output_cut_by_max_tokens_is_a_prefix_the_grammar_accepts(llm):
    """The last token of a length-limited row is drawn under the mask too (pipelined: its
    sampler runs after the step that set the limit was advanced)."""
    sp = params(Structured(regex=r"[a-z]{30,40}"), max_tokens=6, temperature=1.0, seed=3)
    for out in llm.generate(PROMPTS, sp, use_tqdm=False):
        matcher = xgrammar.GrammarMatcher(llm.grammars.compile(sp.structured_outputs))
        assert out["finish_reason"] == "length" and len(out["token_ids"]) == 6
        assert all(matcher.accept_token(t) for t in out["token_ids"]), out


def test_n2_with_a_seed_is_reproducible_and_conforms(llm):
    sp = params(Structured(grammar=GRAMMAR), temperature=1.0, seed=7, n=2)
    first, again = (llm.generate(PROMPTS[1], sp, use_tqdm=False)[0] for _ in range(2))
    assert first["outputs"] == again["outputs"] and len(first["outputs"]) == 2
    for completion in first["outputs"]:
        assert_conforms(llm, sp.structured_outputs, completion)


def test_a_terminated_grammar_stops_even_with_ignore_eos(llm):
    out = llm.generate(PROMPTS[0], params(Structured(choice=CHOICES), ignore_eos=True),
                       use_tqdm=False)[0]
    assert_conforms(llm, Structured(choice=CHOICES), out)


def _rejected_first_token(llm, structured: Structured) -> int:
    """A token id the grammar cannot start with."""
    matcher = xgrammar.GrammarMatcher(llm.grammars.compile(structured))
    return next(t for t in range(llm.config.hf_config.vocab_size) if not matcher.accept_token(t))


def test_allowed_tokens_outside_the_grammar_abort_only_their_request(llm):
    """allowed_token_ids outside the grammar's first tokens leave no token to sample: that
    request ends with "abort", and the request batched with it runs as it runs alone."""
    structured = Structured(choice=CHOICES)
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPTS[2], plain, use_tqdm=False)[0]
    constrained = params(structured, allowed_token_ids=[_rejected_first_token(llm, structured)])
    bad, other = llm.generate([PROMPTS[0], PROMPTS[2]], [constrained, plain], use_tqdm=False)
    assert bad["finish_reason"] == "abort", bad
    assert other["token_ids"] == alone["token_ids"] and other["finish_reason"] == "length"


def test_stop_string_cuts_a_constrained_output(llm):
    sp = params(Structured(regex=r"[a-z]{2,12}-(cat|dog)"), stop="-", temperature=0.7, seed=1)
    out = llm.generate(PROMPTS[3], sp, use_tqdm=False)[0]
    assert out["finish_reason"] == "stop" and re.fullmatch(r"[a-z]{2,12}", out["text"])


def test_logprobs_of_constrained_tokens(llm):
    out = llm.generate(PROMPTS[0], params(Structured(regex=REGEX), logprobs=2),
                       use_tqdm=False)[0]
    assert len(out["logprobs"]) == len(out["token_ids"])
    assert all(t in lp for t, lp in zip(out["token_ids"], out["logprobs"]))


def test_chunked_prefill_gives_the_unchunked_output(llm, tiny_model):
    prompt = list(range(1, 151))
    sp = params(Structured(json=SCHEMA))
    chunked = LLM(tiny_model, num_kvcache_blocks=16, max_num_batched_tokens=64)
    try:
        outs = chunked.generate([prompt, PROMPTS[0]], [sp, sp], use_tqdm=False)
    finally:
        chunked.shutdown()
    assert [o["token_ids"] for o in outs] == [
        o["token_ids"] for o in llm.generate([prompt, PROMPTS[0]], [sp, sp], use_tqdm=False)]
    for out in outs:
        assert_conforms(llm, sp.structured_outputs, out)


def test_preempted_sequences_keep_their_grammar(tiny_model):
    # 6 prompts near a 256-token block edge in a 7-block pool: decode steps preempt
    prompts = [[(11 * i + 3 * j) % 400 + 2 for j in range(230 + 9 * i)] for i in range(6)]
    sp = params(Structured(regex=r"[a-z]{20,40}"))
    small = LLM(tiny_model, num_kvcache_blocks=7)
    try:
        outs = small.generate(prompts, sp, use_tqdm=False)
        assert small.stats()["preemptions"] > 0
        alone = [small.generate(p, sp, use_tqdm=False)[0] for p in prompts]
    finally:
        small.shutdown()
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in alone]
    assert all(re.fullmatch(r"[a-z]{20,40}", o["text"]) for o in outs)


def test_tensor_parallel_gives_the_single_rank_output(llm, tiny_model):
    sps = [params(s) for s in KINDS]
    tp = LLM(tiny_model, tensor_parallel_size=2, num_kvcache_blocks=16)
    try:
        outs = tp.generate(FIVE_PROMPTS, sps, use_tqdm=False)
    finally:
        tp.shutdown()
    expected = llm.generate(FIVE_PROMPTS, sps, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in expected]
    for sp, out in zip(sps, outs):
        assert_conforms(llm, sp.structured_outputs, out)

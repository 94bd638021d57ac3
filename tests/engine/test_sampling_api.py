"""Sampling through the whole engine: filters, seeds, stop strings and ids, finish reasons, chat."""
import json
import random
import shutil

import pytest

from nanovllm import LLM, SamplingParams

N = 16


def greedy(max_tokens: int = N, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 400) for _ in range(n)]


def ids(outs: list[dict]) -> list[list[int]]:
    return [o["token_ids"] for o in outs]


def results(outs: list[dict]) -> list[dict]:
    """Outputs without their timings and request ids (new for every request)."""
    return [{k: v for k, v in o.items() if k not in ("metrics", "request_id")} for o in outs]


@pytest.fixture(scope="module")
def llm(tiny_model):
    engine = LLM(tiny_model, num_kvcache_blocks=16)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [rand_prompt(rng, n) for n in (7, 30, 13)]


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=-0.1), "temperature"), (dict(max_tokens=0), "max_tokens"),
    (dict(top_k=-2), "top_k"), (dict(top_k=2.5), "top_k"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(min_p=-0.1), "min_p"), (dict(min_p=1.1), "min_p"),
    (dict(stop=""), "stop"), (dict(stop=["a", 3]), "stop"), (dict(stop_token_ids=[-1]),
                                                              "stop_token_ids"),
    (dict(seed=-1), "seed"), (dict(seed=2**63), "seed"), (dict(seed=1.0), "seed"),
    (dict(n=0), "n"), (dict(logprobs=-1), "logprobs"), (dict(prompt_logprobs=1.5),
                                                        "prompt_logprobs"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(presence_penalty=2.5),
                                                           "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(skip_special_tokens=1), "skip_special_tokens")])
def test_bad_sampling_params_name_the_value_and_range(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}=.* expected"):
        SamplingParams(**kwargs)


def test_defaults_keep_upstream_behaviour():
    sp = SamplingParams(stop="x")
    assert (sp.temperature, sp.max_tokens, sp.ignore_eos) == (1.0, 64, False)
    assert (sp.top_k, sp.top_p, sp.min_p, sp.seed) == (-1, 1.0, 0.0, None)
    assert sp.stop_strings == ("x",) and SamplingParams().stop_strings == ()


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_logprobs_beyond_the_vocabulary_are_refused(llm, name):
    """All of the vocabulary may be asked; more is a ValueError, not a silent cap."""
    vocab = llm.config.hf_config.vocab_size
    out = llm.generate("the", SamplingParams(max_tokens=1, **{name: vocab}), use_tqdm=False)[0]
    scored = out["logprobs"][0] if name == "logprobs" else out["prompt_logprobs"][1]
    assert len(scored) == vocab
    with pytest.raises(ValueError, match=rf"^request 0: {name}={vocab + 1} is invalid"):
        llm.generate("the", SamplingParams(max_tokens=1, **{name: vocab + 1}), use_tqdm=False)


@pytest.fixture(scope="module")
def greedy_ids(llm, prompts) -> list[list[int]]:
    return ids(llm.generate(prompts, greedy(), use_tqdm=False))


@pytest.mark.parametrize("kwargs", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_filters_at_temperature_one_reproduce_greedy(llm, prompts, greedy_ids, kwargs):
    sp = SamplingParams(temperature=1.0, max_tokens=N, ignore_eos=True, **kwargs)
    assert ids(llm.generate(prompts, sp, use_tqdm=False)) == greedy_ids


def test_same_seed_same_tokens_whatever_the_batch(llm, prompts):
    me = SamplingParams(seed=7, temperature=1.0, top_p=0.95, max_tokens=N, ignore_eos=True)
    alone = llm.generate([prompts[0]], me, use_tqdm=False)[0]["token_ids"]
    mates = [SamplingParams(top_k=5, max_tokens=N), me, greedy(),
             SamplingParams(seed=8, min_p=0.1, max_tokens=4, ignore_eos=True)]
    outs = llm.generate([prompts[1], prompts[0], prompts[2], prompts[0]], mates, use_tqdm=False)
    assert outs[1]["token_ids"] == alone
    assert outs[3]["token_ids"] != alone[:4]  # another seed, another draw (p ~ 1e-9 to fail)
    other = SamplingParams(seed=9, temperature=1.0, top_p=0.95, max_tokens=N, ignore_eos=True)
    assert llm.generate([prompts[0]], other, use_tqdm=False)[0]["token_ids"] != alone


def test_seeded_tokens_survive_preemption(tiny_model, llm):
    rng = random.Random(1)
    batch = [rand_prompt(rng, 200), rand_prompt(rng, 210)]
    # 200 + 57 tokens need a second block: the second sequence finds none free
    params = [SamplingParams(seed=s, top_k=50, max_tokens=64, ignore_eos=True) for s in (1, 2)]
    expected = ids(llm.generate(batch, params, use_tqdm=False))
    small = LLM(tiny_model, num_kvcache_blocks=3)  # each needs 2 blocks at the end; 3 exist
    try:
        assert ids(small.generate(batch, params, use_tqdm=False)) == expected
        assert small.scheduler.num_preemptions > 0
    finally:
        small.shutdown()


def spanning_stop(llm, tokens: list[int]) -> str:
    """A stop string of the last 2 characters of one token and the first 2 of the next."""
    texts = [llm.tokenizer.decode(tokens[:n]) for n in range(len(tokens) + 1)]
    for i in range(1, len(tokens) - 1):
        a, b, c = texts[i - 1], texts[i], texts[i + 1]
        if "\ufffd" in c or len(b) - len(a) < 2 or len(c) - len(b) < 2:
            continue
        stop = b[-2:] + c[len(b):len(b) + 2]
        if c.find(stop) == len(b) - 2:  # its first occurrence is the spanning one
            return stop
    raise AssertionError(f"no clean token boundary in {texts[-1]!r}")


def test_stop_string_spanning_tokens_is_cut_from_text(llm, prompts):
    full = llm.generate(prompts, greedy(24), use_tqdm=False)
    stop = spanning_stop(llm, full[1]["token_ids"])
    params = [greedy(24), greedy(24, stop=["never here", stop]), greedy(24)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = full[1]["token_ids"]
    n = next(n for n in range(len(tokens) + 1) if stop in llm.tokenizer.decode(tokens[:n]))
    assert outs[1]["token_ids"] == tokens[:n]
    assert outs[1]["text"] == full[1]["text"][:full[1]["text"].find(stop)]
    assert outs[1]["finish_reason"] == "stop"
    assert results([outs[0], outs[2]]) == results([full[0], full[2]])
    assert llm.stop_checker.states == {}  # nothing kept for finished sequences
    kept = llm.generate(prompts[1], greedy(24, stop=["never here", stop],
                                           include_stop_str_in_output=True), use_tqdm=False)[0]
    assert (kept["token_ids"], kept["text"]) == (outs[1]["token_ids"], outs[1]["text"] + stop)


def test_detokenize_false_gives_the_same_tokens_without_text(llm, prompts):
    full = llm.generate(prompts, greedy(12, logprobs=2), use_tqdm=False)
    bare = llm.generate(prompts, greedy(12, logprobs=2, detokenize=False), use_tqdm=False)
    assert all(out["text"] for out in full)
    assert [(out["text"], out["outputs"][0]["text"]) for out in bare] == [("", "")] * 3

    def textless(outs):
        return [{**out, "text": "", "outputs": [{**c, "text": ""} for c in out["outputs"]]}
                for out in results(outs)]
    assert textless(full) == textless(bare)
    with pytest.raises(ValueError, match=r"^stop='a' is invalid: expected None with "
                                         r"detokenize=False"):
        SamplingParams(stop="a", detokenize=False)


def test_stop_token_ids_finish_with_the_token_kept(llm, prompts, greedy_ids):
    tokens = greedy_ids[0]
    i = next(i for i in range(3, N) if tokens[i] not in tokens[:i])
    out = llm.generate(prompts[0], greedy(stop_token_ids=[tokens[i]]), use_tqdm=False)[0]
    assert out["token_ids"] == tokens[:i + 1] and out["finish_reason"] == "stop"
    # the text leaves out the stop token's, as vLLM
    assert out["text"] == llm.tokenizer.decode(tokens[:i], skip_special_tokens=True)


EOS_PROMPT = [7, 8, 9]  # the tiny checkpoint's greedy answer ends in EOS after 59 tokens


def test_generation_config_eos_ids_end_a_completion(tiny_model, tmp_path):
    """Every id of generation_config.json's eos_token_id ends a completion as the tokenizer's
    EOS does (Llama-3's <|eot_id|>, Qwen3's two), unless ignore_eos; min_tokens holds them
    back; the token stays in token_ids, out of the text."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    with open(model / "generation_config.json") as f:
        generation = json.load(f)
    eos, other = generation["eos_token_id"], 7
    (model / "generation_config.json").write_text(json.dumps(
        {**generation, "eos_token_id": [eos, other]}))
    llm = LLM(str(model), num_kvcache_blocks=8)
    try:
        assert llm.scheduler.eos_token_ids == (eos, other)
        favour = SamplingParams(temperature=0, max_tokens=5, logit_bias={other: 100})
        out = llm.generate([[1, 2, 3]], favour, use_tqdm=False)[0]
        assert out["token_ids"] == [other] and out["finish_reason"] == "stop"
        assert out["text"] == ""
        for kwargs in (dict(ignore_eos=True), dict(min_tokens=5)):
            out = llm.generate([[1, 2, 3]], SamplingParams(
                temperature=0, max_tokens=5, logit_bias={other: 100}, **kwargs),
                use_tqdm=False)[0]
            assert len(out["token_ids"]) == 5 and out["finish_reason"] == "length", kwargs
    finally:
        llm.shutdown()


def test_text_leaves_out_special_tokens_unless_asked(llm):
    """As vLLM: "text" skips special tokens (the EOS here) by default; the ids keep them."""
    params = dict(temperature=0, max_tokens=64)
    out = llm.generate(EOS_PROMPT, SamplingParams(**params), use_tqdm=False)[0]
    eos = llm.tokenizer.eos_token_id
    assert out["finish_reason"] == "stop" and out["token_ids"][-1] == eos
    assert out["text"] == llm.tokenizer.decode(out["token_ids"][:-1])
    assert llm.tokenizer.eos_token not in out["text"]
    # As vLLM, the token that stopped the request is never in the text, special or not ...
    raw = llm.generate(EOS_PROMPT, SamplingParams(**params, skip_special_tokens=False),
                       use_tqdm=False)[0]
    assert raw["text"] == out["text"] and raw["token_ids"] == out["token_ids"]
    # ... but an EOS that did not stop it is, unless skipped.
    params["ignore_eos"] = True
    skipped, raw = [llm.generate(EOS_PROMPT, SamplingParams(**params, skip_special_tokens=skip),
                                 use_tqdm=False)[0]["text"] for skip in (True, False)]
    assert llm.tokenizer.eos_token in raw and llm.tokenizer.eos_token not in skipped


def test_finish_reason_length_at_max_tokens_and_max_model_len(tiny_model, llm, prompts):
    out = llm.generate(prompts[0], greedy(5), use_tqdm=False)[0]
    assert len(out["token_ids"]) == 5 and out["finish_reason"] == "length"
    short = LLM(tiny_model, max_model_len=20, num_kvcache_blocks=2)
    try:
        out = short.generate(prompts[2], greedy(64), use_tqdm=False)[0]  # 13-token prompt
    finally:
        short.shutdown()
    assert len(out["token_ids"]) == 20 - 13 and out["finish_reason"] == "length"


def test_generate_takes_one_prompt_or_many_and_params_per_prompt(llm, prompts):
    one = llm.generate(prompts[0], greedy(4), use_tqdm=False)
    assert results(one) == results(llm.generate([prompts[0]], greedy(4), use_tqdm=False))
    text = llm.generate("hello world", greedy(3), use_tqdm=False)
    assert len(text) == 1 and len(text[0]["token_ids"]) == 3
    per = llm.generate(prompts[:2], [greedy(2), greedy(5)], use_tqdm=False)
    assert [len(o["token_ids"]) for o in per] == [2, 5]
    default = llm.generate(prompts[0], None, use_tqdm=False)[0]
    assert default["finish_reason"] == "stop" or len(default["token_ids"]) == 64
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(prompts, [greedy(), greedy()], use_tqdm=False)


def test_chat_equals_generate_on_the_templated_prompt(llm):
    convs = [[{"role": "user", "content": "hello world"}],
             [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the fox"},
              {"role": "assistant", "content": "jumps"}, {"role": "user", "content": "over"}]]
    templated = [llm.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                 for c in convs]
    assert templated[0].endswith("<|im_start|>assistant\n")
    expected = llm.generate(templated, greedy(8), use_tqdm=False)
    assert results(llm.chat(convs, greedy(8), use_tqdm=False)) == results(expected)
    assert results(llm.chat(convs[1], greedy(8), use_tqdm=False)) == results(expected[1:])


# A template with a variable (Qwen3's enable_thinking) and tools, as a chat_template argument
THINKING_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['name'] }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if not (loop.last and continue_final_message) %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}")


@pytest.mark.parametrize("options", [
    dict(chat_template_kwargs={"enable_thinking": False}),
    dict(add_generation_prompt=False),
    dict(add_generation_prompt=False, continue_final_message=True),
    dict(tools=[{"name": "search"}, {"name": "fetch"}]),
    dict(chat_template_kwargs={"add_generation_prompt": False}),  # over the option, as vLLM
])
def test_chat_template_options_equal_generate_on_the_rendered_prompt(llm, options):
    conv = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "the"}]
    kwargs = {"add_generation_prompt": True, **options.get("chat_template_kwargs", {}),
              **{k: v for k, v in options.items() if k != "chat_template_kwargs"}}
    rendered = llm.tokenizer.apply_chat_template(conv, tokenize=False,
                                                 chat_template=THINKING_TEMPLATE, **kwargs)
    default = llm.tokenizer.apply_chat_template(conv, tokenize=False,
                                                chat_template=THINKING_TEMPLATE,
                                                add_generation_prompt=True)
    assert rendered != default  # each option changes the prompt
    expected = llm.generate(rendered, greedy(6), use_tqdm=False)
    got = llm.chat(conv, greedy(6), use_tqdm=False, chat_template=THINKING_TEMPLATE, **options)
    assert results(got) == results(expected)


@pytest.mark.parametrize("options, message", [
    (dict(continue_final_message=True), r"^Cannot set both continue_final_message and "
                                        r"add_generation_prompt"),
    (dict(chat_template_kwargs={"continue_final_message": True}), r"^Cannot set both"),
    (dict(chat_template_kwargs={"tokenize": True}), r"may not set 'tokenize'"),
    (dict(chat_template_kwargs={"return_dict": True}), r"may not set 'return_dict'"),
    (dict(chat_template_kwargs=["enable_thinking"]), r"^chat_template_kwargs=\['enable_thin"),
    (dict(add_generation_prompt="yes"), r"^add_generation_prompt='yes' is invalid"),
    (dict(tools={"name": "search"}), r"^tools=\{'name': 'search'\} is invalid"),
    (dict(chat_template=b"{{ x }}"), r"^chat_template=b'\{\{ x \}\}' is invalid"),
    (dict(chat_template="{% for %}"), r"^conversation 0: the chat template failed"),
])
def test_bad_chat_template_option_is_refused_before_any_work(llm, options, message):
    before = llm.stats()["prefill_tokens"]
    with pytest.raises(ValueError, match=message):
        llm.chat([{"role": "user", "content": "hi"}], greedy(2), use_tqdm=False, **options)
    assert llm.is_finished() and llm.stats()["prefill_tokens"] == before


@pytest.mark.gpu
def test_cuda_graphs_match_eager_for_seeded_mixed_batch(tiny_model):
    """Graphs replay only the model forward; the sampler runs after it in both modes.

    8 rows that all run 32 steps keep every decode batch at a captured size, so eager and
    graph replay run the same GEMM and attention shapes and produce the same logits.
    """
    rng = random.Random(3)
    batch = [rand_prompt(rng, 5 + 4 * i) for i in range(8)]
    kw = dict(max_tokens=32, ignore_eos=True)
    params = [SamplingParams(seed=1, **kw), SamplingParams(seed=2, temperature=0.8, top_k=20, **kw),
              SamplingParams(seed=3, top_p=0.9, **kw), SamplingParams(seed=4, min_p=0.1, **kw),
              SamplingParams(temperature=0, **kw), SamplingParams(top_k=40, **kw),  # unseeded
              SamplingParams(seed=5, temperature=1.5, top_k=50, top_p=0.8, min_p=0.02, **kw),
              SamplingParams(seed=6, temperature=0.5, **kw)]
    outs = {}
    for eager in (True, False):
        llm = LLM(tiny_model, enforce_eager=eager, max_model_len=256, max_num_seqs=8,
                  dtype="bfloat16")
        try:
            assert bool(llm.model_runner.graphs) != eager
            # unseeded rows draw from the engine's generator (seed 0): the same in both
            outs[eager] = ids(llm.generate(batch, params, use_tqdm=False))
        finally:
            llm.shutdown()
    assert outs[True] == outs[False]


def test_a_queued_request_keeps_the_params_it_was_added_with(llm, prompts):
    """add_request copies its SamplingParams (as vLLM does): the caller's object, changed and
    reused for the next request, leaves the queued one as it was."""
    expected = {seed: llm.generate(prompts[0], SamplingParams(
        temperature=1.0, max_tokens=8, seed=seed, ignore_eos=True), use_tqdm=False)[0]
        for seed in (0, 1)}
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=0, ignore_eos=True)
    first = llm.add_request(prompts[0], params)
    params.seed, params.max_tokens, params.stop = 1, 3, 123  # 123: never validated
    outputs = {}
    while not llm.is_finished():
        outputs.update((out["request_id"], out) for out in llm.step()[0])
    assert outputs[first]["token_ids"] == expected[0]["token_ids"]


def test_a_stop_tokens_own_text_is_not_searched_for_stop_strings(llm):
    """The token that stops a completion (here one of stop_token_ids) is not in `text`, and its
    text is not searched for stop strings either (vLLM): a stop string that only appears with
    it leaves the text whole."""
    tokenizer, rng = llm.tokenizer, random.Random(0)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for _ in range(20):
        prompt = [rng.randrange(3, 300) for _ in range(8)]
        ids = llm.generate([prompt], greedy, use_tqdm=False)[0]["token_ids"]
        # a token new to the text, and a stop string that straddles it
        found = next(((k, before[-1] + text[0], before) for k in range(1, len(ids))
                      for before, text in [(tokenizer.decode(ids[:k]), tokenizer.decode(ids[k]))]
                      if ids[k] not in ids[:k] and before and text and text.isprintable()
                      and before[-1].isprintable() and before[-1] + text[0] not in before),
                     None)
        if found:
            break
    k, stop, before = found
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                stop_token_ids=[ids[k]], stop=stop),
                       use_tqdm=False)[0]
    assert out["token_ids"] == ids[:k + 1] and out["text"] == before

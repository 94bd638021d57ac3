"""The incremental detokenizer: pieces that concatenate to the final text, never a split
character, stop strings held back, and work per update that does not grow with the text."""
import random
from types import SimpleNamespace

import pytest

from benchmarks.random_checkpoints import corpus
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.stop_strings import StopStringChecker
from nanovllm.utils.tokenizer import load_tokenizer


def test_detokenizer_never_splits_a_character(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    text = "héllo 日本語 wörld ✓"
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(token_ids) > len(text.split())  # the rare characters span byte tokens
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.update(token_ids[:i]) for i in range(1, len(token_ids) + 1)]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == tokenizer.decode(token_ids) == text


def test_detokenizer_holds_back_a_possible_stop_string(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    token_ids = tokenizer.encode("the cache block", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, stop=("blox",))
    sent = "".join(detokenizer.update(token_ids[:i]) for i in range(1, len(token_ids) + 1))
    assert sent == "the cache bl"  # len("blox") - 1 characters held back: "ock"
    assert sent + detokenizer.finish("the cache block") == "the cache block"


def metaspace_tokenizer():
    """A SentencePiece-style BPE (spaces as U+2581, the first one dropped when decoding), the
    kind whose decoding of a token depends on what comes before it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(corpus(500), trainers.BpeTrainer(vocab_size=170,
                                                             special_tokens=["<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(params=["byte-level", "metaspace"])
def tokenizer(request, tiny_model):
    return load_tokenizer(tiny_model) if request.param == "byte-level" else metaspace_tokenizer()


def stream(tokenizer, token_ids: list[int], step: int, skip: bool = True) -> list[str]:
    """The pieces of a completion growing `step` tokens at a time, then the finish."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    pieces = [detokenizer.update(token_ids[:i]) for i in range(step, len(token_ids) + 1, step)]
    return pieces + [detokenizer.finish(tokenizer.decode(token_ids, skip_special_tokens=skip))]


@pytest.mark.parametrize(("step", "skip"), [(1, True), (3, True), (1, False)])
def test_pieces_concatenate_to_the_whole_decode(tokenizer, step, skip):
    """Random token streams (byte tokens included) and real text: every piece sent is final,
    and the pieces with the finish are the whole completion's decode."""
    rng = random.Random(step)
    # ids past the vocabulary too (a model's padded embedding rows): they decode to ""
    streams = [[rng.randrange(len(tokenizer) + 20) for _ in range(rng.randint(1, 200))]
               for _ in range(30)]
    streams += [tokenizer.encode(line, add_special_tokens=False) for line in corpus(5)]
    for token_ids in streams:
        pieces = stream(tokenizer, token_ids, step, skip)
        whole = tokenizer.decode(token_ids, skip_special_tokens=skip)
        assert "".join(pieces) == whole
        # nothing sent ends in a character still incomplete
        assert not any(piece.endswith("\ufffd") for piece in pieces[:-1])


class CountingTokenizer:
    """A tokenizer that counts the tokens it decodes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, token_ids: list[int], **kwargs) -> str:
        self.decoded += len(token_ids)
        return self.tokenizer.decode(token_ids, **kwargs)


def test_work_per_update_does_not_grow_with_the_text(tiny_model):
    """A 2,000-token stream read a token at a time decodes a few tokens per update, not the
    whole completion (which would be 2 million)."""
    tokenizer = CountingTokenizer(load_tokenizer(tiny_model))
    token_ids = tokenizer.tokenizer.encode(" ".join(corpus(300)), add_special_tokens=False)
    token_ids = token_ids[:2000]
    assert len(token_ids) == 2000
    assert "".join(stream(tokenizer, token_ids, 1)[:-1]) == tokenizer.tokenizer.decode(
        token_ids, skip_special_tokens=True)
    assert tokenizer.decoded < 10 * len(token_ids) + len(token_ids)  # the finish's check


def test_stop_strings_are_found_where_the_whole_decode_has_them(tokenizer):
    """The engine's checker, fed one token at a time after a prompt, reports the text before
    the first stop string of the whole completion's decode (through it, with
    include_stop_str_in_output), at the first token that shows it; never before, and never one
    the decode does not hold."""
    rng = random.Random(0)
    for case in range(60):
        token_ids = [rng.randrange(len(tokenizer) + 20) for _ in range(rng.randint(1, 120))]
        whole = tokenizer.decode(token_ids, skip_special_tokens=True)
        stops = ["\x00never"]
        if whole.strip() and case % 4:  # a piece of the text, or of other text
            start = rng.randrange(len(whole))
            stops.append(whole[start:start + rng.randint(1, 4)])
        prompt = [rng.randrange(len(tokenizer)) for _ in range(5)]
        seq = SimpleNamespace(seq_id=case, num_prompt_tokens=len(prompt), token_ids=prompt,
                              is_finished=False, finish_reason=None,
                              sampling_params=SimpleNamespace(
                                  stop_strings=stops, min_tokens=0, skip_special_tokens=True,
                                  include_stop_str_in_output=case % 3 == 0))
        checker, found = StopStringChecker(tokenizer), None
        for i in range(1, len(token_ids) + 1):
            seq.token_ids = prompt + token_ids[:i]
            found = checker.check(seq)
            if found is not None:
                break
        hits = [(whole.find(stop), whole.find(stop) + len(stop)) for stop in stops
                if stop in whole]
        if not hits:
            assert found is None
            continue
        start, end = min(hits)
        expected = whole[:end if case % 3 == 0 else start]
        assert found == expected, (token_ids, stops)
        # the first token whose text completes the match
        settled = tokenizer.decode(token_ids[:i - 1], skip_special_tokens=True).rstrip("\ufffd")
        assert not any(stop in settled for stop in stops[1:]), (token_ids, stops)

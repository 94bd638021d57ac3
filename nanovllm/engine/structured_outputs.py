"""Structured outputs: each request's grammar compiled once (xgrammar), a matcher per sequence.

    validate_request -> StructuredOutputs.compile    (cached by kind + spec; errors name the field)
    LLMEngine._queue -> seq.grammar = matcher()      (one GrammarMatcher per completion)
    runner prepare_sample -> the matchers fill the step's token bitmask
                                                     (layers.sampling.token_bitmask)
    Scheduler.commit -> accept_token                 (a terminated grammar finishes with "stop",
                                                     a rejected token with "abort")
"""
import json
import re
from collections import OrderedDict

from nanovllm.sampling_params import StructuredOutputsParams

STRUCTURED_HINT = 'pip install -e ".[structured]"'
MAX_CACHED_GRAMMARS = 256  # distinct (kind, spec) kept compiled; the oldest used is dropped first
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[06:20:01] /project/cpp/x.cc:94: "


def grammar_key(params: StructuredOutputsParams) -> tuple[str, str, bool]:
    """(kind, spec text, any whitespace): equal keys compile to the same grammar."""
    kind, value = params.kind, getattr(params, params.kind)
    if kind == "json" and isinstance(value, dict):
        value = json.dumps(value)  # key order kept: it is the order the properties come out
    elif kind == "choice":
        # An EBNF alternation of string literals; json.dumps escapes quotes and backslashes.
        value = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
    elif kind == "json_object":
        value = '{"type": "object"}'
    return kind, value, not params.disable_any_whitespace


class StructuredOutputs:
    """The engine's grammar compiler and its cache: structured-output params -> a compiled
    grammar, and a fresh GrammarMatcher per sequence."""

    def __init__(self, tokenizer: object, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        # The logits' width, which may exceed the tokenizer's vocabulary: ids past it are masked.
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids  # a grammar ends on any of them
        self.compiler = None  # built on first use: xgrammar is optional
        self.cache: OrderedDict[tuple[str, str, bool], object] = OrderedDict()

    def compile(self, params: StructuredOutputsParams) -> object:
        """The compiled grammar of `params` (an xgrammar CompiledGrammar), from the cache when
        there; ValueError naming the field when it does not compile or xgrammar is missing."""
        key = grammar_key(params)
        compiled = self.cache.get(key)
        if compiled is None:
            compiled = self._compile(*key)
            self.cache[key] = compiled
            if len(self.cache) > MAX_CACHED_GRAMMARS:
                self.cache.popitem(last=False)
        self.cache.move_to_end(key)
        return compiled

    def matcher(self, params: StructuredOutputsParams) -> object:
        """A new xgrammar GrammarMatcher at the start of `params`' grammar."""
        import xgrammar
        return xgrammar.GrammarMatcher(self.compile(params))

    def _compile(self, kind: str, spec: str, any_whitespace: bool) -> object:
        compiler = self._compiler(kind)
        try:
            if kind in ("json", "json_object"):
                return compiler.compile_json_schema(spec, any_whitespace=any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(spec)
            return compiler.compile_grammar(spec)  # grammar, choice
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse errors
            message = _LOG_PREFIX.sub("", str(e).strip().splitlines()[0])
            raise ValueError(f"structured_outputs.{kind} does not compile: {message}") from None

    def _compiler(self, kind: str) -> object:
        """xgrammar's GrammarCompiler for this tokenizer, built once."""
        if self.compiler is None:
            try:
                import xgrammar
            except ImportError:
                raise ValueError(f"structured_outputs.{kind} needs xgrammar, which is not "
                                 f"installed: {STRUCTURED_HINT}") from None
            stop = list(self.eos_token_ids) or None
            info = xgrammar.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop)
            # Its own cache off: ours (above) is the one cache, bounded.
            self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        return self.compiler


def accept_token(matcher: object, token_id: int) -> bool | None:
    """Advance a sequence's matcher by its committed token: True once the grammar terminated,
    None if the grammar rejects the token. The bitmask allows only tokens it accepts, so that
    happens only when the request's other constraints left none of them (allowed_token_ids
    outside the grammar's)."""
    if not matcher.accept_token(token_id):
        return None
    return matcher.is_terminated()

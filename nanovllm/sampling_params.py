"""Per-request sampling parameters."""
import copy
from dataclasses import dataclass, field

from nanovllm.utils.field_checks import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    INT32_MAX,
    INT64_MAX,
    check,
    check_int,
    check_real,
    is_int,
    is_real,
)

MAX_SEED = INT64_MAX  # seeds travel to the device as int64
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: [-100, 100]
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's names): set exactly one of json, regex, choice,
    grammar, json_object. The engine compiles it (xgrammar) before the request is queued."""

    json: dict | str | None = None  # a JSON schema, as a dict or its JSON text
    regex: str | None = None  # the whole output matches it
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF in xgrammar's dialect, starting from the rule `root`
    json_object: bool | None = None  # True: any JSON object
    # vLLM's name, our default: JSON (json, json_object) has no free whitespace, only one space
    # after "," and ":", so a model cannot emit whitespace forever; False allows any amount.
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Exactly one kind, of the right type; the engine checks that it compiles."""
        kinds = [name for name in STRUCTURED_KINDS if getattr(self, name) is not None]
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {STRUCTURED_KINDS}, "
                             f"got {'none' if not kinds else ' and '.join(kinds)}")
        value = getattr(self, kinds[0])
        name = f"structured_outputs.{kinds[0]}"
        if kinds[0] == "json":
            check(name, value, isinstance(value, dict) or (isinstance(value, str) and value),
                  "a JSON schema: a dict or a non-empty JSON string")
        elif kinds[0] == "choice":
            check(name, value, isinstance(value, list | tuple) and value and all(
                isinstance(c, str) and c for c in value), "a non-empty list of non-empty strings")
            self.choice = list(value)
        elif kinds[0] == "json_object":
            check(name, value, value is True, "None or True")
        else:
            check(name, value, isinstance(value, str) and value, "a non-empty string")
        check("structured_outputs.disable_any_whitespace", self.disable_any_whitespace,
              isinstance(self.disable_any_whitespace, bool), "a bool")

    @property
    def kind(self) -> str:
        """The one constraint set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(name for name in STRUCTURED_KINDS if getattr(self, name) is not None)


@dataclass
class SamplingParams:
    """How to sample one request; temperature 0 means greedy (the filters and seed are ignored).

    Order on the device (vLLM V1's): a structured output's token bitmask, then
    allowed_token_ids, bad_words, min_tokens, logit_bias (layers.sampling.steering), then the
    penalties (repetition, then frequency and presence), then logits / temperature, then min_p,
    then top_k, then top_p (on the distribution renormalised after top_k), then a draw. `stop`
    strings are cut from "text"; `stop_token_ids` stay in "token_ids", like EOS, and (as EOS) not
    in "text".
    """

    temperature: float = 1.0
    max_tokens: int | None = 64  # None: up to max_model_len (vLLM's)
    ignore_eos: bool = False
    top_k: int = -1  # keep the k most likely tokens; 0 or -1 = off (vLLM)
    top_p: float = 1.0  # keep the smallest set with cumulative probability >= top_p; 1 = off
    min_p: float = 0.0  # drop tokens with p < min_p * p_max; 0 = off
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None  # same seed, same prompt -> same tokens, whatever the batch
    n: int = 1  # completions of the prompt; with a seed, completion i draws from (seed, i)
    logprobs: int | None = None  # per generated token: the sampled token's and the top k's
    prompt_logprobs: int | None = None  # per prompt token: its own and the top k's (raw)
    repetition_penalty: float = 1.0  # transformers': seen (prompt + generated) l>0: l/r, else l*r
    presence_penalty: float = 0.0  # OpenAI's: l -= presence if generated at least once
    frequency_penalty: float = 0.0  # OpenAI's: l -= frequency * times generated
    skip_special_tokens: bool = True  # "text" leaves out special tokens (EOS...), as vLLM
    include_stop_str_in_output: bool = False  # "text" ends with the stop string that matched
    detokenize: bool = True  # False: "text" is "" (token_ids only, no decode), as vLLM
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k (-1: max_model_len)
    # the output follows a JSON schema, regex, choice or grammar (see StructuredOutputsParams)
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, within +-100
    allowed_token_ids: list[int] | None = None  # only these ids can be sampled
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings do not stop a shorter completion
    bad_words: list[str] | None = None  # words never generated (vLLM's token-sequence match)
    # Set by request validation (engine.request_checks), which has the tokenizer and EOS:
    # each bad word's token ids, and the ids min_tokens holds back (stop_token_ids and EOS).
    _bad_words_token_ids: list[list[int]] | None = field(
        default=None, init=False, repr=False, compare=False)
    _min_tokens_stop_ids: list[int] = field(
        default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's name): changing its lists or structured_outputs leaves this one
        as it is."""
        return copy.deepcopy(self)

    def validate(self) -> None:
        """Check every field against what the sampler's tensors hold, raising ValueError naming
        it; numpy scalars become Python ones, and clamps keep the meaning (top_k beyond any
        vocabulary = off; a tiny top_p = float32's smallest, which keeps only the top token)."""
        self.temperature = check_real("temperature", self.temperature, 0.0, FLOAT32_MAX,
                                      f"a number in [0, {FLOAT32_MAX:.4g}] (0 = greedy)")
        self._validate_output()
        top_k = check_int("top_k", self.top_k, -1, None, "0 or -1 (off) or an int >= 1")
        self.top_k = -1 if top_k > INT32_MAX or top_k == 0 else top_k  # 0: off, as vLLM
        top_p = check_real("top_p", self.top_p, 0.0, 1.0, "a number in (0, 1] (1 = off)",
                           low_open=True)
        self.top_p = max(top_p, FLOAT32_TINY)
        self.min_p = check_real("min_p", self.min_p, 0.0, 1.0, "a number in [0, 1] (0 = off)")
        if self.seed is not None:
            self.seed = check_int("seed", self.seed, 0, MAX_SEED,
                                  f"None or an int in [0, {MAX_SEED}]")
        self.n = check_int("n", self.n, 1, None, "an int >= 1")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, check_int(name, getattr(self, name), 0, None,
                                              "None or an int >= 0"))
        self.repetition_penalty = check_real(
            "repetition_penalty", self.repetition_penalty, 0.0, FLOAT32_MAX,
            f"a number in (0, {FLOAT32_MAX:.4g}] (1 = off)", low_open=True)
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, check_real(name, getattr(self, name), -2.0, 2.0,
                                           "a number in [-2, 2] (0 = off)"))
        structured = self.structured_outputs
        check("structured_outputs", structured,
              structured is None or isinstance(structured, StructuredOutputsParams),
              "None or a StructuredOutputsParams")
        if structured is not None:
            structured.validate()
        self._validate_steering()

    def _validate_output(self) -> None:
        """What ends a completion and what it returns: max_tokens, stop strings and ids, the
        text's flags, the prompt's truncation (its upper bound: request validation)."""
        if self.max_tokens is not None:
            self.max_tokens = check_int("max_tokens", self.max_tokens, 1, None,
                                        "None or an int >= 1")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                     "detokenize"):
            check(name, getattr(self, name), isinstance(getattr(self, name), bool), "a bool")
        keep = self.truncate_prompt_tokens
        check("truncate_prompt_tokens", keep, keep is None or (is_int(keep) and (
            keep == -1 or keep >= 1)), "None, -1 (max_model_len) or an int >= 1")
        if keep is not None:
            self.truncate_prompt_tokens = int(keep)
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        check("stop", self.stop, stop is None or (isinstance(stop, list | tuple) and all(
            isinstance(s, str) and s for s in stop)),
            "None, a non-empty string or a list of non-empty strings")
        check("stop", self.stop, not stop or self.detokenize,
              "None with detokenize=False (stop strings are found in the decoded text)")
        ids = self.stop_token_ids
        check("stop_token_ids", ids, ids is None or (isinstance(ids, list | tuple) and all(
            is_int(i) and 0 <= i <= INT64_MAX for i in ids)),
            f"None or a list of ints in [0, {INT64_MAX}]")
        if ids is not None:
            self.stop_token_ids = [int(i) for i in ids]

    def _validate_steering(self) -> None:
        """logit_bias (values clipped to +-100, as OpenAI), allowed_token_ids, min_tokens,
        bad_words; the vocabulary is checked with the request (engine.request_checks)."""
        bias = self.logit_bias
        check("logit_bias", bias, bias is None or (isinstance(bias, dict) and all(
            is_int(t) and t >= 0 and is_real(v) and v == v  # v == v: not NaN
            for t, v in bias.items())), "None or a dict of int token ids to numbers")
        if bias is not None:
            self.logit_bias = {int(t): float(min(max(v, -MAX_LOGIT_BIAS), MAX_LOGIT_BIAS))
                               for t, v in bias.items()}
        ids = self.allowed_token_ids
        check("allowed_token_ids", ids, ids is None or (isinstance(ids, list | tuple) and ids
                                                       and all(is_int(i) and i >= 0 for i in ids)),
              "None or a non-empty list of int token ids")
        if ids is not None:
            self.allowed_token_ids = [int(i) for i in ids]
        self.min_tokens = check_int("min_tokens", self.min_tokens, 0, self.max_tokens,
                                    "an int >= 0" if self.max_tokens is None else
                                    f"an int in [0, max_tokens={self.max_tokens}]")
        words = self.bad_words
        check("bad_words", words, words is None or (isinstance(words, list | tuple) and all(
            isinstance(w, str) and w.strip() for w in words)),
            "None or a list of strings, each with a non-space character")
        if words is not None:
            self.bad_words = list(words)
        self._steers = bool(self.logit_bias or ids is not None or self.min_tokens or words)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple, empty when None."""
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def needs_host_tokens(self) -> bool:
        """True when the next step's sampling state reads this step's token on the host (a
        grammar's mask, bad_words' banned ids): the engine samples the next step after this one
        is committed."""
        return self.structured_outputs is not None or bool(self._bad_words_token_ids)

    @property
    def uses_penalties(self) -> bool:
        """True when a penalty needs the sequence's token counts."""
        return (self.repetition_penalty != 1 or self.presence_penalty != 0
                or self.frequency_penalty != 0)

    @property
    def steers(self) -> bool:
        """True when logit_bias, allowed_token_ids, min_tokens or bad_words is set."""
        return self._steers

    @property
    def simple(self) -> bool:
        """True when temperature alone decides the draw: the sampler's fast path applies."""
        return not self._steers and (self.temperature == 0 or (
            self.top_k == -1 and self.top_p == 1 and self.min_p == 0 and self.seed is None))

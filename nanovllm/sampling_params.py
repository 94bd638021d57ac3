"""Per-request sampling parameters."""
from dataclasses import dataclass

from nanovllm.utils.field_checks import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    INT32_MAX,
    INT64_MAX,
    check,
    check_int,
    check_real,
    is_int,
)

MAX_SEED = INT64_MAX  # seeds travel to the device as int64
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

    Order on the device: a structured output's token bitmask, the penalties (repetition, then
    frequency and presence), then logits / temperature, then min_p, then top_k, then top_p (on
    the distribution renormalised after top_k), then a draw. `stop` strings are cut from "text";
    `stop_token_ids` stay in "token_ids", like EOS, and (as EOS) not in "text".
    """

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    top_k: int = -1  # keep the k most likely tokens; -1 = off
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
    # the output follows a JSON schema, regex, choice or grammar (see StructuredOutputsParams)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field against what the sampler's tensors hold, raising ValueError naming
        it; numpy scalars become Python ones, and clamps keep the meaning (top_k beyond any
        vocabulary = off; a tiny top_p = float32's smallest, which keeps only the top token)."""
        self.temperature = check_real("temperature", self.temperature, 0.0, FLOAT32_MAX,
                                      f"a number in [0, {FLOAT32_MAX:.4g}] (0 = greedy)")
        self.max_tokens = check_int("max_tokens", self.max_tokens, 1, None, "an int >= 1")
        for name in ("ignore_eos", "skip_special_tokens"):
            check(name, getattr(self, name), isinstance(getattr(self, name), bool), "a bool")
        top_k = check_int("top_k", self.top_k, -1, None, "-1 (off) or an int >= 1")
        check("top_k", top_k, top_k != 0, "-1 (off) or an int >= 1")
        self.top_k = -1 if top_k > INT32_MAX else top_k
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
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        check("stop", self.stop, stop is None or (isinstance(stop, list | tuple) and all(
            isinstance(s, str) and s for s in stop)),
            "None, a non-empty string or a list of non-empty strings")
        ids = self.stop_token_ids
        check("stop_token_ids", ids, ids is None or (isinstance(ids, list | tuple) and all(
            is_int(i) and 0 <= i <= INT64_MAX for i in ids)),
            f"None or a list of ints in [0, {INT64_MAX}]")
        if ids is not None:
            self.stop_token_ids = [int(i) for i in ids]
        structured = self.structured_outputs
        check("structured_outputs", structured,
              structured is None or isinstance(structured, StructuredOutputsParams),
              "None or a StructuredOutputsParams")
        if structured is not None:
            structured.validate()

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple, empty when None."""
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def uses_penalties(self) -> bool:
        """True when a penalty needs the sequence's token counts."""
        return (self.repetition_penalty != 1 or self.presence_penalty != 0
                or self.frequency_penalty != 0)

    @property
    def simple(self) -> bool:
        """True when temperature alone decides the draw: the sampler's fast path applies."""
        return self.temperature == 0 or (self.top_k == -1 and self.top_p == 1 and self.min_p == 0
                                         and self.seed is None)

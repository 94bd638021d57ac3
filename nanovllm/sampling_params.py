"""Per-request sampling parameters."""
from dataclasses import dataclass
from numbers import Integral, Real

MAX_SEED = 2**63 - 1  # seeds travel to the device as int64


@dataclass
class SamplingParams:
    """How to sample one request; temperature 0 means greedy (the filters and seed are ignored).

    Order on the device: the penalties (repetition, then frequency and presence), then
    logits / temperature, then min_p, then top_k, then top_p (on the
    distribution renormalised after top_k), then a draw. `stop` strings are cut from "text";
    `stop_token_ids` stay in "token_ids", like EOS.
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

    def __post_init__(self) -> None:
        def check(name: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: expected {allowed}")

        def is_int(x: object) -> bool:  # numpy ints too; bools are not counts
            return isinstance(x, Integral) and not isinstance(x, bool)

        def is_real(x: object) -> bool:
            return isinstance(x, Real) and not isinstance(x, bool)

        check("temperature", is_real(self.temperature) and self.temperature >= 0,
              "a float >= 0 (0 = greedy)")
        check("max_tokens", is_int(self.max_tokens) and self.max_tokens >= 1, "an int >= 1")
        check("ignore_eos", isinstance(self.ignore_eos, bool), "a bool")
        check("top_k", is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
              "-1 (off) or an int >= 1")
        check("top_p", is_real(self.top_p) and 0 < self.top_p <= 1,
              "a float in (0, 1] (1 = off)")
        check("min_p", is_real(self.min_p) and 0 <= self.min_p <= 1,
              "a float in [0, 1] (0 = off)")
        check("seed", self.seed is None or (is_int(self.seed) and 0 <= self.seed <= MAX_SEED),
              f"None or an int in [0, {MAX_SEED}]")
        check("n", is_int(self.n) and self.n >= 1, "an int >= 1")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(name, value is None or (is_int(value) and value >= 0), "None or an int >= 0")
        check("repetition_penalty", is_real(self.repetition_penalty)
              and 0 < self.repetition_penalty < float("inf"), "a finite float > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            check(name, is_real(getattr(self, name)) and -2 <= getattr(self, name) <= 2,
                  "a float in [-2, 2] (0 = off)")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        check("stop", stop is None or (isinstance(stop, list | tuple)
                                       and all(isinstance(s, str) and s for s in stop)),
              "None, a non-empty string or a list of non-empty strings")
        ids = self.stop_token_ids
        check("stop_token_ids", ids is None or (isinstance(ids, list | tuple)
                                                and all(is_int(i) and i >= 0 for i in ids)),
              "None or a list of ints >= 0")

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

"""Per-request sampling parameters."""
from dataclasses import dataclass


@dataclass
class SamplingParams:
    """How to sample one request; temperature 0 means greedy."""

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an int >= 1")

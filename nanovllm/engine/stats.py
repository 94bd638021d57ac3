"""Per-step engine counters behind LLM.stats(): a few adds per step, nothing per sequence."""
from dataclasses import dataclass, field
from time import perf_counter

# One timeline entry: (start s since reset, duration s, is_prefill, batch size, tokens computed).
TimelineEntry = tuple[float, float, bool, int, int]


@dataclass
class StepCounters:
    """Totals of the steps since the last reset; the optional timeline grows a tuple a step."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    peak_kv_blocks_in_use: int = 0
    timeline: list[TimelineEntry] | None = None
    start: float = field(default_factory=perf_counter)

    def record(self, is_prefill: bool, num_seqs: int, num_tokens: int, t0: float, t1: float,
               kv_blocks_in_use: int) -> None:
        """Account one step that ran from perf_counter() t0 to t1."""
        if is_prefill:
            self.prefill_tokens += num_tokens
            self.prefill_steps += 1
            self.prefill_s += t1 - t0
        else:
            self.decode_tokens += num_tokens
            self.decode_steps += 1
            self.decode_s += t1 - t0
        # Blocks are reserved by schedule() and freed by finishing sequences (advance/commit),
        # so the caller samples the pool right after schedule(), when this step's use is highest.
        if kv_blocks_in_use > self.peak_kv_blocks_in_use:
            self.peak_kv_blocks_in_use = kv_blocks_in_use
        if self.timeline is not None:
            self.timeline.append((t0 - self.start, t1 - t0, is_prefill, num_seqs, num_tokens))

    def as_dict(self) -> dict:
        """The counters plus derived throughputs (0.0 before any step of that kind)."""
        counters = {k: v for k, v in vars(self).items() if k not in ("timeline", "start")}
        return dict(counters,
                    prefill_tok_s=self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0,
                    decode_tok_s=self.decode_tokens / self.decode_s if self.decode_s else 0.0)

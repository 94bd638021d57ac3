"""Token sampling without host syncs (the sampled ids' .tolist() is the only one).

Fast path, when no row uses top-k/top-p/min-p/seed: the exponential race argmax(l / T - log E),
E ~ Exp(1); on CUDA (FastPath.fused_sampler) one Triton kernel (kernels.sample) with Philox
noise keyed by a per-step seed from a CPU generator (Config.seed; None: torch's RNG). Full
path: l / T, then min_p, top_k and top_p as -inf masks, then the same draw with E = -log U, U
a counter-based hash of (seed, position, vocab index): a seeded row draws the same noise
whatever its batch. Greedy rows (T = 0) take argmax(l).
A structured output's token bitmask (layers.sampling.token_bitmask) sets disallowed tokens to
-inf first; then steering (layers.sampling.steering: allowed_token_ids, bad_words, min_tokens,
logit_bias), then the penalties (layers.sampling.penalties), in vLLM V1's order; they and
logprobs run only for a batch that asks for them, and a steered row takes the full path.
"""
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.layers.sampling.penalties import Penalties
from nanovllm.layers.sampling.steering import Steering
from nanovllm.layers.sampling.token_bitmask import apply_token_bitmask
from nanovllm.sampling_params import MAX_SEED, SamplingParams
from nanovllm.utils.compile import compile_on_cuda
from nanovllm.utils.field_checks import FLOAT32_MAX

# splitmix64 constants, written as the signed int64 values with the same bits
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: it copies the sign bit)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser; int64 products wrap around, as the hash wants."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def derive_seed(seed: int, index: int) -> int:
    """Seed of completion `index` of a request seeded `seed`: the seed for 0, else splitmix64."""
    if index == 0:
        return seed
    mask = (1 << 64) - 1
    x = (seed ^ ((index * 0x9E3779B97F4A7C15) & mask)) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return (x ^ (x >> 31)) & MAX_SEED


@functools.cache
def stream_steps(vocab_size: int, device: torch.device) -> torch.Tensor:
    """[V] int64: (v + 1) * golden, splitmix64's state increments for vocab index v."""
    # Made eagerly and passed in: Inductor would fold arange * constant into an int32 index.
    return torch.arange(1, vocab_size + 1, device=device) * _GOLDEN


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor,
                   steps: torch.Tensor) -> torch.Tensor:
    """U(0, 1) noise [B, V] that depends only on (seed, position, vocab index) of each cell."""
    row = _mix64(_mix64(seeds) ^ positions)  # [B]: one splitmix64 stream per (seed, position)
    bits = _mix64(row[:, None] + steps)  # [B, V]: the stream's first V outputs
    # 23 bits: (k + 0.5) / 2**23 is exact in float32 and never 0 or 1, so log(-log U) is finite
    return (_shr(bits, 41).float() + 0.5) * 2.0**-23


@dataclass
class SamplingTensors:
    """Per-row inputs of the full path, [B] each, plus host flags that skip unused passes."""

    temperatures: torch.Tensor  # float32; 0 = greedy
    top_ps: torch.Tensor  # float32; >= 1 = off
    min_ps: torch.Tensor  # float32; 0 = off
    top_ks: torch.Tensor  # int64; <= 0 = off
    seeds: torch.Tensor  # int64 in [0, 2**63)
    positions: torch.Tensor  # int64: index of the token being drawn in its sequence
    use_min_p: bool
    use_top_k_top_p: bool
    steering: Steering | None = None  # None when no row steers

    @staticmethod
    def build(params: list[SamplingParams], positions: list[int],
              to_device: Callable[[list, torch.dtype], torch.Tensor],
              steering: Steering | None = None,
              generator: torch.Generator | None = None) -> "SamplingTensors":
        """Pack rows into one float and one int64 tensor; `to_device(rows, dtype)` copies."""
        sampled = [p for p in params if p.temperature > 0]
        # unseeded rows draw their seeds from the engine's CPU generator (Config.seed), or
        # without one from torch's RNG, which torch.manual_seed governs
        fresh = torch.randint(MAX_SEED, (len(params),), generator=generator).tolist()
        floats = to_device([[p.temperature for p in params], [p.top_p for p in params],
                            [p.min_p for p in params]], torch.float32)
        ints = to_device([[p.top_k for p in params],
                          [r if p.seed is None else p.seed for p, r in zip(params, fresh)],
                          positions], torch.int64)
        return SamplingTensors(
            *floats, *ints, use_min_p=any(p.min_p > 0 for p in sampled),
            use_top_k_top_p=any(p.top_k > 0 or p.top_p < 1 for p in sampled), steering=steering)


@dataclass
class LogprobsTensors:
    """[B, 1 + k]: each row's own token (sampled, or the prompt's next), then the top k."""

    token_ids: torch.Tensor  # int64
    logprobs: torch.Tensor  # float32

    def to_dicts(self, ks: list[int]) -> list[dict[int, float]]:
        """Per row r: {token_id: logprob} of its top ks[r], then its own token (host copy)."""
        ids, values = self.token_ids.tolist(), self.logprobs.tolist()
        rows = []
        for row_ids, row_values, k in zip(ids, values, ks):
            row = dict(zip(row_ids[1:k + 1], row_values[1:k + 1]))
            row.setdefault(row_ids[0], row_values[0])
            rows.append(row)
        return rows


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """log_softmax(logits) [N, V] at token_ids [N] and at each row's top k (all V if k > V)."""
    logits = logits.float()
    lse = logits.logsumexp(dim=-1, keepdim=True)
    _, top_ids = logits.topk(min(k, logits.size(1)), dim=-1)
    ids = torch.cat([token_ids.unsqueeze(1), top_ids], dim=1)
    return LogprobsTensors(ids, logits.gather(1, ids) - lse)


@dataclass
class SamplerOutput:
    """A step's sampled ids [B] and, when asked, their logprobs."""

    token_ids: torch.Tensor
    logprobs: LogprobsTensors | None = None


LOGPROBS_MODES = ("raw", "processed")


class SamplerRNG:
    """The sampler's generators: the draws' seeds (cpu) and the unfused race's noise (device,
    the logits'). None, torch's global RNG, until seed() is given an int."""

    def __init__(self) -> None:
        self.cpu: torch.Generator | None = None
        self.device: torch.Generator | None = None

    def seed(self, seed: int | None, device: torch.device) -> None:
        """Draw from generators seeded `seed` from now on (None: torch's global RNG)."""
        if seed is None:
            self.cpu = self.device = None
            return
        self.cpu = torch.Generator().manual_seed(seed)
        self.device = (self.cpu if device.type == "cpu"
                       else torch.Generator(device=device).manual_seed(seed))


class Sampler(nn.Module):
    """logits [B, V] + temperatures [B] (fast path) or SamplingTensors -> token ids [B].
    logprobs_mode "raw": log_softmax of the model's logits (as vLLM's raw_logprobs: before
    the bitmask and steering); "processed": of the distribution sampled from (after them, the
    penalties, temperature and filters; greedy rows: after them and the penalties)."""

    def __init__(self, logprobs_mode: str = "raw", fused: bool = False,
                 rng: SamplerRNG | None = None):
        super().__init__()
        self.fused = fused  # the fast path's draw as one Triton kernel (FastPath.fused_sampler)
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={logprobs_mode!r} is invalid: expected one of "
                             f"{LOGPROBS_MODES}")
        self.logprobs_mode = logprobs_mode
        self.rng = SamplerRNG() if rng is None else rng

    def forward(self, logits: torch.Tensor, params: torch.Tensor | SamplingTensors,
                penalties: Penalties | None = None,
                num_logprobs: int | None = None,
                token_bitmask: torch.Tensor | None = None) -> SamplerOutput:
        raw = logits
        if token_bitmask is not None:  # structured outputs: only tokens the grammar allows
            logits = apply_token_bitmask(logits, token_bitmask)
        if isinstance(params, SamplingTensors) and params.steering is not None:
            logits = params.steering.apply(logits)  # a float32 copy: `raw` stays the model's
        if penalties is not None:
            counts = penalties.counts
            logits = self.apply_penalties(logits, counts.output_counts, counts.prompt_mask,
                                          penalties.rows, penalties.repetition,
                                          penalties.presence, penalties.frequency)
        if isinstance(params, torch.Tensor):
            temperatures, scaled = params, None
            token_ids = self.race(logits, params)
        else:
            temperatures, scaled = params.temperatures, self.filter(logits, params)
            steps = stream_steps(logits.size(1), logits.device)
            token_ids = self.gumbel_max(logits, scaled, temperatures, params.seeds,
                                        params.positions, steps)
        if penalties is not None:
            penalties.counts.record(penalties.rows, token_ids)
        if num_logprobs is None:
            return SamplerOutput(token_ids)
        if self.logprobs_mode == "raw":
            source = raw
        else:
            if scaled is None:
                scaled = logits.float() / temperatures.clamp(min=1e-5).unsqueeze(1)
            source = torch.where((temperatures == 0).unsqueeze(1), logits.float(), scaled)
        return SamplerOutput(token_ids, compute_logprobs(source, token_ids, num_logprobs))

    def filter(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        """l / T, then the min_p, top_k and top_p masks (-inf): the full path's distribution."""
        scaled = logits.float() / params.temperatures.clamp(min=1e-5).unsqueeze(1)
        if params.use_min_p:
            scaled = self.mask_min_p(scaled, params.min_ps)
        if params.use_top_k_top_p:
            scaled = self.mask_top_k_top_p(scaled, params.top_ks, params.top_ps)
        return scaled

    @compile_on_cuda
    def apply_penalties(self, logits: torch.Tensor, output_counts: torch.Tensor,
                        prompt_mask: torch.Tensor, rows: torch.Tensor, repetition: torch.Tensor,
                        presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
        """Repetition (transformers'), then frequency and presence (OpenAI's)."""
        logits = logits.float()
        counts = output_counts[rows]  # [B, V]
        generated = counts > 0
        seen = prompt_mask[rows] | generated
        r = repetition.unsqueeze(1)
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
        logits = (logits - frequency.unsqueeze(1) * counts
                  - presence.unsqueeze(1) * generated.float())
        # A tiny repetition_penalty overflows float32: +inf logits make the softmax NaN (-inf,
        # as a masked token's, is fine).
        return logits.clamp(max=FLOAT32_MAX)

    def race(self, logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        """The fast path: exponential race (fused kernel on CUDA), argmax for greedy rows."""
        if self.fused:
            # Imported here: CPU-only runs never import Triton (as for the attention backends).
            from nanovllm.kernels.sample import race_sample
            # The seed comes from a CPU generator: no sync.
            seed = int(torch.randint(2**31 - 1, (1,), generator=self.rng.cpu))
            return race_sample(logits, temperatures, seed)
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        scaled = logits / temperatures.clamp(min=1e-5).unsqueeze(1)
        # argmax(p / E) with E ~ Exp(1) draws from p (the exponential race); taking logs,
        # argmax(l / T - log E): one pass over the logits, no softmax (its sum is a constant).
        noise = torch.empty_like(scaled).exponential_(1, generator=self.rng.device)
        noise = noise.clamp_(min=1e-10)
        sampled = (scaled - noise.log()).argmax(dim=-1)
        return torch.where(temperatures == 0, greedy, sampled)

    @compile_on_cuda
    def mask_min_p(self, logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
        """-inf where p < min_p * p_max, i.e. l - l_max < log(min_p): no softmax needed."""
        gap = logits - logits.amax(dim=-1, keepdim=True)
        return logits.masked_fill(gap < torch.log(min_ps).unsqueeze(1), float("-inf"))

    # Eager: sort dominates, and Inductor (torch 2.11) fails to generate its split cumsum
    # once the batch dimension turns dynamic.
    def mask_top_k_top_p(self, logits: torch.Tensor, top_ks: torch.Tensor,
                         top_ps: torch.Tensor) -> torch.Tensor:
        """-inf outside the top k (ties: the lower index), then outside the smallest set whose
        probability, renormalised over the top k, reaches top_p."""
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(logits.size(1), device=logits.device)
        drop = (rank >= top_ks.unsqueeze(1)) & (top_ks > 0).unsqueeze(1)  # [B, V], sorted order
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens; 0 for the top
        drop |= (before >= top_ps.unsqueeze(1)) & (top_ps < 1).unsqueeze(1)
        drop = torch.empty_like(drop).scatter_(1, order, drop)  # back to vocab order
        return logits.masked_fill(drop, float("-inf"))

    @compile_on_cuda
    def gumbel_max(self, logits: torch.Tensor, scaled: torch.Tensor, temperatures: torch.Tensor,
                   seeds: torch.Tensor, positions: torch.Tensor,
                   steps: torch.Tensor) -> torch.Tensor:
        """argmax(scaled - log E), E = -log U with hashed U; argmax(logits) for greedy rows."""
        u = seeded_uniform(seeds, positions, steps)
        sampled = (scaled - torch.log(-torch.log(u))).argmax(dim=-1)
        return torch.where(temperatures == 0, logits.argmax(dim=-1), sampled)

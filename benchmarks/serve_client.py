"""The serving benchmark's client: Poisson arrivals, streamed requests, latency statistics."""
import asyncio
import json
import random
from dataclasses import dataclass, field
from time import perf_counter

import httpx

from benchmarks.runs import percentile


@dataclass
class RequestTiming:
    """One streamed request, in seconds since it was sent."""

    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks
    ok: bool = False

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 \
            else 0.0


async def send(http: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int,
               temperature: float) -> RequestTiming:
    """Stream one completion and time its chunks; usage gives the exact token count."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    timing, start = RequestTiming(), perf_counter()
    last = None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return timing
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = perf_counter() - start
            if '"usage"' in line:
                timing.output_tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                continue
            if last is None:
                timing.ttft = now
            else:
                timing.itl.append(now - last)
            last = now
    timing.latency = last or 0.0
    timing.ok = timing.output_tokens > 0
    return timing


async def run_rate(url: str, model: str, prompts: list[list[int]], max_tokens: list[int],
                   temperature: float, rate: float, seed: int) -> tuple[list[RequestTiming], float]:
    """Send every request, spaced by exponential gaps at `rate` per second (inf: all at once);
    returns the timings and the wall time from the first send to the last token."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as http:
        tasks = []
        start = perf_counter()
        for prompt, n in zip(prompts, max_tokens):
            tasks.append(asyncio.create_task(send(http, model, prompt, n, temperature)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        timings = await asyncio.gather(*tasks)
        return timings, perf_counter() - start


def summarize(timings: list[RequestTiming], duration: float, slo_ttft: float,
              slo_tpot: float) -> dict:
    """Output tok/s, TTFT/TPOT/ITL p50/p95/p99 in ms, and goodput: requests per second that
    met both SLOs."""
    done = [t for t in timings if t.ok]
    row = dict(completed=len(done), failed=len(timings) - len(done), duration_s=duration,
               output_tok_s=sum(t.output_tokens for t in done) / duration,
               request_s=len(done) / duration)
    series = dict(ttft=[t.ttft for t in done], tpot=[t.tpot for t in done],
                  itl=[gap for t in done for gap in t.itl])
    for name, values in series.items():
        for q in (50, 95, 99):
            row[f"{name}_p{q}_ms"] = 1000 * percentile(values, q)
    good = [t for t in done if t.ttft <= slo_ttft and t.tpot <= slo_tpot]
    row["goodput_req_s"] = len(good) / duration
    return row

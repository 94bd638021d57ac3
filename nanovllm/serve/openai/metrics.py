"""Prometheus metrics of the server, named as vLLM names them (prefix nanovllm:)."""
from collections.abc import AsyncIterator
from contextlib import aclosing
from time import perf_counter

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from nanovllm.serve.async_llm import RequestOutput
from nanovllm.serve.engine_loop import EngineStats

# Seconds; dense where an interactive SLO lives (tens to hundreds of milliseconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class ServerMetrics:
    """Gauges read from the engine at scrape time; counters and histograms fed by requests."""

    def __init__(self, model_name: str):
        self.registry = registry = CollectorRegistry()
        label = {"model_name": model_name}

        def make(kind, name: str, doc: str, **kwargs):
            return kind(name, doc, list(label), registry=registry, **kwargs).labels(**label)

        self.running = make(Gauge, "nanovllm:num_requests_running", "Requests in the batch.")
        self.waiting = make(Gauge, "nanovllm:num_requests_waiting", "Requests queued.")
        self.kv_usage = make(Gauge, "nanovllm:kv_cache_usage_perc",
                             "Fraction of KV cache blocks in use (1 = full).")
        self.prompt_tokens = make(Counter, "nanovllm:prompt_tokens", "Prompt tokens served.")
        self.generation_tokens = make(Counter, "nanovllm:generation_tokens",
                                      "Generated tokens.")
        self.ttft = make(Histogram, "nanovllm:time_to_first_token_seconds",
                         "Seconds from request to first token.", buckets=TTFT_BUCKETS)
        self.tpot = make(Histogram, "nanovllm:time_per_output_token_seconds",
                         "Mean seconds per output token after the first.", buckets=TPOT_BUCKETS)
        self.e2e = make(Histogram, "nanovllm:e2e_request_latency_seconds",
                        "Seconds from request to last token.", buckets=TTFT_BUCKETS)

    async def track(self, outputs: AsyncIterator[RequestOutput],
                    primary: bool = True) -> AsyncIterator[RequestOutput]:
        """Pass a completion's outputs through, counting its tokens; the request's prompt and
        latencies are counted by its primary completion (choice 0 of n) only."""
        start = perf_counter()
        first = None
        async with aclosing(outputs):
            async for out in outputs:
                now = perf_counter()
                self.generation_tokens.inc(len(out.new_token_ids))
                if primary and first is None and out.num_output_tokens:
                    first = now
                    self.prompt_tokens.inc(out.num_prompt_tokens)
                    self.ttft.observe(now - start)
                if out.finish_reason is not None and first is not None:
                    self.e2e.observe(now - start)
                    if out.num_output_tokens > 1:
                        self.tpot.observe((now - first) / (out.num_output_tokens - 1))
                yield out

    def render(self, stats: EngineStats) -> bytes:
        """The text exposition format, with the gauges set from the latest engine stats."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        return generate_latest(self.registry)

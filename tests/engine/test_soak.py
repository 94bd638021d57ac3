"""A CI-sized soak: ~1,000 small random requests over 60 calls, one call in five interrupted,
in a 3-block pool; after every call nothing is queued and every KV block is free, the call's
step counters match its requests, and memory stays flat."""
import pytest
import torch

from benchmarks.soak import soak
from nanovllm import LLM


@pytest.fixture
def one_thread():
    # Tiny matmuls on a busy machine: extra intra-op threads only contend.
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def test_soak_leaves_nothing_behind(tiny_model, one_thread):
    llm = LLM(tiny_model, num_kvcache_blocks=3)
    try:
        report = soak(llm, calls=60, requests_per_call=34, max_tokens=4, seed=1, log=None)
    finally:
        llm.shutdown()
    summary = report.summary()
    print(summary)
    assert report.calls == 60 and report.requests >= 800 and report.leaked_blocks == 0
    # the paths a long run must survive were all taken
    assert report.interrupted_calls >= 5 and report.preemptions >= 1
    assert report.cache_hit_blocks >= 1
    # flat: a leaked Sequence per request would add ~20 objects and ~10 KiB a call
    assert summary["python_objects_slope_per_call"] < 5, summary
    assert summary["host_rss_slope_kib_per_call"] < 256, summary

"""prepare_sample's temperature rows: uploaded once per batch of temperatures, right for every
batch, and the cache bounded."""
import torch

from nanovllm.layers.sampling.penalties import TokenCounts
from nanovllm.runner.sample_inputs import prepare_sample
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence


def _temperatures(temps: list[float], cache: dict | None):
    seqs = [Sequence([1, 2, 3], SamplingParams(temperature=t), 4) for t in temps]
    counts = TokenCounts(32, torch.device("cpu"))
    params, penalties, logprobs, bitmask = prepare_sample(
        seqs, [3] * len(seqs), counts, 32, torch.device("cpu"), cache)
    assert penalties is None and logprobs is None and bitmask is None
    return params


def test_a_batch_keeps_its_uploaded_temperatures():
    cache = {}
    first = _temperatures([0.0, 0.7], cache)
    assert first.dtype == torch.float32 and first.tolist() == [0.0, torch.tensor(0.7).item()]
    assert _temperatures([0.0, 0.7], cache) is first  # no upload for the same rows
    other = _temperatures([0.7, 0.0], cache)
    assert other is not first and other.tolist() == first.flip(0).tolist()
    assert _temperatures([0.0], cache).tolist() == [0.0]
    assert _temperatures([0.0, 0.7], None) is not first  # no cache: a fresh upload


def test_the_cache_stays_small():
    cache = {}
    for i in range(200):
        assert _temperatures([i / 100], cache).tolist() == [torch.tensor(i / 100).item()]
        assert len(cache) <= 64

"""Start-up's timing graphs on CUDA: many captures in one shared pool, with the caches' flush
kept for the run (utils.graph_capture), time each step and leave the real flush behind."""
import pytest
import torch

from nanovllm.layers.fused_calibration import cuda_graph_times

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_many_timing_graphs_share_a_pool():
    """Steps of different cost are timed in their order (a captured-then-dropped graph's pool
    reused by the next capture asserted inside torch), and empty_cache works again after."""
    flush = torch.cuda.empty_cache
    a = torch.randn(2048, 2048, device="cuda")
    steps = [lambda: a @ a, lambda: a + 1, lambda: a @ a @ a] * 4
    times = cuda_graph_times(steps)
    assert len(times) == len(steps) and all(t > 0 for t in times)
    matmul, add, two = (sorted(times[i::3])[len(times[i::3]) // 2] for i in range(3))
    assert add < matmul < two, (add, matmul, two)
    assert torch.cuda.empty_cache is flush

"""One rank's KV pool: how many blocks fit in the memory left, and the pool tensor wired into
the attention layers."""
import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.layers.attention import Attention

CPU_KV_POOL_BYTES = 2 << 30  # CPU KV pool of all ranks together when num_kvcache_blocks is -1


def num_kv_blocks(config: Config, block_bytes: int, device: torch.device,
                  world_size: int) -> int:
    """Blocks of block_bytes the pool gets; every rank agrees on the smallest."""
    # On CUDA: blocks = (total * gpu_memory_utilization - used - peak + current) // block_bytes,
    # used: everything on the GPU now; peak - current: the warm-up's activations on top.
    if config.num_kvcache_blocks > 0:
        num_blocks = config.num_kvcache_blocks
    elif config.device == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        stats = torch.cuda.memory_stats(device)
        peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        budget = total * config.gpu_memory_utilization - (total - free) - peak + current
        num_blocks = int(budget) // block_bytes
    else:
        # Every rank's shard lives in the same host memory: split the budget between them;
        # at least one max_model_len sequence must fit.
        max_num_blocks = -(-config.max_model_len // config.kvcache_block_size)
        num_blocks = max(CPU_KV_POOL_BYTES // world_size // block_bytes, max_num_blocks)
    if world_size > 1:
        # Block ids must mean the same on every rank: all ranks take the smallest pool.
        agreed = torch.tensor([num_blocks], dtype=torch.int64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        num_blocks = int(agreed.item())
    if num_blocks <= 0:
        raise RuntimeError(
            f"no room for the KV cache: one block needs {block_bytes} bytes; raise "
            f"gpu_memory_utilization={config.gpu_memory_utilization} or lower "
            f"max_num_batched_tokens / max_model_len")
    return num_blocks


def create_kv_cache(attn_layers: list[Attention], num_blocks: int, block_size: int,
                    dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The pool [2, layers, blocks, block_size, kv_heads, head_dim], wired into each layer."""
    layer = attn_layers[0]
    # Zeroed, not empty: FlashAttention-3's paged prefill multiplies the masked keys' zero
    # probabilities by V slots past the sequence in its last block, and 0 * NaN garbage
    # (left by earlier allocations) is NaN. Written K/V are finite, so stale slots are safe.
    kv_cache = torch.zeros(2, len(attn_layers), num_blocks, block_size, layer.num_kv_heads,
                           layer.head_dim, dtype=dtype, device=device)
    for i, attn in enumerate(attn_layers):
        attn.k_cache, attn.v_cache = kv_cache[0, i], kv_cache[1, i]
    return kv_cache

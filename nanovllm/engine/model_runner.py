"""Runs the model for one rank: weights, the KV pool, step inputs, CUDA graphs."""
import logging

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.attention import Attention, select_attention_backend
from nanovllm.layers.linear import tp_rank_and_size
from nanovllm.layers.sampler import Sampler
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.context import Context, forward_context
from nanovllm.utils.loader import load_model

logger = logging.getLogger(__name__)
CPU_KV_POOL_BYTES = 2 << 30  # CPU KV pool of all ranks together when num_kvcache_blocks is -1
_WARMUP_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


class ModelRunner:
    """Owns the model shard and KV pool of one rank and executes scheduled batches."""

    def __init__(self, config: Config, rank: int = 0, attention_backend: str = "auto"):
        self.config = config
        self.rank = rank
        self.world_size = config.tensor_parallel_size
        self.block_size = config.kvcache_block_size
        self.device = torch.device(f"cuda:{rank}" if config.device == "cuda" else "cpu")
        self.use_cuda_graph = config.device == "cuda" and not config.enforce_eager
        if tp_rank_and_size() != (rank, self.world_size):
            # The layers shard themselves by the torch.distributed group they find.
            raise RuntimeError(f"rank {rank} of tensor_parallel_size={self.world_size} needs a "
                               f"process group of that size; found (rank, size) = "
                               f"{tp_rank_and_size()}")
        if config.device == "cuda":
            torch.cuda.set_device(self.device)
        hf_config = config.hf_config
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.torch_dtype)
        try:
            with self.device:
                self.model = Qwen3ForCausalLM(hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        load_model(self.model, config.model)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.backend = select_attention_backend(config.device, attention_backend)
        for layer in self.attn_layers:
            layer.backend = self.backend
        self.sampler = Sampler()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if config.device == "cuda":
            self.warmup_model()
        self.num_kvcache_blocks = self.allocate_kv_cache()
        if self.use_cuda_graph:
            self.capture_cudagraph()

    # ---- memory -------------------------------------------------------------------------
    def block_bytes(self) -> int:
        """Bytes of one KV block across all layers: 2 (K and V) x layers x block x heads x dim."""
        layer = self.attn_layers[0]
        return (2 * len(self.attn_layers) * self.block_size * layer.num_kv_heads
                * layer.head_dim * self.config.torch_dtype.itemsize)

    def warmup_model(self) -> None:
        """Run the largest prefill batch once so the activation peak is known before sizing KV."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        max_len = self.config.max_model_len
        num_seqs = min(self.config.max_num_batched_tokens // max_len, self.config.max_num_seqs)
        seqs = [Sequence([0] * max_len, _WARMUP_PARAMS, self.block_size) for _ in range(num_seqs)]
        self.run(seqs, True)
        torch.cuda.empty_cache()

    def allocate_kv_cache(self) -> int:
        """Allocate [2, layers, blocks, block_size, kv_heads, head_dim] and wire it per layer.

        On CUDA: blocks = (total * gpu_memory_utilization - used - peak + current) // block_bytes,
        where used is everything on the GPU now, and peak - current is what the warm-up's
        activations needed on top of the resident tensors.
        """
        config, block_bytes = self.config, self.block_bytes()
        if config.num_kvcache_blocks > 0:
            num_blocks = config.num_kvcache_blocks
        elif config.device == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            stats = torch.cuda.memory_stats(self.device)
            peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
            budget = total * config.gpu_memory_utilization - (total - free) - peak + current
            num_blocks = int(budget) // block_bytes
        else:
            min_blocks = -(-config.max_model_len // self.block_size)
            # Every rank's shard lives in the same host memory: split the budget between them.
            budget = CPU_KV_POOL_BYTES // self.world_size
            num_blocks = max(budget // block_bytes, min_blocks)
        if self.world_size > 1:
            # Block ids must mean the same on every rank: all ranks take the smallest pool.
            agreed = torch.tensor([num_blocks], dtype=torch.int64, device=self.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
            num_blocks = int(agreed.item())
        if num_blocks <= 0:
            raise RuntimeError(
                f"no room for the KV cache: one block needs {block_bytes} bytes; raise "
                f"gpu_memory_utilization={config.gpu_memory_utilization} or lower "
                f"max_num_batched_tokens / max_model_len")
        layer = self.attn_layers[0]
        self.kv_cache = torch.empty(2, len(self.attn_layers), num_blocks, self.block_size,
                                    layer.num_kv_heads, layer.head_dim,
                                    dtype=config.torch_dtype, device=self.device)
        for i, attn in enumerate(self.attn_layers):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        logger.info("KV cache: %d blocks of %d tokens, %.1f MiB each", num_blocks,
                    self.block_size, block_bytes / 2**20)
        return num_blocks

    # ---- step inputs --------------------------------------------------------------------
    def _to_device(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        pin = self.device.type == "cuda"
        return torch.tensor(data, dtype=dtype, pin_memory=pin).to(self.device, non_blocking=True)

    def prepare_block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        max_len = max(len(seq.block_table) for seq in seqs)
        rows = [seq.block_table + [-1] * (max_len - len(seq.block_table)) for seq in seqs]
        return self._to_device(rows, torch.int32)

    def prepare_prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, Context]:
        """Inputs for the tokens not yet in the cache; keys span cached + new tokens."""
        input_ids, positions, slot_mapping = [], [], []
        cu_seqlens_q, cu_seqlens_k = [0], [0]
        max_seqlen_q = max_seqlen_k = 0
        bs = self.block_size
        for seq in seqs:
            seqlen, cached = len(seq), seq.num_cached_tokens
            input_ids.extend(seq.uncached_token_ids)
            positions.extend(range(cached, seqlen))
            cu_seqlens_q.append(cu_seqlens_q[-1] + seqlen - cached)
            cu_seqlens_k.append(cu_seqlens_k[-1] + seqlen)
            max_seqlen_q = max(max_seqlen_q, seqlen - cached)
            max_seqlen_k = max(max_seqlen_k, seqlen)
            for i in range(seq.num_cached_blocks, len(seq.block_table)):  # empty in warm-up
                start = seq.block_table[i] * bs
                end = start + (bs if i != seq.num_blocks - 1 else seq.last_block_num_tokens)
                slot_mapping.extend(range(start, end))
        prefix_cached = cu_seqlens_k[-1] > cu_seqlens_q[-1]
        context = Context(
            is_prefill=True,
            cu_seqlens_q=self._to_device(cu_seqlens_q, torch.int32),
            cu_seqlens_k=self._to_device(cu_seqlens_k, torch.int32),
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            slot_mapping=self._to_device(slot_mapping, torch.int32) if slot_mapping else None,
            block_tables=self.prepare_block_tables(seqs) if prefix_cached else None,
            prefix_cached=prefix_cached)
        return (self._to_device(input_ids, torch.int64), self._to_device(positions, torch.int64),
                context)

    def prepare_decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, Context]:
        """One new token per sequence, attending to its whole paged context."""
        bs = self.block_size
        input_ids = [seq.last_token for seq in seqs]
        positions = [len(seq) - 1 for seq in seqs]
        context_lens = [len(seq) for seq in seqs]
        slot_mapping = [seq.block_table[-1] * bs + seq.last_block_num_tokens - 1 for seq in seqs]
        context = Context(
            is_prefill=False,
            slot_mapping=self._to_device(slot_mapping, torch.int32),
            context_lens=self._to_device(context_lens, torch.int32),
            block_tables=self.prepare_block_tables(seqs))
        return (self._to_device(input_ids, torch.int64), self._to_device(positions, torch.int64),
                context)

    def prepare_sample(self, seqs: list[Sequence]) -> torch.Tensor:
        return self._to_device([seq.sampling_params.temperature for seq in seqs], torch.float32)

    # ---- execution ----------------------------------------------------------------------
    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor,
                  context: Context) -> torch.Tensor | None:
        batch = input_ids.size(0)
        graph_bs = next((b for b in self.graph_bs if b >= batch), None) if self.graphs else None
        if context.is_prefill or graph_bs is None:
            with forward_context(context):
                return self.model.compute_logits(self.model(input_ids, positions))
        v = self.graph_vars
        v["input_ids"][:batch] = input_ids
        v["positions"][:batch] = positions
        v["slot_mapping"].fill_(-1)
        v["slot_mapping"][:batch] = context.slot_mapping
        v["context_lens"].zero_()
        v["context_lens"][:batch] = context.context_lens
        v["block_tables"][:batch, :context.block_tables.size(1)] = context.block_tables
        self.graphs[graph_bs].replay()
        with forward_context(context):
            return self.model.compute_logits(v["outputs"][:batch])

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int] | None:
        """Execute one step; rank 0 returns the sampled token ids."""
        prepare = self.prepare_prefill if is_prefill else self.prepare_decode
        input_ids, positions, context = prepare(seqs)
        temperatures = self.prepare_sample(seqs) if self.rank == 0 else None
        logits = self.run_model(input_ids, positions, context)
        if self.rank != 0:
            return None
        return self.sampler(logits, temperatures).tolist()

    @torch.inference_mode()
    def capture_cudagraph(self) -> None:
        """Capture decode graphs for batch sizes 1, 2, 4, 8, 16, 32, ... max, largest first."""
        config = self.config
        max_bs = min(config.max_num_seqs, 512)
        max_num_blocks = -(-config.max_model_len // self.block_size)
        hidden = config.hf_config.hidden_size
        self.graph_bs = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 16))
        self.graph_bs.append(max_bs)
        i32 = dict(dtype=torch.int32, device=self.device)
        v = self.graph_vars = dict(
            input_ids=torch.zeros(max_bs, dtype=torch.int64, device=self.device),
            positions=torch.zeros(max_bs, dtype=torch.int64, device=self.device),
            slot_mapping=torch.full((max_bs,), -1, **i32),
            context_lens=torch.zeros(max_bs, **i32),
            block_tables=torch.zeros(max_bs, max_num_blocks, **i32),
            outputs=torch.zeros(max_bs, hidden, dtype=config.torch_dtype, device=self.device))
        pool = None
        for bs in reversed(self.graph_bs):
            graph = torch.cuda.CUDAGraph()
            context = Context(is_prefill=False, slot_mapping=v["slot_mapping"][:bs],
                              context_lens=v["context_lens"][:bs],
                              block_tables=v["block_tables"][:bs])
            with forward_context(context):
                v["outputs"][:bs] = self.model(v["input_ids"][:bs], v["positions"][:bs])  # warm
                with torch.cuda.graph(graph, pool):
                    v["outputs"][:bs] = self.model(v["input_ids"][:bs], v["positions"][:bs])
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()

    def shutdown(self) -> None:
        """Free graphs, the KV pool and the weights."""
        self.graphs.clear()
        self.graph_vars = None
        for attn in self.attn_layers:
            attn.k_cache = attn.v_cache = torch.tensor([])
        self.kv_cache = None
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

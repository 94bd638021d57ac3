"""Vocabulary-parallel embedding and LM head."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.linear import divide, tp_rank_and_size
from nanovllm.utils.context import get_context
from nanovllm.utils.loader import check_shape


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary; lookups are summed across ranks."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.num_embeddings_per_partition = divide(num_embeddings, self.tp_size)
        self.vocab_start_idx = self.num_embeddings_per_partition * self.tp_rank
        self.vocab_end_idx = self.vocab_start_idx + self.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        shard = param.data.size(0)
        check_shape(loaded_weight, (shard * self.tp_size, param.data.size(1)))
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(x, self.weight)
        mask = (x >= self.vocab_start_idx) & (x < self.vocab_end_idx)
        y = F.embedding(mask * (x - self.vocab_start_idx), self.weight)
        y = mask.unsqueeze(1) * y  # ids owned by other ranks contribute zeros
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the rows that sample (in prefill: context.logits_indices, the last row of
    each chunk that ends its sequence); shards gathered to rank 0 (None elsewhere)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        context = get_context()
        if context.is_prefill:
            x = x[context.logits_indices].contiguous()
        logits = F.linear(x, self.weight)
        if self.tp_size > 1:
            # Only rank 0 samples, so only rank 0 receives the other ranks' vocabulary slices.
            shards = ([torch.empty_like(logits) for _ in range(self.tp_size)]
                      if self.tp_rank == 0 else None)
            dist.gather(logits, shards, 0)
            logits = torch.cat(shards, -1) if self.tp_rank == 0 else None
        return logits

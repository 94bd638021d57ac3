"""The LoRA delta in plain torch: the reference of kernels.lora (layouts described there)."""
import torch

from nanovllm.utils.context import LoRAMapping


def add_lora_torch(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                   lora_b: torch.Tensor, slice_sizes: tuple[int, ...],
                   mapping: LoRAMapping) -> None:
    """The reference: y += each grouped row's delta, in place (reads the counts on the host)."""
    rank = lora_b.size(2)
    counts, starts = mapping.counts.tolist(), mapping.starts.tolist()
    for slot, (count, start) in enumerate(zip(counts, starts)):
        if not count:
            continue
        rows = mapping.rows[start:start + count].long()
        shrunk = x[rows] @ lora_a[slot].t()  # [n, S*R] in the model dtype, as PEFT's lora_A
        delta = torch.cat([shrunk[:, s * rank:(s + 1) * rank] @ b.t()
                           for s, b in enumerate(lora_b[slot].split(slice_sizes))], dim=1)
        y.index_add_(0, rows, delta.to(y.dtype))

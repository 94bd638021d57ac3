"""Attention kernels: prefill and decode over the paged KV cache, the K/V write, q/k norm +
RoPE, and their torch references."""

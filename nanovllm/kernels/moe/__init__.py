"""Mixture-of-experts kernels: the fused experts GEMM and its torch reference."""

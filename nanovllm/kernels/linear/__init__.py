"""Linear-layer kernels: the fused decode projections, FP8 GEMMs, LoRA, and their torch
references."""

"""Triton kernels (and plain-torch references) for KV-cache writes, attention and sampling."""
import os

# The kernels are tuned and tested with FP fusion (a * b + c as one FMA), Triton's default
# through 3.9; Triton 3.9 warns that 3.10 turns it off by default. Keep it unless a user chose.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

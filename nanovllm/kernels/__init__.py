"""Triton kernels (and plain-torch references) for KV-cache writes, attention and sampling."""

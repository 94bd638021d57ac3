"""The OpenAI-compatible server: `python -m nanovllm.serve MODEL` (needs the serve extra)."""

"""Accuracy and parity tools the tests import, each also a command (`python -m tests.accuracy.X`):
tp_parity (TP=N against TP=1), fp8_accuracy (FP8 KV cache against the model-dtype cache) and
bf16_agreement (each attention backend's greedy tokens against transformers in float32)."""

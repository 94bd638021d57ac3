"""Hugging Face transformers as the reference implementation."""
import random

import torch
from transformers import AutoModelForCausalLM


def load_hf(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def cache_kwargs(out) -> dict:
    """The KV cache of a forward's output, as the next forward takes it: `cache` since
    transformers deprecated `past_key_values` (5.2x, removed in 5.40), `past_key_values` before."""
    if "cache" in out.keys():
        return dict(cache=out["cache"])
    return dict(past_key_values=out["past_key_values"])


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation with the KV cache, never stopping at EOS."""
    device = next(model.parameters()).device
    out = model(torch.tensor([prompt], device=device), use_cache=True)
    tokens = []
    for _ in range(num_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]], device=device), use_cache=True, **cache_kwargs(out))
    return tokens


@torch.inference_mode()
def hf_last_logits(model, prompt: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    return model(torch.tensor([prompt], device=device)).logits[0, -1].float().cpu()


def token_prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    """Random token-id prompts of the given lengths (ids 1..499: inside every tiny vocabulary)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(n)] for n in lengths]


def ids(outputs: list[dict]) -> list[list[int]]:
    """The token ids of generate()'s outputs."""
    return [o["token_ids"] for o in outputs]

"""Where engine-level tests run: a device, attention backend, dtype and mode, with the
matching transformers reference and the bar our tokens must meet against it.

float32 targets must give transformers' greedy tokens exactly. bf16 rounds differently in
any two implementations, so there every token we pick must be transformers' argmax up to a
bf16-sized margin, with transformers teacher-forced along our sequence.
"""
import importlib.util
from dataclasses import dataclass, field

import pytest
import torch

from nanovllm import LLM
from tests.reference import hf_greedy, load_hf

HAS_FLASH = importlib.util.find_spec("flash_attn") is not None
BF16_MARGIN = 0.02  # of the largest |logit|: a few bf16 ulps of the logit scale


@dataclass
class Target:
    """One place to run the engine, and how to check its greedy tokens."""

    name: str
    device: str
    backend: str
    dtype: str
    eager: bool
    _hf: dict = field(default_factory=dict, repr=False)
    _engines: dict = field(default_factory=dict, repr=False)

    @property
    def exact(self) -> bool:
        return self.dtype == "float32"

    def llm(self, path: str, num_kvcache_blocks: int = 32, **kwargs) -> LLM:
        """An engine on this target, shared by every caller with the same arguments.

        A small pool and batch keep start-up (graph capture) short on the GPU.
        """
        kwargs = {"max_num_seqs": 16, "max_model_len": 1024, **kwargs,
                  "num_kvcache_blocks": num_kvcache_blocks}
        key = (path, *sorted(kwargs.items()))
        if key not in self._engines:
            self._engines[key] = LLM(path, device=self.device, attention_backend=self.backend,
                                     dtype=self.dtype, enforce_eager=self.eager, **kwargs)
        return self._engines[key]

    def hf(self, path: str):
        """transformers on this target's device, in float32 (exact) or bf16."""
        if path not in self._hf:
            dtype = torch.float32 if self.exact else torch.bfloat16
            self._hf[path] = load_hf(path, dtype, self.device)
        return self._hf[path]

    def check_greedy(self, path: str, prompts: list[list[int]], outputs: list[list[int]]):
        """Assert `outputs` (greedy, ignore_eos) are transformers' under this target's bar."""
        hf = self.hf(path)
        for prompt, tokens in zip(prompts, outputs):
            if self.exact:
                assert tokens == hf_greedy(hf, prompt, len(tokens)), (len(prompt), prompt[:4])
            else:
                assert_within_bf16_margin(hf, prompt, tokens)

    def close(self) -> None:
        for engine in self._engines.values():
            engine.shutdown()
        self._engines.clear()
        self._hf.clear()
        if self.device == "cuda":
            torch.cuda.empty_cache()


@torch.inference_mode()
def assert_within_bf16_margin(hf, prompt: list[int], tokens: list[int]) -> None:
    """Every token in `tokens` is within BF16_MARGIN of transformers' best, teacher-forced."""
    device = next(hf.parameters()).device
    ids = torch.tensor([prompt + tokens], device=device)
    logits = hf(ids).logits[0, len(prompt) - 1:-1].float()  # row i predicts tokens[i]
    picked = logits.gather(-1, torch.tensor(tokens, device=device)[:, None])[:, 0]
    gap = logits.max(-1).values - picked
    margin = BF16_MARGIN * logits.abs().max(-1).values
    assert bool((gap <= margin).all()), (len(prompt), prompt[:4], tokens)


TARGETS = {
    "cpu-torch-float32": dict(device="cpu", backend="torch", dtype="float32", eager=True),
    "cuda-triton-float32-eager": dict(device="cuda", backend="triton", dtype="float32",
                                      eager=True),
    "cuda-triton-float32-graphs": dict(device="cuda", backend="triton", dtype="float32",
                                       eager=False),
    "cuda-flash-attn-bf16": dict(device="cuda", backend="flash-attn", dtype="bfloat16",
                                 eager=False),
}


def target_params(names: list[str] | None = None) -> list:
    """pytest.param per target: CUDA ones marked gpu, flash-attn skipped where not importable."""
    params = []
    for name in names or TARGETS:
        marks = []
        if TARGETS[name]["device"] == "cuda":
            marks.append(pytest.mark.gpu)
        if TARGETS[name]["backend"] == "flash-attn":
            marks.append(pytest.mark.skipif(not HAS_FLASH, reason="flash-attn not importable"))
        params.append(pytest.param(name, marks=marks, id=name))
    return params


def make_target(name: str) -> Target:
    return Target(name, **TARGETS[name])

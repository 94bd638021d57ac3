"""Tiny random PEFT adapters (non-zero B) and transformers + peft as the reference."""
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from tests.reference import hf_greedy, load_hf

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapter(base: str, path: str, seed: int, r: int = 4, alpha: int = 8,
                  target_modules: list[str] | None = None, use_rslora: bool = False) -> str:
    """Save a random LoRA adapter of `base` to `path`: lora_B random too (PEFT zeroes it)."""
    model = load_hf(base)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules or ALL_MODULES,
                        use_rslora=use_rslora, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    peft_model.save_pretrained(path)
    return path


def peft_greedy(base: str, adapter: str | None, prompts: list[list[int]],
                num_tokens: int) -> list[list[int]]:
    """transformers (+ peft when `adapter`) greedy tokens, one prompt at a time."""
    model = load_hf(base)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    return [hf_greedy(model, prompt, num_tokens) for prompt in prompts]

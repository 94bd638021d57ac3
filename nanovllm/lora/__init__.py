"""LoRA adapters: requests (this import is light), adapter loading, GPU slots."""
from nanovllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]

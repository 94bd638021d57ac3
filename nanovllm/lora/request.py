"""LoRARequest: which adapter a request runs through (vLLM's name and fields)."""
from dataclasses import dataclass, field

from nanovllm.utils.field_checks import INT32_MAX, check, describe, is_int


@dataclass
class LoRARequest:
    """An adapter: a PEFT directory (`lora_path`), or in-memory `lora_tensors` (a PEFT state
    dict) with `peft_config` (its adapter_config.json as a dict), as a training loop pushes.

    `lora_int_id` (>= 1) names the adapter inside the engine: its GPU slot, its prefix-cache
    entries. Two requests with the same id must be the same adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_tensors: dict | None = field(default=None, repr=False, compare=False)
    peft_config: dict | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        check("lora_name", self.lora_name, isinstance(self.lora_name, str) and self.lora_name,
              "a non-empty str")
        check("lora_int_id", self.lora_int_id, is_int(self.lora_int_id)
              and 1 <= self.lora_int_id <= INT32_MAX, f"an int in [1, {INT32_MAX}]")
        self.lora_int_id = int(self.lora_int_id)
        check("lora_path", self.lora_path, isinstance(self.lora_path, str), "a str")
        in_memory = self.lora_tensors is not None
        if in_memory != (self.peft_config is not None):
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_tensors and peft_config go "
                             f"together (got lora_tensors {describe(self.lora_tensors, 20)}, "
                             f"peft_config {describe(self.peft_config, 20)})")
        if not in_memory and not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: give lora_path (a PEFT "
                             f"directory) or lora_tensors with peft_config")

    @property
    def in_memory(self) -> bool:
        return self.lora_tensors is not None

    @property
    def source(self) -> str:
        """What the adapter is read from, for messages."""
        return "in-memory tensors" if self.in_memory else repr(self.lora_path)

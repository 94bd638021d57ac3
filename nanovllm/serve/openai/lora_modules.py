"""The adapters a server serves, by name: --lora-modules at start, vLLM's load_lora_adapter and
unload_lora_adapter routes at run time. A request's `model` names the base model or one of them."""
from pydantic import BaseModel, ConfigDict

from nanovllm.lora.request import LoRARequest
from nanovllm.serve.async_llm import AsyncLLM
from nanovllm.serve.openai.errors import APIError


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are named in the log

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    lora_name: str


def parse_lora_modules(specs: list[str] | None) -> dict[str, str]:
    """`name=path` options as {name: path}, or a ValueError naming the bad one."""
    modules = {}
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not (sep and name and path):
            raise ValueError(f"--lora-modules {spec!r} is invalid: expected name=path")
        modules[name] = path
    return modules


class LoRAModules:
    """name -> LoRARequest; each adapter is checked when loaded and gets a fresh id, so an
    unloaded name loaded again never meets the old adapter's slot or cached prefixes."""

    def __init__(self, llm: AsyncLLM, base_model: str):
        self.llm, self.base_model = llm, base_model
        self.requests: dict[str, LoRARequest] = {}
        self._next_id = 1

    def load(self, name: str, path: str) -> LoRARequest:
        """Check and add an adapter; ValueError or FileNotFoundError naming the problem."""
        if name == self.base_model or name in self.requests:
            raise ValueError(f"lora_name={name!r} is already served")
        request = LoRARequest(name, self._next_id, path)
        self.llm.check_lora(request)
        self._next_id += 1
        self.requests[name] = request
        return request

    def unload(self, name: str) -> None:
        if self.requests.pop(name, None) is None:
            raise APIError(404, f"The LoRA adapter {name!r} is not loaded", "not_found_error",
                           "lora_name")

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model), else a 404."""
        if model is None or model == self.base_model:
            return None
        request = self.requests.get(model)
        if request is None:
            served = [self.base_model, *self.requests]
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                                f"{served}", "not_found_error", "model")
        return request

"""The engine's adapters: every LoRARequest it has seen, by id, checked once when first seen,
and sent to every rank's host cache (again, when a cache let it go before its next step)."""
from transformers import PretrainedConfig

from nanovllm.lora.adapter import LoRAAdapter, load_adapter, lora_specs
from nanovllm.lora.request import LoRARequest
from nanovllm.utils.field_checks import describe


def same_adapter(a: LoRARequest, b: LoRARequest) -> bool:
    """Whether two requests name one adapter: the same object, or the same name and path."""
    return a is b or (not a.in_memory and not b.in_memory and a.lora_name == b.lora_name
                      and a.lora_path == b.lora_path)


def lora_request_list(lora_request: object, num_prompts: int, enabled: bool
                      ) -> list[LoRARequest | None]:
    """One LoRARequest (or None) for every prompt, or a list of one per prompt, as a list."""
    if isinstance(lora_request, list | tuple):
        if len(lora_request) != num_prompts:
            raise ValueError(f"got {len(lora_request)} lora_request entries for {num_prompts} "
                             f"prompts: pass one for all or exactly one per prompt")
        requests = list(lora_request)
    else:
        requests = [lora_request] * num_prompts
    seen: dict[int, LoRARequest] = {}
    for i, request in enumerate(requests):
        if request is None:
            continue
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request {i} must be a LoRARequest or None, got "
                             f"{describe(request)}")
        if not enabled:
            raise ValueError(f"lora_request {request.lora_name!r} given, but LoRA is not "
                             f"enabled: build the LLM with enable_lora=True")
        other = seen.setdefault(request.lora_int_id, request)
        if not same_adapter(other, request):
            raise ValueError(f"lora_int_id={request.lora_int_id} names two adapters in one "
                             f"call: {other.lora_name!r} and {request.lora_name!r}")
    return requests


def snapshot(adapter: LoRAAdapter) -> LoRAAdapter:
    """The adapter with host copies of its tensors."""
    weights = {key: tuple(t.detach().to("cpu", copy=True) for t in pair)
               for key, pair in adapter.weights.items()}
    return LoRAAdapter(adapter.lora_int_id, adapter.rank, adapter.scaling, weights)


class LoRARegistry:
    """Registered requests by lora_int_id; an id keeps its adapter until removed. `executor`
    runs the ranks' add_lora and remove_lora; its `runner` (rank 0's) shows what is cached."""

    def __init__(self, hf_config: PretrainedConfig, max_lora_rank: int, executor):
        self.hf_config, self.max_lora_rank = hf_config, max_lora_rank
        self.executor = executor
        self.requests: dict[int, LoRARequest] = {}
        # in-memory adapters as registered: their tensors are the caller's, who may change them
        # in place (an RL loop's live state dict); a reload must send what was checked
        self.snapshots: dict[int, LoRAAdapter] = {}

    def register(self, requests: list[LoRARequest | None]) -> int:
        """Check every new adapter, then send them all to the ranks; returns how many were new.
        Nothing is sent when any is bad."""
        new = {r.lora_int_id: r for r in requests if r is not None
               and not (r.lora_int_id in self.requests
                        and same_adapter(self.requests[r.lora_int_id], r))}
        adapters = [(request, self.check(request)) for request in new.values()]
        for request, adapter in adapters:
            self._send(adapter)
            self.requests[request.lora_int_id] = request
            if request.in_memory:
                self.snapshots[request.lora_int_id] = snapshot(adapter)
        return len(adapters)

    def reload(self, lora_ids: set[int]) -> None:
        """Send again the adapters among `lora_ids` that the ranks' host caches let go of."""
        manager = self.executor.runner.lora_manager  # every rank's cache holds the same ids
        for lora_int_id in lora_ids:
            if lora_int_id and not manager.has(lora_int_id):
                adapter = self.snapshots.get(lora_int_id)
                self._send(adapter or self.load(self.requests[lora_int_id]))

    def remove(self, lora_int_id: int) -> None:
        del self.requests[lora_int_id]
        self.snapshots.pop(lora_int_id, None)
        self.executor.execute("remove_lora", lora_int_id)

    def _send(self, adapter: LoRAAdapter) -> None:
        self.executor.execute("add_lora", (adapter.lora_int_id, adapter.rank, adapter.scaling),
                              lora_specs(adapter), adapter=adapter)

    def check(self, request: LoRARequest) -> LoRAAdapter | None:
        """The adapter, read and checked, when its id is new; None when it is registered."""
        known = self.requests.get(request.lora_int_id)
        if known is None:
            return self.load(request)
        if same_adapter(known, request):
            return None
        raise ValueError(f"lora_int_id={request.lora_int_id} is already the adapter "
                         f"{known.lora_name!r} ({known.source}); remove_lora("
                         f"{request.lora_int_id}) first, or give {request.lora_name!r} a new id")

    def load(self, request: LoRARequest) -> LoRAAdapter:
        return load_adapter(request, self.hf_config, self.max_lora_rank)

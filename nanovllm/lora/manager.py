"""One rank's adapters: max_loras GPU slots in every targeted projection, filled in LRU order
from a host cache of at most max_cpu_loras adapters.

Every rank runs the same commands on the same batches, so every rank makes the same slot
choices: no slot table travels between them."""
from collections import OrderedDict

import torch
from torch import nn

from nanovllm.config import Config
from nanovllm.layers.linear import LinearBase, RowParallelLinear
from nanovllm.lora.adapter import LoRAAdapter

# A sequence's lora_int_id for start-up's warm-up steps only (runner.warmup): slot 0, whatever it
# holds, so that they launch the LoRA ops; a request's id is >= 1
WARM_UP_LORA_ID = -1

# our projection -> the PEFT modules it fuses, in its output order (packed_modules_mapping)
LORA_TARGETS = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
                "self_attn.o_proj": ("o_proj",),
                "mlp.gate_up_proj": ("gate_proj", "up_proj"),
                "mlp.down_proj": ("down_proj",)}


def add_lora_slots(model: nn.Module, max_loras: int, max_rank: int
                   ) -> dict[tuple[int, str], tuple[LinearBase, int]]:
    """Give every targetable projection its slots; returns (layer, PEFT module) -> (our
    projection, slice). Experts have none (a mixture-of-experts layer has no mlp.gate_up_proj)."""
    targets = {}
    for i, layer in enumerate(model.model.layers):
        for path, modules in LORA_TARGETS.items():
            try:
                linear = layer.get_submodule(path)
            except AttributeError:
                continue
            linear.add_lora_slots(max_loras, max_rank)
            targets.update({(i, module): (linear, s) for s, module in enumerate(modules)})
    return targets


class LoRAManager:
    """Slots and the host cache of one rank; `activate` maps a batch's adapters to slots."""

    def __init__(self, model: nn.Module, config: Config):
        self.max_loras, self.max_rank = config.max_loras, config.max_lora_rank
        self.max_cpu_loras = config.max_cpu_loras
        self.targets = add_lora_slots(model, self.max_loras, self.max_rank)
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, LRU first

    def has(self, lora_int_id: int) -> bool:
        """Whether activate() can place the adapter without it being added again."""
        return lora_int_id in self.host or lora_int_id in self.slots

    def add(self, adapter: LoRAAdapter) -> None:
        """Keep an adapter on the host (replacing one of its id, and that id's slot)."""
        self.remove(adapter.lora_int_id)
        self.host[adapter.lora_int_id] = adapter

    def remove(self, lora_int_id: int) -> None:
        self.host.pop(lora_int_id, None)
        self.slots.pop(lora_int_id, None)  # the slot's weights are dead; it is reused freely

    def activate(self, lora_ids: list[int]) -> list[int]:
        """The slot of each id (-1 for 0, the base model), loading adapters not in a slot into
        the least recently used slots that this batch does not use."""
        wanted = set(lora_ids) - {0, WARM_UP_LORA_ID}
        assert len(wanted) <= self.max_loras, "the scheduler admits at most max_loras adapters"
        for lora_int_id in wanted:
            if lora_int_id in self.slots:
                self.slots.move_to_end(lora_int_id)
            if lora_int_id in self.host:
                self.host.move_to_end(lora_int_id)
        for lora_int_id in sorted(wanted - set(self.slots)):
            used = set(self.slots.values())
            free = [s for s in range(self.max_loras) if s not in used]
            # the LRU entry is untouched by this batch: touched entries went to the end
            slot = free[0] if free else self.slots.pop(next(iter(self.slots)))
            self._load(slot, self.host[lora_int_id])
            self.slots[lora_int_id] = slot
        # Trimmed now, never in add(): an adapter added for this batch is in a slot by now.
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return [self.slots[i] if i > 0 else 0 if i == WARM_UP_LORA_ID else -1 for i in lora_ids]

    @torch.no_grad()
    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Write an adapter into `slot` of every projection: this rank's shard, rank zero
        padded to max_rank, scaling folded into B; untargeted projections get zeros."""
        for linear in {linear for linear, _ in self.targets.values()}:
            linear.lora_a[:, slot].zero_()
            linear.lora_b[:, slot].zero_()
        for (layer, module), (a, b) in adapter.weights.items():
            linear, s = self.targets[(layer, module)]
            rank, size = a.shape[0], linear.lora_slice_sizes()[s]
            tp_rank, tp_size = linear.tp_rank, linear.tp_size
            if isinstance(linear, RowParallelLinear):
                a = a.chunk(tp_size, 1)[tp_rank]  # A along its input, as the weight; B whole
            else:
                b = b.chunk(tp_size, 0)[tp_rank]  # B along its output (heads for q/k/v)
            offset = sum(linear.lora_slice_sizes()[:s])
            dtype = linear.lora_a.dtype
            linear.lora_a[s, slot, :rank].copy_(a.to(dtype))
            linear.lora_b[offset:offset + size, slot, :rank].copy_(
                (b.float() * adapter.scaling).to(dtype))

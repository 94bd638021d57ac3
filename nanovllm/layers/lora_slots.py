"""A linear layer's LoRA slots: every slot's A and B, and how a step's rows reach them
(kernels.linear.lora; the runner's lora.manager fills the slots)."""
import torch

from nanovllm.utils.context import get_context


class LoRASlots:
    """LinearBase's LoRA side (a mixin: it uses the layer's weight, tp_size and
    fused_decode_max_tokens)."""

    def init_lora_slots(self) -> None:
        """No slots yet: every slot's A and B (layouts: kernels/linear/lora_reference.py) come
        with add_lora_slots, the shrink and expand ops with bind_backend."""
        self.register_buffer("lora_a", None, persistent=False)
        self.register_buffer("lora_b", None, persistent=False)
        self.lora_shrink = self.lora_expand = None
        # (the normed input, its shrink) computed by the RMSNorm before (lora_ahead_buffers)
        self.lora_ahead: tuple | None = None

    def lora_slice_sizes(self) -> tuple[int, ...]:
        """This rank's output features of each fused projection (one unless packed)."""
        return tuple(self.local_output_sizes(self.weight.shape[0]))

    def add_lora_slots(self, max_loras: int, max_rank: int) -> None:
        """Zeroed A [slices, max_loras, max_rank, in] and B [out, max_loras, max_rank];
        buffers, so sleep and wake_up move them."""
        out_features, in_features = self.weight.shape
        slices = len(self.lora_slice_sizes())
        self.lora_a = torch.zeros(slices, max_loras, max_rank, in_features,
                                  dtype=self.weight.dtype, device=self.weight.device)
        self.lora_b = torch.zeros(out_features, max_loras, max_rank, dtype=self.weight.dtype,
                                  device=self.weight.device)

    def lora_slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(A, B, each row's slot) for the step's kernels; None when no row of the step runs
        through an adapter (kernels.linear.lora.LoRASlots)."""
        if self.lora_shrink is None:  # no slots: every projection of a model without LoRA
            return None
        slots = get_context().lora_slots
        return None if slots is None else (self.lora_a, self.lora_b, slots)

    def lora_ahead_buffers(self, num_tokens: int) -> tuple | None:
        """LoRAAhead buffers for the RMSNorm before to fill with this projection's shrink, when
        a step of num_tokens runs its fused kernel with one (kernels.linear.lora), else None."""
        if self.lora_shrink is None or not self.fused_decode_max_tokens:
            return None
        from nanovllm.kernels.linear.lora import AHEAD_MAX_TOKENS, lora_ahead_buffers
        ctx = get_context()
        if ctx.lora_slots is None or ctx.is_prefill or ctx.slot_mapping is None \
                or num_tokens > min(self.fused_decode_max_tokens, AHEAD_MAX_TOKENS):
            return None
        return lora_ahead_buffers(self.lora_a, ctx.lora_slots)

    def hand_lora_ahead(self, normed: torch.Tensor, ahead: tuple) -> None:
        """Keep the shrink the RMSNorm before computed of normed, for take_lora_ahead."""
        self.lora_ahead = (normed, ahead)

    def take_lora_ahead(self, x: torch.Tensor) -> tuple | None:
        """The shrink the RMSNorm before computed of x (LoRAAhead), once; else None."""
        pending, self.lora_ahead = self.lora_ahead, None
        return pending[1] if pending is not None and pending[0] is x else None

    def apply_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus this step's adapter deltas (in place; rows without an adapter unchanged)."""
        self.lora_ahead = None  # a shrink computed ahead serves the fused kernels only
        lora = self.lora_slots()
        if lora is not None:
            shrunk = self.lora_shrink(x, self.lora_a, lora[2])
            self.lora_expand(y, shrunk, self.lora_b, self.lora_slice_sizes())
        return y

    def lora_fits_fused(self) -> bool:
        """Whether the fused decode kernels take this layer's LoRA slots (or it has none)."""
        from nanovllm.kernels.linear.lora import fits_lora
        return self.lora_b is None or fits_lora(*self.lora_b.shape[1:])

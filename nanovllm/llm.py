"""The public facade."""
from collections.abc import Iterable
from itertools import islice

import torch

from nanovllm.engine.data_parallel import check_data_parallel_size
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.validation import Conversation, as_conversation_list
from nanovllm.engine.worker import WORKER_COMMANDS
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.loader import check_weight_names
from nanovllm.utils.tokenizer import chat_prompt_ids

WEIGHTS_PER_COMMAND = 64  # tensors named in one worker command (the channel holds 1 MiB)


class LLM(LLMEngine):
    """An offline LLM: `LLM(path, **config).generate(prompts, SamplingParams(...))`."""

    def __new__(cls, model: str, data_parallel_size: int = 1, **kwargs):
        # data_parallel_size > 1 returns a front end over that many engines in Ray actors, with
        # the same generate/chat/stats; with 1 this class is built as always and Ray is never
        # imported.
        if check_data_parallel_size(data_parallel_size) > 1:
            from nanovllm.engine.data_parallel import DataParallelLLM
            return DataParallelLLM(model, data_parallel_size, **kwargs)
        return super().__new__(cls)

    def __init__(self, model: str, data_parallel_size: int = 1, **kwargs):
        super().__init__(model, **kwargs)
        self._sleep_level = 0  # 0 = awake
        self._weights_dropped = False  # woken from sleep(level=2), update_weights not yet run

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[dict]:
        """Answer one conversation (a list of {"role", "content"} dicts) or a list of them through
        the tokenizer's chat template; returns what generate() does."""
        return self.generate(chat_prompt_ids(self.tokenizer, as_conversation_list(messages)),
                             sampling_params, use_tqdm)

    def generate(self, *args, **kwargs) -> list[dict]:
        self._check_ready("generate")
        return super().generate(*args, **kwargs)

    def add_request(self, *args, **kwargs) -> int:
        self._check_ready("add_request")
        return super().add_request(*args, **kwargs)

    def step(self) -> tuple[list, int]:
        self._check_ready("step")
        return super().step()

    # ---- weights and memory, between rollouts -------------------------------------------
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (checkpoint name, tensor) pairs in place, e.g. a transformers model's
        `state_dict().items()`, on any device; each group of names is checked before it loads.
        Needs an idle, awake engine; drops the prefix cache (its K/V came from old weights)."""
        self._check_idle("update_weights")
        if self._sleep_level:
            raise RuntimeError("update_weights() while asleep: call wake_up() first")
        items = iter(weights)
        while batch := list(islice(items, WEIGHTS_PER_COMMAND)):
            if not all(isinstance(item, tuple | list) and len(item) == 2
                       and isinstance(item[1], torch.Tensor) for item in batch):
                raise ValueError("update_weights() takes (name, torch.Tensor) pairs")
            check_weight_names(self.model_runner.model, [name for name, _ in batch])
            specs = [(name, tuple(t.shape), t.dtype) for name, t in batch]
            self._on_all_ranks("update_weights", specs, weights=[t for _, t in batch])
        self.scheduler.reset_prefix_cache()
        self._weights_dropped = False

    def sleep(self, level: int = 1) -> None:
        """Free GPU memory: the KV pool and CUDA graphs, and the weights (level 1: moved to
        host memory; level 2: dropped, for an update_weights after wake_up)."""
        if level not in (1, 2):
            raise ValueError(f"level={level!r} is invalid: expected 1 or 2")
        self._check_idle("sleep")
        if self._sleep_level:
            raise RuntimeError(f"already asleep (level {self._sleep_level})")
        self._on_all_ranks("sleep", level)
        self.scheduler.reset_prefix_cache()  # the cached K/V is gone
        self._sleep_level = level

    def wake_up(self) -> None:
        """Take the GPU memory back (a no-op when awake); after sleep(level=2), the weights
        are undefined until update_weights()."""
        if not self._sleep_level:
            return
        self._check_idle("wake_up")
        self._on_all_ranks("wake_up")
        self._weights_dropped = self._sleep_level == 2
        self._sleep_level = 0

    def _on_all_ranks(self, command: str, *args, **rank0_kwargs) -> None:
        if self.workers is None:
            WORKER_COMMANDS[command](self.model_runner, *args, **rank0_kwargs)
        else:
            self.workers.execute(command, *args, **rank0_kwargs)

    def _check_idle(self, what: str) -> None:
        if self.model_runner is None:
            raise RuntimeError("the engine is shut down")
        if self._has_work():
            raise RuntimeError(f"{what}() needs an idle engine: requests are still queued")

    def _check_ready(self, what: str) -> None:
        if getattr(self, "_sleep_level", 0):
            raise RuntimeError(f"{what}() while asleep (level {self._sleep_level}): call "
                               f"wake_up() first")
        if getattr(self, "_weights_dropped", False):
            raise RuntimeError(f"{what}() after sleep(level=2) and wake_up(): the weights were "
                               f"dropped; call update_weights() first")

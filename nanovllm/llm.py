"""The public facade."""
from collections.abc import Callable, Iterable
from itertools import islice

import torch
from transformers import PreTrainedTokenizerBase

from nanovllm.data_parallel.engine import DataParallelEngine, check_data_parallel_size
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.request_checks import Conversation, Prompt, as_conversation_list
from nanovllm.lora.registry import lora_request_list
from nanovllm.lora.request import LoRARequest
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.loader import check_weight_names
from nanovllm.utils.tokenizer import chat_prompt_ids, chat_template_options

WEIGHTS_PER_COMMAND = 64  # tensors named in one worker command (the channel holds 1 MiB)


class LLM(LLMEngine):
    """An offline LLM: `LLM(path, **config).generate(prompts, SamplingParams(...))`."""

    def __new__(cls, model: str, data_parallel_size: int = 1, **kwargs):
        # data_parallel_size > 1 builds a DataParallelLLM (an LLM over N engines in Ray actors);
        # with 1 this class is built as always and Ray is never imported.
        if cls is LLM and check_data_parallel_size(data_parallel_size) > 1:
            return super().__new__(DataParallelLLM)
        return super().__new__(cls)

    def __init__(self, model: str, data_parallel_size: int = 1, **kwargs):
        super().__init__(model, **kwargs)
        self._sleep_level = 0  # 0 = awake
        # after sleep(level=2): ids of the parameters update_weights has not refilled yet
        self._unfilled: set[int] = set()

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool | Callable = True,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[dict]:
        """generate() for one conversation or a list, through the chat template (the
        tokenizer's, or chat_template) with vLLM's LLM.chat options."""
        options = chat_template_options(add_generation_prompt, continue_final_message,
                                        chat_template, tools, chat_template_kwargs)
        prompts = chat_prompt_ids(self.tokenizer, as_conversation_list(messages), options)
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer prompts are encoded and outputs decoded with (vLLM's name)."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() uses without SamplingParams (Config.generation_config, as vLLM)."""
        return self.config.default_sampling_params()

    def generate(self, *args, **kwargs) -> list[dict]:
        self._check_ready("generate")
        return super().generate(*args, **kwargs)

    def add_request(self, *args, **kwargs) -> int:
        self._check_ready("add_request")
        return super().add_request(*args, **kwargs)

    def step(self) -> tuple[list, int]:
        self._check_ready("step")
        return super().step()

    # ---- LoRA adapters (vLLM's add_lora, remove_lora, list_loras) ------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter ahead of its requests; False when it already is."""
        self._check_running()
        lora_request_list(lora_request, 1, self.loras is not None)  # its type, enable_lora
        return self.loras.register([lora_request]) > 0

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (weights, slot, cached prefixes); False when unknown."""
        self._check_running()
        if self.loras is None or lora_int_id not in self.loras.requests:
            return False
        if any(seq.lora_int_id == lora_int_id for seq in (*self.scheduler.running,
                                                           *self.scheduler.waiting)):
            raise RuntimeError(f"remove_lora({lora_int_id}): requests of that adapter are "
                               f"still queued")
        self.loras.remove(lora_int_id)
        self.scheduler.block_manager.forget_lora(lora_int_id)
        return True

    def list_loras(self) -> list[int]:
        """The registered adapters' ids."""
        return [] if self.loras is None else list(self.loras.requests)

    # ---- weights and memory, between rollouts -------------------------------------------
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (checkpoint name, tensor) pairs in place; drops the prefix cache (old K/V),
        also when a bad pair stops it part way (the pairs before it are loaded)."""
        self._check_idle("update_weights")
        if self._sleep_level:
            raise RuntimeError("update_weights() while asleep: call wake_up() first")
        items, filled = iter(weights), set()
        try:
            while batch := list(islice(items, WEIGHTS_PER_COMMAND)):
                if not all(isinstance(item, tuple | list) and len(item) == 2
                           and isinstance(item[1], torch.Tensor) for item in batch):
                    raise ValueError("update_weights() takes (name, torch.Tensor) pairs")
                filled |= check_weight_names(self.model_runner.model, batch)
                specs = [(name, tuple(t.shape), t.dtype) for name, t in batch]
                self.executor.execute("update_weights", specs, weights=[t for _, t in batch])
        finally:
            self.scheduler.reset_prefix_cache()
        self._unfilled -= filled

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool, CUDA graphs and weights (level 1: to host memory; 2: dropped)."""
        if level not in (1, 2):
            raise ValueError(f"level={level!r} is invalid: expected 1 or 2")
        self._check_idle("sleep")
        if self._sleep_level:
            raise RuntimeError(f"already asleep (level {self._sleep_level})")
        self.executor.execute("sleep", level)
        self.scheduler.reset_prefix_cache()  # the cached K/V is gone
        self._sleep_level = level

    def wake_up(self) -> None:
        """Take the GPU memory back (a no-op when awake)."""
        if not self._sleep_level:
            return
        self._check_idle("wake_up")
        self.executor.execute("wake_up")
        if self._sleep_level == 2:  # until update_weights has refilled every parameter
            self._unfilled = {id(p) for p in self.model_runner.model.parameters()}
        self._sleep_level = 0

    def _check_idle(self, what: str) -> None:
        self._check_running()
        if self._has_work():
            raise RuntimeError(f"{what}() needs an idle engine: requests are still queued")

    def _check_ready(self, what: str) -> None:
        if getattr(self, "_sleep_level", 0):
            raise RuntimeError(f"{what}() while asleep (level {self._sleep_level}): call "
                               f"wake_up() first")
        if getattr(self, "_unfilled", None):
            raise RuntimeError(f"{what}() after sleep(level=2) and wake_up(): the weights were "
                               f"dropped; call update_weights() first")


def _needs_one_engine(name: str):
    """A method DataParallelLLM refuses: it acts on one engine's queue, weights or memory."""
    def refuse(self, *args, **kwargs):
        raise NotImplementedError(
            f"{name}() is not supported with data parallelism (data_parallel_size="
            f"{self.data_parallel_size}): each replica is an engine of its own in a Ray actor; "
            f"use generate(), chat(), stats(), reset_stats(), reset_prefix_cache(), shutdown()")
    refuse.__name__ = name
    return refuse


class DataParallelLLM(LLM):
    """`LLM(model, data_parallel_size=N, **kwargs)`: generate() and chat() over N whole engines
    in Ray actors (data_parallel.engine); what acts on one engine raises NotImplementedError."""

    def __init__(self, model: str, data_parallel_size: int = 1, **kwargs):
        self.data_parallel_size = data_parallel_size
        self.engine = DataParallelEngine(model, data_parallel_size, **kwargs)
        self.tokenizer, self.replica_info = self.engine.tokenizer, self.engine.replica_info

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | Callable = True,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None
                 ) -> list[dict]:
        return self.engine.generate(prompts, sampling_params, use_tqdm, lora_request)

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.config.default_sampling_params()

    def stats(self) -> dict:
        """The replicas' counters summed, each replica's own under "replicas"."""
        return self.engine.stats()

    def reset_stats(self, timeline: bool = False) -> None:
        self.engine.reset_stats(timeline)

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()

    add_request = _needs_one_engine("add_request")
    add_lora = _needs_one_engine("add_lora")
    remove_lora = _needs_one_engine("remove_lora")
    list_loras = _needs_one_engine("list_loras")
    step = _needs_one_engine("step")
    abort_request = _needs_one_engine("abort_request")
    new_tokens = _needs_one_engine("new_tokens")
    is_finished = _needs_one_engine("is_finished")
    request_limits = _needs_one_engine("request_limits")
    update_weights = _needs_one_engine("update_weights")
    sleep = _needs_one_engine("sleep")
    wake_up = _needs_one_engine("wake_up")

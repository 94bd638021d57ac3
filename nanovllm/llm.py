"""The public facade."""
from nanovllm.engine.data_parallel import check_data_parallel_size
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.validation import Conversation, as_conversation_list
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.tokenizer import chat_prompt_ids


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

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[dict]:
        """Answer one conversation or a list of them through the tokenizer's chat template.

        A conversation is a list of {"role", "content"} dicts; returns what generate() does.
        """
        return self.generate(chat_prompt_ids(self.tokenizer, as_conversation_list(messages)),
                             sampling_params, use_tqdm)

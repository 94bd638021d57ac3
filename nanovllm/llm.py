"""The public facade."""
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.validation import Conversation, as_conversation_list
from nanovllm.sampling_params import SamplingParams


class LLM(LLMEngine):
    """An offline LLM: `LLM(path, **config).generate(prompts, SamplingParams(...))`."""

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[dict]:
        """Answer one conversation or a list of them through the tokenizer's chat template.

        A conversation is a list of {"role", "content"} dicts; returns what generate() does.
        """
        messages = as_conversation_list(messages)
        if self.tokenizer.chat_template is None:
            raise ValueError(f"the tokenizer of {self.config.model!r} has no chat template")
        # The template's text already holds any special tokens: encode it without adding more.
        prompts = [self.tokenizer.encode(
            self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False) for conv in messages]
        return self.generate(prompts, sampling_params, use_tqdm)

"""The public facade."""
from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    """An offline LLM: `LLM(path, **config).generate(prompts, SamplingParams(...))`."""

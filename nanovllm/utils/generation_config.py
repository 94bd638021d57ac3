"""The sampling defaults of a checkpoint's generation_config.json (vLLM's generation_config)."""
import json
import os

# Each, where the file sets it, is the default of a request that does not. vLLM also takes
# max_new_tokens as max_tokens' default; here max_tokens keeps its own (64 offline, the
# server's per route), so that a checkpoint's file cannot shorten every completion unasked.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_generation_config(folder: str) -> dict | None:
    """The folder's generation_config.json, or None where it has none."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def sampling_defaults(model: str, source: str) -> dict:
    """{field: value} that generation_config.json sets among SAMPLING_FIELDS: the model's own
    for source "auto", the directory `source`'s, or none for "vllm" (SamplingParams' own)."""
    if not isinstance(source, str):
        raise ValueError(f"generation_config={source!r} is invalid: expected 'auto', 'vllm' "
                         f"or a directory")
    if source == "vllm":
        return {}
    values = read_generation_config(model if source == "auto" else os.path.expanduser(source))
    if values is None:
        if source == "auto":
            return {}
        raise ValueError(f"generation_config={source!r} is invalid: expected 'auto', 'vllm' "
                         f"or a directory holding generation_config.json")
    return {name: values[name] for name in SAMPLING_FIELDS if values.get(name) is not None}

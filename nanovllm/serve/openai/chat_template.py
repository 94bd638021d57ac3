"""A chat request's conversation through the tokenizer's chat template, with vLLM's options:
add_generation_prompt, continue_final_message, tools, documents, chat_template_kwargs."""
import json

from nanovllm.serve.openai.validation import FieldError
from nanovllm.utils.tokenizer import TEMPLATE_CALL_ARGS

# Keys chat_template_kwargs may not set: a request's own template (vLLM refuses it unless the
# server trusts requests' templates; this one never does) and the call's own arguments.
REFUSED_TEMPLATE_KEYS = ("chat_template", *TEMPLATE_CALL_ARGS)


def template_messages(body) -> list[dict]:
    """The messages as a template reads them: an assistant's tool call arguments as objects,
    not JSON text (vLLM parses them, so that `| tojson` renders them once)."""
    messages = [m.as_dict() for m in body.messages]
    for i, message in enumerate(messages):
        if message["role"] != "assistant":  # vLLM parses an assistant's calls only
            continue
        for j, call in enumerate(message.get("tool_calls") or ()):
            function = call.get("function")
            if not isinstance(function, dict):
                continue
            arguments = function.get("arguments")
            if not arguments:  # None or "": no arguments (vLLM)
                function["arguments"] = {}
            elif isinstance(arguments, str):
                try:
                    function["arguments"] = json.loads(arguments)
                except json.JSONDecodeError as e:
                    raise FieldError(f"messages.{i}.tool_calls.{j}.function.arguments",
                                     f"messages.{i}.tool_calls.{j}.function.arguments is not "
                                     f"JSON: {e}") from None
    return messages


def template_kwargs(body) -> dict:
    """The template's keyword arguments: the request's options, then chat_template_kwargs
    over them (vLLM's order)."""
    extra = body.chat_template_kwargs or {}
    refused = next((key for key in REFUSED_TEMPLATE_KEYS if key in extra), None)
    if refused is not None:
        raise FieldError("chat_template_kwargs",
                         f"chat_template_kwargs may not set {refused!r}")
    kwargs = dict(add_generation_prompt=body.add_generation_prompt,
                  continue_final_message=body.continue_final_message,
                  tools=body.template_tools(), documents=body.documents)
    kwargs.update(extra)
    if kwargs["add_generation_prompt"] and kwargs["continue_final_message"]:
        field = ("chat_template_kwargs" if {"add_generation_prompt", "continue_final_message"}
                 & set(extra) else "continue_final_message")
        raise FieldError(field, "Cannot set both continue_final_message and "
                                "add_generation_prompt to true")
    return kwargs


def chat_prompt(tokenizer, body) -> list[int]:
    """The conversation's token ids through the template (special tokens added only if the
    request asks: the template writes them)."""
    if tokenizer.chat_template is None:
        raise ValueError("messages: this model's tokenizer has no chat template")
    messages, kwargs = template_messages(body), template_kwargs(body)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as e:  # a template may raise anything (jinja2's errors, its own)
        raise ValueError(f"messages: the chat template failed: {e}") from None
    return tokenizer.encode(text, add_special_tokens=body.add_special_tokens)

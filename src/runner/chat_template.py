"""A chat as the model's chat template renders it: the messages as the
OpenAI-shaped turns templates are written for, the request's tools, and the
template's extra arguments (``enable_thinking``, ...).

One rendering for a request's prompt and for the next-turn prefill that
guesses the next request's (:mod:`runner.next_turn`): the two must agree
token for token, or the prefill computes a prefix no request asks for.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ipc.messages import ChatMessage, ChatOptions, ToolCall
from runner.vision import content_parts

__all__ = ["RESERVED_TEMPLATE_KWARGS", "render_chat", "render_chat_text", "template_turns"]

RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize",
    "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
    "return_assistant_tokens_mask", "padding", "truncation", "max_length", "tokenizer_kwargs",
})  # fmt: skip
"""Arguments of ``apply_chat_template`` itself: ``chat_template_kwargs`` may
not set them (the template and the call's shape are the server's, not the
client's)."""


def template_turns(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The turns as chat templates expect them: an assistant turn's
    ``tool_calls`` as OpenAI function calls whose ``arguments`` are a dict
    (parsed from the JSON text, as most templates iterate over them), a
    ``tool`` turn with its ``tool_call_id``, an assistant turn's reasoning as
    ``reasoning_content`` (the key Qwen3's and DeepSeek's templates read).

    Raises:
        ValueError: a tool call's arguments are not JSON.
    """
    turns = []
    for message in messages:
        turn: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.images:  # the text with an image part at each image (runner.vision)
            turn["content"] = content_parts(message)
        if message.tool_calls:
            turn["tool_calls"] = [_call(call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            turn["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            turn["name"] = message.name
        if message.reasoning is not None:
            turn["reasoning_content"] = message.reasoning
        turns.append(turn)
    return turns


def render_chat(tokenizer: Any, turns: list[dict[str, Any]], chat: ChatOptions) -> list[int]:
    """The tokens of ``turns`` rendered by the tokenizer's chat template, with
    ``chat``'s tools and template arguments, up to the header of the
    assistant's answer.

    Raises:
        ValueError: ``chat_template_kwargs`` sets one of the call's own
            arguments; what the template itself raises (a template error, a
            role it refuses) comes through as it is.
    """
    kwargs = _template_kwargs(chat)
    return list(tokenizer.apply_chat_template(turns, add_generation_prompt=True, **kwargs))


def render_chat_text(tokenizer: Any, turns: list[dict[str, Any]], chat: ChatOptions) -> str:
    """:func:`render_chat`'s text, not tokenized (a chat with images: the
    image processor expands each image's token in the text first)."""
    kwargs = _template_kwargs(chat)
    text: str = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False,
                                              **kwargs)  # fmt: skip
    return text


def _template_kwargs(chat: ChatOptions) -> dict[str, Any]:
    kwargs = dict(chat.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    if chat.tools:
        kwargs["tools"] = chat.tools
    return kwargs


def _call(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments) if call.arguments.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"the arguments of tool call {call.id!r} ({call.name}) "
                         f"are not JSON: {exc}") from None  # fmt: skip
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": arguments}}  # fmt: skip

"""A model's configured defaults applied to one request: the sampling
parameters the client left unset (``temperature``, ``top_p``, ...,
``default_max_tokens``) and a system prompt for a chat that has none. Every
front's request passes here (the registry's generate path), so a reload that
changes them applies to the next request of every API at once. Pure: no
runners, no event loop."""

from __future__ import annotations

from typing import Any

import msgspec

from ipc.messages import ChatMessage, GenerateRequest, SamplingParams
from supervisor.config import SAMPLING_DEFAULTS, ModelConfig

DEFAULTED_KEYS = (*SAMPLING_DEFAULTS, "max_tokens")
"""The fields of :class:`SamplingParams` a model's config may give defaults for."""
_BUILTIN = SamplingParams()


def given(**fields: object) -> tuple[str, ...]:
    """The names of ``fields`` that are not None: what a request's body set
    (a front passes its body's values under SamplingParams' names)."""
    return tuple(name for name, value in fields.items() if value is not None)


def chosen_by_client(request: GenerateRequest) -> set[str]:
    """The sampling fields the client chose: its ``sampling_given``, or for a
    client that does not say, those that differ from SamplingParams' defaults."""
    if request.sampling_given is not None:
        return set(request.sampling_given)
    return {key for key in DEFAULTED_KEYS
            if getattr(request.sampling, key) != getattr(_BUILTIN, key)}  # fmt: skip


def with_model_defaults(request: GenerateRequest, spec: ModelConfig) -> GenerateRequest:
    """``request`` with ``spec``'s sampling defaults in the fields the client
    did not choose, and ``spec``'s system prompt first in a chat that has no
    system message (a raw prompt is left as it is). The request itself when
    nothing applies."""
    chosen = chosen_by_client(request)
    updates: dict[str, Any] = {
        key: getattr(spec, key)
        for key in SAMPLING_DEFAULTS
        if key not in chosen and getattr(spec, key) is not None
    }
    if spec.default_max_tokens is not None and "max_tokens" not in chosen:
        updates["max_tokens"] = spec.default_max_tokens
    messages = with_system_prompt(request.messages, spec.system_prompt)
    if not updates and messages is request.messages:
        return request
    sampling = msgspec.structs.replace(request.sampling, **updates)
    return msgspec.structs.replace(request, sampling=sampling, messages=messages)


def with_system_prompt(
    messages: list[ChatMessage] | None, system_prompt: str | None
) -> list[ChatMessage] | None:
    """``messages`` with ``system_prompt`` first, unless there is none, the
    request is a raw prompt (None), or a system message is there already (the
    fronts give OpenAI's ``developer`` and Anthropic's ``system`` this role)."""
    if messages is None or system_prompt is None:
        return messages
    if any(message.role == "system" for message in messages):
        return messages
    return [ChatMessage("system", system_prompt), *messages]

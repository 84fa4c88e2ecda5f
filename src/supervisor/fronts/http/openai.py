"""The OpenAI API's shapes: the request bodies of chat and text completions,
the one request they translate into, and the objects of a reply (whole, or
chunk by chunk while it streams). What cannot be honoured (images, n > 1,
several prompts) is a 400 that names the field.
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from ipc.messages import ChatMessage, GenerationDone, SamplingParams
from supervisor import __version__
from supervisor.fronts.http.errors import ApiError
from supervisor.registry.registry import MAX_STOP_CHARS, MAX_STOP_STRINGS

OWNER = "mlx-supervisor"
ENCODER = msgspec.json.Encoder()

# Our finish reasons as OpenAI's (ours is also sent, in the "supervisor" field).
FINISH_REASONS = {
    "stop": "stop",
    "length": "length",
    "memory_pressure": "length",  # cut short for want of memory, as for want of room
    "cancelled": "stop",
    "error": "stop",
}


# --- request bodies --------------------------------------------------------------
# Unknown fields are ignored: clients send many (tools, logprobs, user, ...).

MaxTokens = Annotated[int, Meta(ge=1, le=1 << 31)]


class TextPart(msgspec.Struct):
    """One part of a message's content; only text parts are understood."""

    type: str
    text: str | None = None


class ChatTurn(msgspec.Struct):
    role: str
    content: str | list[TextPart] | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class CompletionFields(msgspec.Struct, kw_only=True):
    """What chat and text completions share."""

    model: str
    max_tokens: MaxTokens | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None


class ChatCompletionRequest(CompletionFields, kw_only=True):
    messages: list[ChatTurn]
    max_completion_tokens: MaxTokens | None = None


class CompletionRequest(CompletionFields, kw_only=True):
    prompt: str | list[str]


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """``stop`` as the runner takes it. Raises ApiError."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS or not all(0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise ApiError(
            400, f"stop takes up to {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_CHARS} "
            "characters", param="stop", code="bad_request",
        )  # fmt: skip
    return tuple(stops)


def chat_messages(turns: list[ChatTurn]) -> list[ChatMessage]:
    """The turns as the runner takes them: text content only. Raises ApiError."""
    if not turns:
        raise ApiError(400, "messages is empty", param="messages", code="bad_request")
    messages = []
    for turn in turns:
        content = turn.content
        if isinstance(content, list):
            kinds = {part.type for part in content} - {"text"}
            if kinds:
                raise ApiError(
                    400, f"only text content is supported, not {', '.join(sorted(kinds))}",
                    param="messages", code="bad_request",
                )  # fmt: skip
            content = "".join(part.text or "" for part in content)
        messages.append(ChatMessage(turn.role, content or ""))
    return messages


# --- answers -----------------------------------------------------------------------


class Reply:
    """The OpenAI objects of one completion: its chunks while it streams, or
    the whole of it at the end."""

    def __init__(self, chat: bool, model: str, include_usage: bool) -> None:
        self.chat = chat
        self.model = model
        self.include_usage = include_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def _object(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": f"{OWNER}-{__version__}",
            "choices": choices,
            **extra,
        }

    def _chunk(self, choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        choice = {"index": 0, **choice, "logprobs": None}
        if self.include_usage:
            extra.setdefault("usage", None)
        return self._object(kind, [choice], **extra)

    def role_chunk(self) -> dict[str, Any] | None:
        """The first chunk of a chat stream (None for text completions)."""
        if not self.chat:
            return None
        return self._chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})

    def text_chunk(self, text: str) -> dict[str, Any]:
        part = {"delta": {"content": text}} if self.chat else {"text": text}
        return self._chunk({**part, "finish_reason": None})

    def end_chunk(self, done: GenerationDone) -> dict[str, Any]:
        part: dict[str, Any] = {"delta": {}} if self.chat else {"text": ""}
        return self._chunk(
            {**part, "finish_reason": FINISH_REASONS[done.finish_reason]},
            supervisor=self._ours(done),
        )

    def usage_chunk(self, done: GenerationDone) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._object(kind, [], usage=usage(done))

    def whole(self, text: str, done: GenerationDone) -> dict[str, Any]:
        finish = FINISH_REASONS[done.finish_reason]
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": finish, "logprobs": None}  # fmt: skip
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        kind = "chat.completion" if self.chat else "text_completion"
        return self._object(kind, [choice], usage=usage(done), supervisor=self._ours(done))

    @staticmethod
    def _ours(done: GenerationDone) -> dict[str, Any]:
        """What OpenAI's objects have no field for."""
        return {
            "finish_reason": done.finish_reason,
            "detail": done.detail,
            "ttft_s": round(done.ttft_s, 4),
            "prompt_tps": round(done.prompt_tps, 1),
            "generation_tps": round(done.generation_tps, 1),
            "batched": done.batched,
            "max_tokens_clamped_to": done.max_tokens_clamped_to,
        }


def usage(done: GenerationDone) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.generation_tokens,
        "total_tokens": done.prompt_tokens + done.generation_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


class CompletionCall(msgspec.Struct, kw_only=True):
    """A completion request, checked, waiting for its model."""

    chat: bool
    model: str
    messages: list[ChatMessage] | None
    prompt: str | None
    max_tokens: int | None
    sampling: SamplingParams
    stream: bool
    include_usage: bool


def completion_call(body: ChatCompletionRequest | CompletionRequest) -> CompletionCall:
    """The request a chat or text completion's body asks for, checked.
    Raises ApiError."""
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    max_tokens: int | None
    chat = isinstance(body, ChatCompletionRequest)
    if isinstance(body, ChatCompletionRequest):
        messages = chat_messages(body.messages)
        max_tokens = body.max_completion_tokens or body.max_tokens
    else:
        if isinstance(body.prompt, list):
            if len(body.prompt) != 1:
                raise ApiError(400, "give one prompt per request", param="prompt",
                               code="bad_request")  # fmt: skip
            prompt = body.prompt[0]
        else:
            prompt = body.prompt
        max_tokens = body.max_tokens
    if body.n not in (None, 1):
        raise ApiError(400, "only n = 1 is supported", param="n", code="bad_request")
    defaults = SamplingParams()
    sampling = SamplingParams(
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        seed=body.seed,
        stop=stop_strings(body.stop),
    )
    options = body.stream_options
    return CompletionCall(
        chat=chat, model=body.model, messages=messages, prompt=prompt,
        max_tokens=max_tokens, sampling=sampling, stream=bool(body.stream),
        include_usage=bool(options is not None and options.include_usage),
    )  # fmt: skip

"""The OpenAI API's reply objects: a completion's whole answer, or its
chunks while it streams (:class:`Reply`), with their logprobs, tool calls
and usage; and the error that ends an answer whose tool call the model broke.
The request bodies live in :mod:`supervisor.fronts.http.openai_requests`.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from ipc.messages import GenerationDone, TextChunk, TokenLogprob, ToolCall
from supervisor import __version__
from supervisor.fronts.http.dialect import CompletionCall
from supervisor.fronts.http.errors import ENCODER, ApiError
from supervisor.fronts.http.streaming import sse

__all__ = [
    "ENCODER", "OWNER", "OpenAIAnswer", "Reply", "broken_tool_call", "supervisor_fields", "usage",
]  # fmt: skip

OWNER = "mlx-supervisor"

# Our finish reasons as OpenAI's (ours is also sent, in the "supervisor" field).
FINISH_REASONS = {
    "stop": "stop",
    "length": "length",
    "memory_pressure": "length",  # cut short for want of memory, as for want of room
    "cancelled": "stop",
    "error": "stop",
    "tool_calls": "tool_calls",
}

CUT_SHORT = ("length", "memory_pressure", "cancelled")  # ended by us, not by the model


def token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="surrogatepass"))


def entry_bytes(entry: TokenLogprob) -> list[int]:
    """The token's own bytes: as the runner sent them for a token that holds
    part of a character, else its text's UTF-8."""
    return entry.bytes if entry.bytes is not None else token_bytes(entry.token)


def chat_logprob(entry: TokenLogprob) -> dict[str, Any]:
    """One token's entry of a chat answer's ``logprobs.content``."""
    top_bytes = entry.top_bytes or [None] * len(entry.top)
    top = [{"token": t, "logprob": p, "bytes": b if b is not None else token_bytes(t)}
           for (t, p), b in zip(entry.top, top_bytes, strict=False)]  # fmt: skip
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": entry_bytes(entry),
        "top_logprobs": top,
    }


class TextLogprobs:
    """A text completion's ``logprobs`` (the legacy API's four parallel
    lists); ``text_offset`` counts characters from the completion's start."""

    def __init__(self) -> None:
        self.answer = b""  # the completion's bytes so far

    def of(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        offsets = []
        for entry in entries:
            # Characters before this token: a token that ends mid-character adds
            # none until the token that completes it.
            offsets.append(len(self.answer.decode("utf-8", errors="ignore")))
            self.answer += bytes(entry_bytes(entry))
        return {
            "tokens": [entry.token for entry in entries],
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [likeliest_by_text(entry.top) for entry in entries],
            "text_offset": offsets,
        }


def likeliest_by_text(top: list[tuple[str, float]]) -> dict[str, float]:
    """Alternatives keyed by their text, as the legacy API has them: of
    tokens that decode to the same string (a byte-level BPE has such pairs),
    the likeliest one's logprob."""
    likeliest: dict[str, float] = {}
    for token, logprob in top:
        if token not in likeliest or logprob > likeliest[token]:
            likeliest[token] = logprob
    return likeliest


def tool_call_object(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """An OpenAI tool call; ``index`` in a stream's delta."""
    shown = {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}  # fmt: skip
    return shown if index is None else {"index": index, **shown}


class Reply:
    """The OpenAI objects of one completion: its chunks while it streams, or
    the whole of it at the end (:meth:`add` gathers the parts either way).

    Args:
        chat: a chat completion (else a text completion).
        model: the model's name, as the reply gives it.
        include_usage: a stream ends with a usage chunk.
        logprobs: the request asked for logprobs.
    """

    def __init__(self, chat: bool, model: str, include_usage: bool, logprobs: bool = False) -> None:
        self.chat = chat
        self.model = model
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: list[ToolCall] = []
        self.token_logprobs: list[TokenLogprob] = []
        self._text_logprobs = TextLogprobs()
        self.started = False  # a stream's role chunk is out

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

    def _chunk(self, choice: dict[str, Any], logprobs: Any = None, **extra: Any) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        choice = {"index": 0, **choice, "logprobs": logprobs}
        if self.include_usage:
            extra.setdefault("usage", None)
        return self._object(kind, [choice], **extra)

    def add(self, chunk: TextChunk, limit_calls: int | None = None) -> dict[str, Any] | None:
        """Gather a frame's parts; the stream chunk that carries them (None
        if they are empty). ``limit_calls``: keep at most this many tool
        calls in all (``parallel_tool_calls`` false)."""
        calls = chunk.tool_calls or []
        if limit_calls is not None:
            calls = calls[: max(0, limit_calls - len(self.tool_calls))]
        first_call = len(self.tool_calls)
        self.content.append(chunk.text)
        self.reasoning.append(chunk.reasoning)
        self.tool_calls += calls
        entries = chunk.logprobs or []
        self.token_logprobs += entries
        if not (chunk.text or chunk.reasoning or calls or entries):
            return None
        logprobs = None
        if entries:
            logprobs = ({"content": [chat_logprob(e) for e in entries]} if self.chat
                        else self._text_logprobs.of(entries))  # fmt: skip
        if not self.chat:
            return self._chunk({"text": chunk.text, "finish_reason": None}, logprobs)
        delta: dict[str, Any] = {}
        if chunk.reasoning:
            delta["reasoning_content"] = chunk.reasoning
        if chunk.text:
            delta["content"] = chunk.text
        if calls:
            delta["tool_calls"] = [tool_call_object(call, first_call + i)
                                   for i, call in enumerate(calls)]  # fmt: skip
        return self._chunk({"delta": delta, "finish_reason": None}, logprobs)

    def role_chunk(self) -> dict[str, Any] | None:
        """The first chunk of a chat stream (None for text completions, or
        once sent)."""
        if not self.chat or self.started:
            return None
        self.started = True
        return self._chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})

    def finish_reason(self, done: GenerationDone) -> str:
        if self.tool_calls and done.finish_reason in ("stop", "cancelled", "tool_calls"):
            return "tool_calls"  # cancelled: cut at its first call (parallel_tool_calls false)
        return FINISH_REASONS[done.finish_reason]

    def end_chunk(self, done: GenerationDone) -> dict[str, Any]:
        part: dict[str, Any] = {"delta": {}} if self.chat else {"text": ""}
        return self._chunk(
            {**part, "finish_reason": self.finish_reason(done)}, supervisor=supervisor_fields(done)
        )

    def usage_chunk(self, done: GenerationDone) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._object(kind, [], usage=usage(done))

    def whole(self, done: GenerationDone) -> dict[str, Any]:
        """The whole answer, from the parts :meth:`add` gathered."""
        finish = self.finish_reason(done)
        text = "".join(self.content)
        logprobs: dict[str, Any] | None = None
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.tool_calls:
                message["content"] = text or None
                message["tool_calls"] = [tool_call_object(call) for call in self.tool_calls]
            if reasoning := "".join(self.reasoning):
                message["reasoning_content"] = reasoning
            if self.logprobs:
                logprobs = {"content": [chat_logprob(e) for e in self.token_logprobs]}
            choice = {"index": 0, "message": message, "finish_reason": finish,
                      "logprobs": logprobs}  # fmt: skip
        else:
            if self.logprobs:
                logprobs = TextLogprobs().of(self.token_logprobs)
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}
        kind = "chat.completion" if self.chat else "text_completion"
        return self._object(kind, [choice], usage=usage(done), supervisor=supervisor_fields(done))


class OpenAIAnswer:
    """A chat or text completion's :class:`Reply` as the request path takes
    an answer: a stream opens with the role chunk and ends with the finish
    chunk, the usage chunk when asked for, and ``[DONE]``."""

    def __init__(self, call: CompletionCall, model: str) -> None:
        self.stream = call.stream
        self.reply = Reply(call.chat, model, call.include_usage, call.sampling.logprobs)

    @property
    def tool_call_count(self) -> int:
        return len(self.reply.tool_calls)

    def _opening(self) -> list[bytes]:
        role = self.reply.role_chunk()
        return [] if role is None else [sse(ENCODER.encode(role))]

    def add(self, chunk: TextChunk, limit_calls: int | None = None) -> list[bytes]:
        part = self.reply.add(chunk, limit_calls)
        if not self.stream or part is None:
            return []
        return [*self._opening(), sse(ENCODER.encode(part))]

    def end(self, done: GenerationDone) -> list[bytes]:
        events = [*self._opening(), sse(ENCODER.encode(self.reply.end_chunk(done)))]
        if self.reply.include_usage:
            events.append(sse(ENCODER.encode(self.reply.usage_chunk(done))))
        return [*events, sse(b"[DONE]")]

    def whole(self, done: GenerationDone) -> bytes:
        return ENCODER.encode(self.reply.whole(done))


def supervisor_fields(done: GenerationDone) -> dict[str, Any]:
    """What an API's objects have no field for, in their ``supervisor``
    field: our finish reason and its detail, the request's timings, and
    ``invalid_tool_call``, the text of a tool call that max_tokens cut short."""
    ours = {
        "finish_reason": done.finish_reason,
        "detail": done.detail,
        "ttft_s": round(done.ttft_s, 4),
        "prompt_tps": round(done.prompt_tps, 1),
        "generation_tps": round(done.generation_tps, 1),
        "batched": done.batched,
        "max_tokens_clamped_to": done.max_tokens_clamped_to,
    }
    if done.draft_tokens:  # speculative decoding: the draft's tokens checked and kept
        ours["draft_tokens"] = done.draft_tokens
        ours["draft_accepted"] = done.draft_accepted
    if done.invalid_tool_call is not None:
        ours["invalid_tool_call"] = done.invalid_tool_call
    return ours


def usage(done: GenerationDone) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.generation_tokens,
        "total_tokens": done.prompt_tokens + done.generation_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": done.reasoning_tokens},
    }


def broken_tool_call(done: GenerationDone) -> ApiError | None:
    """The error that ends an answer whose tool call the model broke (its
    text does not parse): a 500 ``invalid_tool_call``, as OpenAI answers "the
    model produced invalid content", so that no client takes the answer for a
    plain one. A call that max_tokens cut short is not an error: the answer
    ends with ``finish_reason`` "length" and the text in
    ``supervisor.invalid_tool_call``; nor is one a cancel cut (the client
    left, or the answer ended at its first call)."""
    if done.invalid_tool_call is None or done.finish_reason in CUT_SHORT:
        return None
    return ApiError(
        500, f"the model wrote a tool call that does not parse: {done.invalid_tool_call!r}",
        type="server_error", code="invalid_tool_call",
    )  # fmt: skip

"""The Anthropic Messages API's replies: a message whole, or the named
server-sent events of its stream (:class:`MessagesAnswer`), and its error
objects (:class:`AnthropicFraming`). The request bodies live in
:mod:`supervisor.fronts.http.messages_api`.

A message's content is a list of blocks in the order the model wrote them:
its thinking (a ``thinking`` block, whose ``signature`` is empty: there is
no Anthropic key to sign it with), its text, then one ``tool_use`` block per
tool call. A stream opens and closes the same blocks, with increasing
indexes: a block ends when the next kind begins.
"""

from __future__ import annotations

import secrets
from typing import Any, Literal

import msgspec

from ipc.messages import FinishReason, GenerationDone, TextChunk, ToolCall
from supervisor.fronts.http.dialect import CompletionCall
from supervisor.fronts.http.errors import ENCODER, ApiError
from supervisor.fronts.http.streaming import named_sse

BlockKind = Literal["thinking", "text", "tool_use"]

# Our finish reasons as Anthropic's stop reasons (a stop string: "stop_sequence").
STOP_REASONS: dict[FinishReason, str] = {
    "stop": "end_turn",
    "length": "max_tokens",
    "memory_pressure": "max_tokens",  # cut short for want of memory, as for want of room
    "cancelled": "end_turn",
    "error": "end_turn",
    "tool_calls": "tool_use",
}

# Anthropic's error type for each HTTP status we answer with (our statuses
# are kept: a 503 is an overloaded_error that says 503, not Anthropic's 529).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_type(error: ApiError) -> str:
    """Anthropic's error type for ``error``: by its status (the others,
    ``invalid_request_error`` under 500 and ``api_error`` from 500)."""
    found = ERROR_TYPES.get(error.status)
    if found is not None:
        return found
    return "invalid_request_error" if error.status < 500 else "api_error"


class AnthropicFraming:
    """Anthropic's: named events (``event: NAME``), comments as keep-alives
    (clients skip them, as they skip Anthropic's ``ping``), and
    ``{"type": "error", "error": {"type", "message"}}``."""

    media_type = "text/event-stream; charset=utf-8"

    def comment(self, text: str) -> bytes | None:
        return f": {text}\n\n".encode()

    def error_body(self, error: ApiError) -> bytes:
        body = {"type": "error", "error": {"type": error_type(error), "message": error.message}}
        return ENCODER.encode(body)

    def error_event(self, error: ApiError, call: object = None) -> bytes:
        return named_sse("error", self.error_body(error))


ANTHROPIC = AnthropicFraming()

Event = tuple[str, dict[str, Any]]


class Block:
    """One content block of the answer as it grows: a thinking or text
    block's pieces, or a tool call with its parsed input."""

    def __init__(self, index: int, kind: BlockKind, call: ToolCall | None = None) -> None:
        self.index = index
        self.kind = kind
        self.pieces: list[str] = []
        self.call = call
        self.input = tool_input(call) if call is not None else None

    def opened(self) -> dict[str, Any]:
        """The block as ``content_block_start`` gives it: empty."""
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": "", "signature": ""}
        if self.kind == "text":
            return {"type": "text", "text": ""}
        assert self.call is not None
        return {"type": "tool_use", "id": self.call.id, "name": self.call.name, "input": {}}

    def delta(self, piece: str) -> dict[str, Any]:
        """A ``content_block_delta`` event's ``delta`` for ``piece``."""
        if self.kind == "thinking":
            return {"type": "thinking_delta", "thinking": piece}
        if self.kind == "text":
            return {"type": "text_delta", "text": piece}
        return {"type": "input_json_delta", "partial_json": piece}

    def whole(self) -> dict[str, Any]:
        """The block as the whole message gives it."""
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": "".join(self.pieces), "signature": ""}
        if self.kind == "text":
            return {"type": "text", "text": "".join(self.pieces)}
        return {**self.opened(), "input": self.input}


def tool_input(call: ToolCall) -> dict[str, Any]:
    """A tool call's arguments as a ``tool_use`` block's ``input`` (an
    object). Raises ApiError (500 ``invalid_tool_call``) for arguments that
    are not a JSON object, as for a call that does not parse."""
    try:
        parsed = msgspec.json.decode(call.arguments) if call.arguments.strip() else {}
    except msgspec.DecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ApiError(
            500, f"the model's call of {call.name} has arguments that are not a JSON object: "
            f"{call.arguments!r}", type="server_error", code="invalid_tool_call",
        )  # fmt: skip
    return parsed


def prompt_usage(prompt_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """Anthropic's input counts: ``input_tokens`` are the prompt tokens
    computed, those taken from the prefix cache are
    ``cache_read_input_tokens`` (our cache fills itself: nothing is ever
    billed as written to it)."""
    return {
        "input_tokens": max(0, prompt_tokens - cached_tokens),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
    }


def usage(done: GenerationDone) -> dict[str, Any]:
    """Anthropic's usage of a whole message: its input counts (see
    :func:`prompt_usage`) and its output tokens, the thinking among them."""
    return {
        **prompt_usage(done.prompt_tokens, done.cached_tokens),
        "output_tokens": done.generation_tokens,
        "output_tokens_details": {"thinking_tokens": done.reasoning_tokens},
    }


class MessagesAnswer:
    """One generation as an Anthropic message: gathered block by block, and,
    when the call streams, framed as Anthropic's events as it goes
    (``message_start``, then each block's ``content_block_start``, deltas and
    ``content_block_stop``, then ``message_delta`` and ``message_stop``).

    ``message_start`` goes out with the first frame, which tells the
    prompt's size: its usage gives the input counts (Claude Code reads the
    context's fill from them) and 0 output tokens; ``message_delta`` gives
    the usage whole.

    Args:
        call: the request.
        model: the model's name, as the message gives it.
        show_thinking: thinking blocks carry the model's thinking (else they
            are empty: ``thinking.display`` "omitted").
        context_management: the request asked for context editing; the
            message (a stream's ``message_delta``) says no edit was applied.
    """

    def __init__(
        self,
        call: CompletionCall,
        model: str,
        show_thinking: bool = True,
        context_management: bool = False,
    ) -> None:
        self.stream = call.stream
        self.model = model
        self.show_thinking = show_thinking
        # Asked for context editing: the message says none was applied.
        self.edits: dict[str, Any] = {"context_management": {"applied_edits": []}} if (
            context_management) else {}  # fmt: skip
        self.id = "msg_" + secrets.token_hex(12)
        self.blocks: list[Block] = []
        self.tool_calls: list[ToolCall] = []
        self.open: Block | None = None  # the block that takes the next deltas of its kind
        self.started = False  # a stream's message_start is out
        self.prompt: tuple[int, int] | None = None  # prompt tokens, those of them cached

    @property
    def tool_call_count(self) -> int:
        return len(self.tool_calls)

    def add(self, chunk: TextChunk, limit_calls: int | None = None) -> list[bytes]:
        calls = chunk.tool_calls or []
        if limit_calls is not None:
            calls = calls[: max(0, limit_calls - len(self.tool_calls))]
        if chunk.prompt_tokens is not None and self.prompt is None:
            self.prompt = (chunk.prompt_tokens, chunk.cached_tokens or 0)
        events: list[Event] = []
        if chunk.reasoning:
            events += self._extend("thinking", chunk.reasoning if self.show_thinking else "")
        if chunk.text:
            events += self._extend("text", chunk.text)
        for call in calls:
            events += self._tool_use(call)
        if not self.stream:
            return []
        return self._framed([*self._opening(), *events])  # the first frame opens the message

    def end(self, done: GenerationDone) -> list[bytes]:
        reason = self.stop_reason(done)
        self.prompt = self.prompt or (done.prompt_tokens, done.cached_tokens)
        events = [*self._opening(), *self._close()]
        events.append(("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": stop_sequence(reason, done)},
            "usage": usage(done), **self.edits,
        }))  # fmt: skip
        events.append(("message_stop", {"type": "message_stop"}))
        return self._framed(events)

    def whole(self, done: GenerationDone) -> bytes:
        reason = self.stop_reason(done)
        message = self._message([block.whole() for block in self.blocks])
        message |= {"stop_reason": reason, "stop_sequence": stop_sequence(reason, done),
                    "usage": usage(done), **self.edits}  # fmt: skip
        return ENCODER.encode(message)

    def stop_reason(self, done: GenerationDone) -> str:
        """Why the message ended, in Anthropic's words. Cancelled with tool
        calls: cut at its first call (``disable_parallel_tool_use``)."""
        if self.tool_calls and done.finish_reason in ("stop", "cancelled", "tool_calls"):
            return "tool_use"
        if done.finish_reason == "stop" and done.stop_string is not None:
            return "stop_sequence"
        return STOP_REASONS[done.finish_reason]

    # --- blocks and their events ------------------------------------------------

    def _message(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content}  # fmt: skip

    def _opening(self) -> list[Event]:
        if self.started:
            return []
        self.started = True
        counts = prompt_usage(*self.prompt) if self.prompt else prompt_usage(0, 0)
        start_usage = {**counts, "output_tokens": 0}
        message = self._message([]) | {"stop_reason": None, "stop_sequence": None,
                                       "usage": start_usage}  # fmt: skip
        return [("message_start", {"type": "message_start", "message": message})]

    def _close(self) -> list[Event]:
        """End the open block, if any."""
        if self.open is None:
            return []
        index, self.open = self.open.index, None
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _start(self, kind: BlockKind, call: ToolCall | None = None) -> tuple[Block, list[Event]]:
        """A new block of ``kind``, after closing the open one."""
        events = self._close()
        block = Block(len(self.blocks), kind, call)
        self.blocks.append(block)
        self.open = block
        start = {"type": "content_block_start", "index": block.index,
                 "content_block": block.opened()}  # fmt: skip
        return block, [*events, ("content_block_start", start)]

    def _delta(self, block: Block, piece: str) -> Event:
        block.pieces.append(piece)
        return ("content_block_delta", {"type": "content_block_delta", "index": block.index,
                                        "delta": block.delta(piece)})  # fmt: skip

    def _extend(self, kind: BlockKind, piece: str) -> list[Event]:
        """``piece`` added to the open block of ``kind``, or to a new one."""
        events: list[Event] = []
        block = self.open
        if block is None or block.kind != kind:
            block, events = self._start(kind)
        if piece:
            events.append(self._delta(block, piece))
        return events

    def _tool_use(self, call: ToolCall) -> list[Event]:
        """A whole tool call as its own block: its arguments in one delta."""
        block, events = self._start("tool_use", call)
        self.tool_calls.append(call)
        events.append(self._delta(block, call.arguments))
        return [*events, *self._close()]

    def _framed(self, events: list[Event]) -> list[bytes]:
        return [named_sse(name, ENCODER.encode(data)) for name, data in events]


def stop_sequence(reason: str, done: GenerationDone) -> str | None:
    """The stop string that ended the message (``stop_reason`` "stop_sequence")."""
    return done.stop_string if reason == "stop_sequence" else None

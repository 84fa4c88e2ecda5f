"""The Responses API's reply objects: the whole Response, or its stream of
named, numbered events (:class:`ResponsesAnswer`); and its framing, whose
stream error is an ``error`` event numbered after the events before it,
then ``response.failed`` (:class:`ResponsesFraming`). The request bodies
live in :mod:`supervisor.fronts.http.responses_api`.

A response's output is a list of items in the order the model wrote them:
its reasoning (a ``reasoning`` item, the text in ``content``: we keep nothing
secret, and that is what goes back in the next request's ``input``), its
text (a ``message`` item) and each tool call (a ``function_call`` item).
The stream and the whole response are made from the same items, so the
openai client's stream helper rebuilds exactly the response it ends with.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any, Literal

from ipc.messages import GenerationDone, TextChunk, TokenLogprob, ToolCall
from supervisor.fronts.http.dialect import CompletionCall
from supervisor.fronts.http.errors import ENCODER, ApiError
from supervisor.fronts.http.openai_replies import chat_logprob, supervisor_fields
from supervisor.fronts.http.streaming import OpenAIFraming, named_sse

CUT_BY_LENGTH = ("length", "memory_pressure")  # as OpenAI's "max_output_tokens"

ItemKind = Literal["reasoning", "message", "function_call"]
ID_PREFIX: dict[ItemKind, str] = {"reasoning": "rs_", "message": "msg_", "function_call": "fc_"}


class ResponseEvents:
    """One response's identity (id, creation time, model), the request's
    settings its Response object echoes (``echo``), and its stream's events,
    each with the next ``sequence_number`` (none are made when the request
    does not stream). Made when the request is parsed, so that an error
    before the model's first word still ends a stream that opened with
    ``response.created``; ``written`` gives the output items so far (the
    answer sets it), for the ``response.failed`` of an error after them.

    Args:
        model: the model asked for (the answer names the one that served it).
        echo: the request's settings, as the Response object gives them back.
        stream: the request streams.
    """

    def __init__(self, model: str, echo: dict[str, Any], stream: bool) -> None:
        self.id = "resp_" + secrets.token_hex(24)
        self.created_at = int(time.time())
        self.model = model
        self.echo = echo
        self.stream = stream
        self.sequence = 0
        self.opened = False
        self.written: Callable[[], list[dict[str, Any]]] = list

    def response(self, status: str, output: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """The Response object, as it stands at ``status``."""
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "model": self.model,
            "output": output,
            "previous_response_id": None,
            "store": False,
            "usage": None,
            **self.echo,
            **extra,
        }

    def event(self, kind: str, **fields: Any) -> list[bytes]:
        """The stream event ``kind`` with ``fields``, numbered (none when the
        request does not stream)."""
        if not self.stream:
            return []
        data = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return [named_sse(kind, ENCODER.encode(data))]

    def opening(self) -> list[bytes]:
        """``response.created`` and ``response.in_progress``, once."""
        if self.opened:
            return []
        self.opened = True
        shown = self.response("in_progress", [])
        return [*self.event("response.created", response=shown),
                *self.event("response.in_progress", response=shown)]  # fmt: skip

    def failure(self, error: ApiError) -> bytes:
        """``error`` as the stream's ``error`` event (after the opening, if
        the stream has had none), then its end, ``response.failed``, with
        the output written so far: the Responses clients that wait for a
        response's end (Codex) take a stream without one as dropped."""
        self.stream = True  # only a stream has error events
        fields = {"code": error.code, "message": error.message, "param": error.param}
        failed = self.response("failed", self.written(),
                               error={"code": error.code, "message": error.message})  # fmt: skip
        return b"".join([*self.opening(), *self.event("error", **fields),
                         *self.event("response.failed", response=failed)])  # fmt: skip


class ResponsesCall(CompletionCall, kw_only=True):
    """A Responses request's call, with what its reply echoes: ``events``
    holds the response's identity and its request's settings."""

    events: ResponseEvents


class ResponsesFraming(OpenAIFraming):
    """OpenAI's SSE framing and error bodies; a stream's error, though, is
    the Responses API's ``error`` event, numbered in its stream."""

    def error_event(self, error: ApiError, call: object = None) -> bytes:
        if isinstance(call, ResponsesCall):
            return call.events.failure(error)
        events = ResponseEvents("", {}, stream=True)  # no request parsed: no events before it
        events.opened = True
        return events.failure(error)


RESPONSES = ResponsesFraming()


class OutputItem:
    """One item of a response's output, as the model writes it: reasoning or
    a message (text that grows), or a tool call (whole at once)."""

    def __init__(self, kind: ItemKind, index: int, call: ToolCall | None = None) -> None:
        self.kind = kind
        self.index = index
        self.id = ID_PREFIX[kind] + secrets.token_hex(24)
        self.call = call
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.status: str | None = None  # set when the item is done

    def part(self) -> dict[str, Any]:
        """The content part of reasoning or a message, as it stands."""
        text = "".join(self.text)
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        logprobs = [chat_logprob(entry) for entry in self.logprobs]
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def shape(self, status: str, content: bool = True) -> dict[str, Any]:
        """The item at ``status``; without its content (as a stream adds it)
        unless ``content``."""
        shown: dict[str, Any] = {"id": self.id, "type": self.kind}
        if self.kind == "function_call":
            assert self.call is not None
            arguments = self.call.arguments if content else ""
            return {**shown, "call_id": self.call.id, "name": self.call.name,
                    "arguments": arguments, "status": status}  # fmt: skip
        parts = [self.part()] if content else []
        if self.kind == "reasoning":
            return {**shown, "summary": [], "content": parts, "status": status}
        return {**shown, "status": status, "role": "assistant", "content": parts}


class ResponsesAnswer:
    """A Response, made from the generation's frames: whole at the end, or
    as it streams, in the order of events the openai client checks: each
    item added, its content part added, its deltas, its text done, the part
    done, the item done; a tool call's arguments come in one delta.

    Args:
        call: the parsed request (its ``events`` when it is a
            :class:`ResponsesCall`).
        model: the name of the model that answers.
    """

    def __init__(self, call: CompletionCall, model: str) -> None:
        events = call.events if isinstance(call, ResponsesCall) else None
        self.events = events or ResponseEvents(model, {}, call.stream)
        self.events.model = model
        self.events.written = self.written
        self.logprobs = call.sampling.logprobs
        self.items: list[OutputItem] = []
        self.open: OutputItem | None = None  # reasoning or a message, still growing
        self.calls = 0

    @property
    def tool_call_count(self) -> int:
        return self.calls

    def add(self, chunk: TextChunk, limit_calls: int | None = None) -> list[bytes]:
        calls = chunk.tool_calls or []
        if limit_calls is not None:
            calls = calls[: max(0, limit_calls - self.calls)]
        events = self.events.opening()
        if chunk.reasoning:
            events += self._write("reasoning", chunk.reasoning, [])
        if chunk.text:
            # A chunk's logprobs go with its text: this API has no place for
            # those of a thinking model's reasoning tokens.
            events += self._write("message", chunk.text, chunk.logprobs or [])
        for call in calls:
            events += self._call(call)
        return events

    def _write(self, kind: ItemKind, text: str, logprobs: list[TokenLogprob]) -> list[bytes]:
        """``text`` added to the open item of ``kind`` (a new one, after
        closing any other)."""
        events: list[bytes] = []
        item = self.open
        if item is None or item.kind != kind:
            events += self._close("completed")
            item = self.open = self._new(kind)
            events += self.events.event("response.output_item.added", output_index=item.index,
                                        item=item.shape("in_progress", content=False))  # fmt: skip
            empty = OutputItem(kind, item.index).part()
            events += self.events.event("response.content_part.added", **self._where(item),
                                        part=empty)  # fmt: skip
        item.text.append(text)
        item.logprobs += logprobs
        if kind == "reasoning":
            return events + self.events.event("response.reasoning_text.delta",
                                              **self._where(item), delta=text)  # fmt: skip
        shown = [chat_logprob(entry) for entry in logprobs] if self.logprobs else []
        return events + self.events.event("response.output_text.delta", **self._where(item),
                                          delta=text, logprobs=shown)  # fmt: skip

    def _call(self, call: ToolCall) -> list[bytes]:
        """A tool call's item, its arguments and its end."""
        events = self._close("completed")
        item = self._new("function_call", call)
        item.status = "completed"
        self.calls += 1
        where = {"item_id": item.id, "output_index": item.index}
        return [
            *events,
            *self.events.event("response.output_item.added", output_index=item.index,
                               item=item.shape("in_progress", content=False)),
            *self.events.event("response.function_call_arguments.delta", **where,
                               delta=call.arguments),
            *self.events.event("response.function_call_arguments.done", **where,
                               name=call.name, arguments=call.arguments),
            *self.events.event("response.output_item.done", output_index=item.index,
                               item=item.shape("completed")),
        ]  # fmt: skip

    def _close(self, status: str) -> list[bytes]:
        """The open item's end, at ``status``."""
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = status
        part = item.part()
        if item.kind == "reasoning":
            events = self.events.event("response.reasoning_text.done", **self._where(item),
                                       text=part["text"])  # fmt: skip
        else:
            events = self.events.event("response.output_text.done", **self._where(item),
                                       text=part["text"], logprobs=part["logprobs"])  # fmt: skip
        return [
            *events,
            *self.events.event("response.content_part.done", **self._where(item), part=part),
            *self.events.event("response.output_item.done", output_index=item.index,
                               item=item.shape(status)),
        ]  # fmt: skip

    def written(self) -> list[dict[str, Any]]:
        """The output items so far, the one the model was writing
        ``incomplete``."""
        return [item.shape(item.status or "incomplete") for item in self.items]

    def _new(self, kind: ItemKind, call: ToolCall | None = None) -> OutputItem:
        item = OutputItem(kind, len(self.items), call)
        self.items.append(item)
        return item

    @staticmethod
    def _where(item: OutputItem) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": item.index, "content_index": 0}

    def end(self, done: GenerationDone) -> list[bytes]:
        events = [*self.events.opening(), *self._close(item_status(done))]
        response = self.response(done)
        return events + self.events.event(f"response.{response['status']}", response=response)

    def whole(self, done: GenerationDone) -> bytes:
        return ENCODER.encode(self.response(done))

    def response(self, done: GenerationDone) -> dict[str, Any]:
        """The whole Response: ``incomplete`` when max_output_tokens (or the
        memory guard) cut it short, its last item then ``incomplete`` too."""
        last = item_status(done)
        output = [item.shape(item.status or last) for item in self.items]
        incomplete = None
        if done.finish_reason in CUT_BY_LENGTH:
            incomplete = {"reason": "max_output_tokens"}
        return self.events.response(
            "incomplete" if incomplete else "completed", output,
            incomplete_details=incomplete, completed_at=int(time.time()), usage=usage(done),
            supervisor=supervisor_fields(done),
        )  # fmt: skip


def item_status(done: GenerationDone) -> str:
    """The status of the item the model was writing when it ended."""
    return "incomplete" if done.finish_reason in CUT_BY_LENGTH else "completed"


def usage(done: GenerationDone) -> dict[str, Any]:
    return {
        "input_tokens": done.prompt_tokens,
        "input_tokens_details": {"cached_tokens": done.cached_tokens},
        "output_tokens": done.generation_tokens,
        "output_tokens_details": {"reasoning_tokens": done.reasoning_tokens},
        "total_tokens": done.prompt_tokens + done.generation_tokens,
    }

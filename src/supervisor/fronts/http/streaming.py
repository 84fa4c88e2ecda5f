"""Writing one HTTP response to an ASGI ``send``: a whole JSON body, or a
stream (server-sent events, or Ollama's JSON lines), each write within a
deadline; and the watch on ``receive`` that tells when the client has left.

How a stream is framed, and what an error looks like, is each API's own
(:class:`Framing`): OpenAI's bare ``data:`` events, Anthropic's and the
Responses API's named events, Ollama's newline-delimited JSON."""

from __future__ import annotations

import contextlib
from typing import Protocol

import anyio
from starlette.types import Message, Receive, Send

from supervisor.fronts.http.errors import ENCODER, ApiError
from supervisor.fronts.mailbox import ClientGone


def sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def named_sse(name: str, data: bytes) -> bytes:
    """A server-sent event with its name (Anthropic's and the Responses API's)."""
    return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"


def ndjson(data: bytes) -> bytes:
    """One line of a newline-delimited JSON stream (Ollama's)."""
    return data + b"\n"


class Framing(Protocol):
    """How one API frames a stream and shapes its errors."""

    media_type: str
    """A stream's content type."""

    def comment(self, text: str) -> bytes | None:
        """A keep-alive that clients skip (None: the framing has none)."""
        ...

    def error_body(self, error: ApiError) -> bytes:
        """``error`` as a whole response's JSON body."""
        ...

    def error_event(self, error: ApiError, call: object = None) -> bytes:
        """``error`` as a stream's last event, framed; ``call``: the request
        it ends, once parsed (an API whose events are numbered numbers it
        after the call's own)."""
        ...


class OpenAIFraming:
    """OpenAI's: ``data:`` events, comments as keep-alives, ``{"error": {...}}``."""

    media_type = "text/event-stream; charset=utf-8"

    def comment(self, text: str) -> bytes | None:
        return f": {text}\n\n".encode()

    def error_body(self, error: ApiError) -> bytes:
        return ENCODER.encode(error.body())

    def error_event(self, error: ApiError, call: object = None) -> bytes:
        return sse(self.error_body(error))


OPENAI = OpenAIFraming()


# What a send raises once the client has gone: OSError (as the ASGI spec asks
# of servers), or anyio's closed-stream errors when a middleware passes the
# messages through a memory stream that the client's leaving closed.
VANISHED = (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError)


class ResponseWriter:
    """Writes one response to an ASGI ``send``. The head goes out only when
    there is something to say, so an error before that still gets its own
    status; each write has a deadline (a client that reads nothing this long
    is gone), and a client that left makes every write raise ClientGone."""

    def __init__(self, send: Send, write_timeout_s: float, framing: Framing = OPENAI) -> None:
        self._send = send
        self.framing = framing
        self.call: object = None  # the request, once parsed: its error event may need it
        self.write_timeout_s = write_timeout_s
        self.started = False
        self.streaming = False
        self.ended = False
        self.gone = False
        self._lock = anyio.Lock()

    async def _write(self, *messages: Message) -> None:
        async with self._lock:
            if self.gone:
                raise ClientGone("the HTTP client is gone")
            try:
                with anyio.fail_after(self.write_timeout_s):
                    for message in messages:
                        await self._send(message)
            except TimeoutError:
                self.gone = True
                raise ClientGone(f"the client read nothing for {self.write_timeout_s:g}s") from None
            except VANISHED as exc:
                self.gone = True
                raise ClientGone(str(exc) or type(exc).__name__) from None

    def _head(self, status: int, media_type: str, headers: dict[str, str]) -> Message:
        self.started = True
        fields = [(b"content-type", media_type.encode())]
        fields += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        return {"type": "http.response.start", "status": status, "headers": fields}

    async def whole(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        """The whole response at once (JSON)."""
        head = self._head(
            status, "application/json", {**(headers or {}), "content-length": str(len(body))}
        )
        self.ended = True
        await self._write(head, {"type": "http.response.body", "body": body})

    async def event(self, data: bytes) -> None:
        """One server-sent event (``data: ...``), the head first if need be."""
        await self.stream(sse(data))

    async def comment(self, text: str) -> None:
        """A keep-alive that clients skip, where the framing has one."""
        framed = self.framing.comment(text)
        if framed is not None:
            await self.stream(framed)

    async def stream(self, *chunks: bytes) -> None:
        """Framed stream bytes, the head first if need be."""
        messages: list[Message] = []
        if not self.started:
            self.streaming = True
            headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
            messages.append(self._head(200, self.framing.media_type, headers))
        body = b"".join(chunks)
        messages.append({"type": "http.response.body", "body": body, "more_body": True})
        await self._write(*messages)

    async def end(self) -> None:
        """Close a stream."""
        if not self.ended:
            self.ended = True
            await self._write({"type": "http.response.body", "body": b""})

    async def fail(self, error: ApiError) -> None:
        """Send ``error``: as the response, or, once a stream has started, as
        its last event. Best effort: the client may be gone."""
        with contextlib.suppress(ClientGone):
            if not self.started:
                await self.whole(error.status, self.framing.error_body(error), error.headers)
            elif self.streaming and not self.ended:
                await self.stream(self.framing.error_event(error, self.call))
                await self.end()


async def watch_disconnect(receive: Receive, cancel: anyio.Event, writer: ResponseWriter) -> None:
    """Set ``cancel`` when the client disconnects (the body is read by then:
    the next ASGI message is the disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            writer.gone = True
            cancel.set()
            return

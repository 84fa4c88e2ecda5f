"""Writing one HTTP response to an ASGI ``send``: a whole JSON body, or
server-sent events, each write within a deadline; and the watch on
``receive`` that tells when the client has left."""

from __future__ import annotations

import contextlib

import anyio
from starlette.types import Message, Receive, Send

from supervisor.fronts.http.errors import ApiError
from supervisor.fronts.http.openai_replies import ENCODER
from supervisor.fronts.mailbox import ClientGone


def sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


# What a send raises once the client has gone: OSError (as the ASGI spec asks
# of servers), or anyio's closed-stream errors when a middleware passes the
# messages through a memory stream that the client's leaving closed.
VANISHED = (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError)


class ResponseWriter:
    """Writes one response to an ASGI ``send``. The head goes out only when
    there is something to say, so an error before that still gets its own
    status; each write has a deadline (a client that reads nothing this long
    is gone), and a client that left makes every write raise ClientGone."""

    def __init__(self, send: Send, write_timeout_s: float) -> None:
        self._send = send
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
        await self._stream_bytes(sse(data))

    async def comment(self, text: str) -> None:
        """A server-sent comment: a keep-alive that clients skip."""
        await self._stream_bytes(f": {text}\n\n".encode())

    async def _stream_bytes(self, chunk: bytes) -> None:
        messages: list[Message] = []
        if not self.started:
            self.streaming = True
            headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
            messages.append(self._head(200, "text/event-stream; charset=utf-8", headers))
        messages.append({"type": "http.response.body", "body": chunk, "more_body": True})
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
                await self.whole(error.status, ENCODER.encode(error.body()), error.headers)
            elif self.streaming and not self.ended:
                await self.event(ENCODER.encode(error.body()))
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

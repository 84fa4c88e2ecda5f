"""What a runner sends, and what waits for it.

A request in flight has a :class:`RequestStream` its frames go to; an answer
to a command (``CacheCleared``) goes to an :class:`EventWaiter`; the rest
(load progress, Ready, LoadFailed) to the runner's :class:`EventQueue`. When
the runner (or its group) is gone, whoever waits hears :class:`RunnerGone`
with its exit.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from typing import Any, NoReturn, Protocol

import anyio

from ipc.messages import ExitInfo, GenerationDone, GenerationFailed, RunnerEvent, TextChunk
from supervisor.waiting import first_of

__all__ = [
    "EventQueue", "EventWaiter", "Exits", "RequestEvent", "RequestRoutes", "RequestStream",
    "RunnerGone", "raise_gone",
]  # fmt: skip


class RunnerGone(Exception):
    """The runner process has exited; ``exit`` says how."""

    def __init__(self, exit: ExitInfo) -> None:
        super().__init__(exit.cause)
        self.exit = exit


RequestEvent = TextChunk | GenerationDone | GenerationFailed
"""What the runner sends about one request."""


class Exits(Protocol):
    """A runner, or a group of them, as those waiting on it see it."""

    @property
    def exited(self) -> anyio.Event: ...
    @property
    def exit_info(self) -> ExitInfo | None: ...


class Closes(Exits, Protocol):
    """What a request stream needs of its runner: its exit, and the close."""

    def close_request(self, request_id: int) -> None: ...


async def raise_gone(runner: Exits) -> NoReturn:
    """Wait for ``runner``'s exit and raise :class:`RunnerGone` with it.

    Raises:
        RunnerGone: always, once the runner has exited.
    """
    await runner.exited.wait()
    assert runner.exit_info is not None
    raise RunnerGone(runner.exit_info) from None


class RequestStream:
    """The frames of one request in flight, as the runner sends them.

    Each item is the event and its frame's body as it came over the pipe
    (a relay can write it to a client as it is). Close it when done.

    A deque and one wake-up per wait: a frame costs the relay no checkpoint
    or cancel-scope walk (an anyio memory stream spent about a third of the
    daemon's CPU per relayed frame on those).
    """

    def __init__(self, handle: Closes, request_id: int) -> None:
        self.handle = handle
        # Whose exit ends the stream: the runner's, or its group's.
        self.owner: Exits = handle
        self.request_id = request_id
        self._items: deque[tuple[RequestEvent, bytes]] = deque()
        self._ended = False
        self._wakeup: anyio.Event | None = None

    async def next(self) -> tuple[RequestEvent, bytes]:
        """The request's next frame.

        Raises:
            RunnerGone: the runner exited; no more frames will come.
        """
        while not self._items:
            if self._ended:
                await raise_gone(self.owner)
            self._wakeup = anyio.Event()
            await self._wakeup.wait()
        return self._items.popleft()

    def next_nowait(self) -> tuple[RequestEvent, bytes] | None:
        """The next frame if one is waiting, else None."""
        return self._items.popleft() if self._items else None

    def put(self, event: RequestEvent, body: bytes) -> None:
        if self._ended:
            return
        self._items.append((event, body))
        self._wake()

    def end(self) -> None:
        """No more frames (the runner is gone, or the request closed)."""
        self._ended = True
        self._wake()

    def close(self) -> None:
        self.handle.close_request(self.request_id)
        self._ended = True
        self._items.clear()
        self._wake()

    def _wake(self) -> None:
        wakeup, self._wakeup = self._wakeup, None
        if wakeup is not None:
            wakeup.set()


class RequestRoutes:
    """One runner's requests in flight: the stream each one's frames go to,
    and which still wait for their first token. The stall watchdog's phase
    follows from them (:meth:`phase`)."""

    def __init__(self) -> None:
        self._streams: dict[int, RequestStream] = {}
        self._followed: set[int] = set()  # requests tracked for the phase only
        self._prefilling: set[int] = set()

    def open(self, stream: RequestStream) -> None:
        self._streams[stream.request_id] = stream
        self._prefilling.add(stream.request_id)

    def follow(self, request_id: int) -> None:
        """Track ``request_id``'s phase, without a stream."""
        self._followed.add(request_id)
        self._prefilling.add(request_id)

    def close(self, request_id: int) -> RequestStream | None:
        """Forget ``request_id``; returns its stream, if it had one."""
        self._followed.discard(request_id)
        self._prefilling.discard(request_id)
        return self._streams.pop(request_id, None)

    def route(self, event: RequestEvent, body: bytes) -> bool:
        """Pass a frame to its request's stream (a late frame of an abandoned
        request goes nowhere). Returns whether it was the request's first
        token: it has left prefill."""
        stream = self._streams.get(event.request_id)
        if stream is not None:
            stream.put(event, body)
        if isinstance(event, TextChunk) and event.request_id in self._prefilling:
            self._prefilling.discard(event.request_id)
            return True
        return False

    def phase(self) -> str:
        """idle with no request in flight; prefill while one waits for its
        first token (the longer timeout); else decode."""
        if not self._streams and not self._followed:
            return "idle"
        return "prefill" if self._prefilling else "decode"

    def end_all(self) -> None:
        """No more frames for any request: their readers hear the exit."""
        for stream in self._streams.values():
            stream.end()


class EventWaiter:
    """Waits for the runner's next event of one type (an answer to a command).

    Args:
        runner: whose exit ends the wait.
        kind: the event type awaited.
        waiting: the runner's list of waiters, this one in it until it is
            answered or cancelled.
        request_id: only the event with this ``request_id`` (None: any).
    """

    def __init__(
        self,
        runner: Exits,
        kind: type[Any],
        waiting: list[EventWaiter],
        request_id: int | None = None,
    ) -> None:
        self.runner = runner
        self.kind = kind
        self.request_id = request_id
        self.event: RunnerEvent | None = None
        self._arrived = anyio.Event()
        self._waiting = waiting

    def wants(self, event: RunnerEvent) -> bool:
        """Whether ``event`` is the one awaited."""
        if not isinstance(event, self.kind):
            return False
        return self.request_id is None or getattr(event, "request_id", None) == self.request_id

    def deliver(self, event: RunnerEvent) -> None:
        self.event = event
        self._arrived.set()

    async def wait(self) -> RunnerEvent:
        """The event.

        Raises:
            RunnerGone: the runner exited first.
        """
        await first_of(self._arrived, self.runner.exited)
        if self.event is None:
            assert self.runner.exit_info is not None
            raise RunnerGone(self.runner.exit_info)
        return self.event

    def cancel(self) -> None:
        with contextlib.suppress(ValueError):
            self._waiting.remove(self)


class EventQueue:
    """A runner's (or group's) events for its ``next_event``, in order; once
    closed and drained, its exit.

    Args:
        runner: whose exit the reader hears after the last event.
    """

    def __init__(self, runner: Exits) -> None:
        self.runner = runner
        self._in, self._out = anyio.create_memory_object_stream[RunnerEvent](
            max_buffer_size=math.inf
        )

    def put(self, event: RunnerEvent) -> None:
        self._in.send_nowait(event)

    def close(self) -> None:
        """No more events: the reader hears the exit once it has the rest."""
        self._in.close()

    async def next(self) -> RunnerEvent:
        """The next event.

        Raises:
            RunnerGone: the runner exited; no more events will come.
        """
        try:
            return await self._out.receive()
        except anyio.EndOfStream:
            await raise_gone(self.runner)

"""What happens to the daemon's models, as a stream of events: the management
API's ``GET /admin/events`` and the dashboard read it.

The registry, its supervision, admission and the memory monitor publish an
:class:`Event` wherever they decide something a person watching would want
to see: every state move, load progress, a runner's death with its cause, a
restart, an eviction, a keep-alive expiry, a memory pressure crossing, an
admission refusal. :class:`EventHub` numbers them (monotonic ids, so a
client that reconnects says where it stopped), keeps the most recent ones
in a ring, and hands each to its subscribers. The ids start above the
daemon's start time in microseconds: a client that comes back to a newer
daemon with the last id an older one gave it is below every id of the new
one, and replays all of them.

A publisher never waits: each subscriber has a bounded buffer, and one that
falls behind by a whole buffer is dropped (``lagged``), its stream ending;
it may subscribe again from the last id it saw and catch up from the ring.
Publishing happens on the event loop's thread (every publisher lives there).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from types import TracebackType

import anyio
import msgspec
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

log = structlog.get_logger("supervisor.events")

HISTORY = 1000  # events the ring keeps for replay
SUBSCRIBER_BUFFER = 256  # events a subscriber may fall behind before it is dropped


class Event(msgspec.Struct, frozen=True):
    """One thing that happened.

    ``id`` grows by one per event of this daemon, from just above its start
    time in microseconds (a newer daemon's ids are above an older one's);
    ``ts`` is unix time in seconds; ``model`` the model's name when
    the event is about one; ``fields`` what else there is to say (a pid, a
    cause class, load progress), as JSON-able values.
    """

    id: int
    ts: float
    kind: str
    model: str | None
    fields: dict[str, object]


class EventHub:
    """Numbers, keeps and hands out the daemon's events.

    Args:
        history: how many recent events the ring keeps for replay.
        buffer: how many events one subscriber may fall behind.
        clock: unix time now (injected in tests); its value now, in
            microseconds, is the id below the first.
    """

    def __init__(
        self,
        history: int = HISTORY,
        buffer: int = SUBSCRIBER_BUFFER,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._ring: deque[Event] = deque(maxlen=history)
        self._buffer = buffer
        self._clock = clock
        self._base = int(clock() * 1_000_000)
        self._last_id = self._base
        self._subscribers: set[Subscription] = set()
        self.closed = False

    @property
    def subscriber_count(self) -> int:
        """How many subscriptions are being fed now."""
        return len(self._subscribers)

    @property
    def last_id(self) -> int:
        """The id of the latest event (before the first: the id below it)."""
        return self._last_id

    def publish(self, kind: str, model: str | None = None, /, **fields: object) -> Event:
        """Record an event about ``model`` (None: the daemon or the machine) and
        offer it to every subscriber. Never waits and never raises: a
        subscriber whose buffer is full is dropped."""
        self._last_id += 1
        event = Event(self._last_id, self._clock(), kind, model, fields)
        self._ring.append(event)
        for subscriber in list(self._subscribers):
            try:
                delivered = subscriber.offer(event)
            except Exception:  # a subscriber's fault is its own: the publisher goes on
                log.exception("event_delivery_failed", subscriber=id(subscriber))
                delivered = False
            if not delivered:
                self._subscribers.discard(subscriber)
        return event

    def recent(self, limit: int | None = None) -> list[Event]:
        """The events the ring holds, oldest first (the last ``limit`` of them)."""
        events = list(self._ring)
        return events if limit is None else events[max(len(events) - limit, 0) :]

    def after(self, event_id: int) -> list[Event]:
        """The events the ring holds with an id above ``event_id``, oldest
        first. An id of an older daemon is below them all: every event the
        ring holds; so is an id above the latest (a newer daemon's, with a
        clock set back since)."""
        if event_id > self._last_id:
            return list(self._ring)
        return [event for event in self._ring if event.id > event_id]

    def missed_after(self, event_id: int, first_kept: int) -> tuple[int, int] | None:
        """The ids of this hub's events after ``event_id`` that the ring no
        longer holds, as (first, last), when its oldest kept is
        ``first_kept``; None when none are lost (another daemon's ids are
        not this one's to miss)."""
        since = max(event_id, self._base)
        if since < self._last_id and first_kept > since + 1:
            return since + 1, first_kept - 1
        return None

    def subscribe(self, since: int | None = None) -> Subscription:
        """A subscription, to be entered with ``async with``: from then on it
        yields every event published, after (with ``since``) the events of the
        ring after that id (:meth:`after`). The replay and the live events
        meet without a gap or a repeat."""
        return Subscription(self, since, self._buffer)

    def close(self) -> None:
        """End every subscription (the daemon is stopping): each yields what it
        has buffered, then ends. Later subscriptions end at once."""
        self.closed = True
        for subscriber in list(self._subscribers):
            subscriber.end()
        self._subscribers.clear()

    def _attach(self, subscriber: Subscription) -> None:
        if self.closed:
            subscriber.end()
        else:
            self._subscribers.add(subscriber)

    def _detach(self, subscriber: Subscription) -> None:
        self._subscribers.discard(subscriber)


class Subscription:
    """One reader of a hub's events: an async context manager, and inside it
    an async iterator of :class:`Event` (or :meth:`receive`).

    After the iteration ends, ``lagged`` says whether it ended because this
    reader fell a whole buffer behind (events were lost after the last one it
    got; subscribe again from that id), else the hub closed. ``missed`` is
    the range of ids a replay asked for that the ring no longer held.
    """

    def __init__(self, hub: EventHub, since: int | None, buffer: int) -> None:
        self._hub = hub
        self._since = since
        self._backlog: deque[Event] = deque()
        self._send: MemoryObjectSendStream[Event]
        self._receive: MemoryObjectReceiveStream[Event]
        self._send, self._receive = anyio.create_memory_object_stream[Event](buffer)
        self.lagged = False
        self.missed: tuple[int, int] | None = None

    async def __aenter__(self) -> Subscription:
        # No await from the replay to the attach: no event slips between them.
        if self._since is not None:
            self._backlog.extend(self._hub.after(self._since))
            first = self._backlog[0].id if self._backlog else self._hub.last_id + 1
            self.missed = self._hub.missed_after(self._since, first)
        self._hub._attach(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._hub._detach(self)
        self._send.close()
        self._receive.close()

    def offer(self, event: Event) -> bool:
        """Buffer ``event`` without waiting. False (and the stream ends after
        what it holds) when the buffer is full or the reader has gone."""
        try:
            self._send.send_nowait(event)
            return True
        except anyio.WouldBlock:
            self.lagged = True
            log.warning("event_subscriber_lagged", buffer=self._send.statistics().max_buffer_size,
                        last_id=event.id - 1)  # fmt: skip
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        self._send.close()
        return False

    def end(self) -> None:
        """No more events: the reader gets what is buffered, then the end."""
        self._send.close()

    async def receive(self) -> Event:
        """The next event, waiting for it.

        Raises:
            anyio.EndOfStream: the hub closed, or this reader lagged (see ``lagged``).
        """
        if self._backlog:
            return self._backlog.popleft()
        try:
            return await self._receive.receive()
        except anyio.ClosedResourceError:  # left its ``async with``
            raise anyio.EndOfStream from None

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Event:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

"""What the fronts share about writing to a client: a client that is gone,
and a mailbox that keeps a producer from ever waiting on one."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import anyio

from ipc import ChannelClosed

T = TypeVar("T")


class ClientGone(ChannelClosed):
    """The client closed, broke or stopped reading its connection."""


class Mailbox(Generic[T]):
    """Holds the latest value for a connection's writer, so that the producer
    (a model's supervision) never waits on a client. Older values that were
    not written yet are replaced: a slow client sees fewer updates."""

    def __init__(self) -> None:
        self._value: T | None = None
        self._changed = anyio.Event()
        self.closed = False

    def put(self, value: T) -> None:
        if not self.closed:
            self._value = value
            self._changed.set()

    def close(self) -> None:
        """No more values; the writer stops (a pending value is dropped)."""
        self.closed = True
        self._changed.set()

    async def forward(self, send: Callable[[T], Awaitable[None]]) -> None:
        """Write values until closed or the client is gone."""
        while True:
            await self._changed.wait()
            self._changed = anyio.Event()
            if self.closed:
                return
            value, self._value = self._value, None
            if value is not None:
                try:
                    await send(value)
                except ClientGone:
                    return

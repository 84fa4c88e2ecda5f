"""Waiting on several things at once: the first of some events, a wait that
a cancel event cuts short, work with a watcher beside it; and how long to
wait before a retry."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


async def first_of(*events: anyio.Event) -> int:
    """Return as soon as any of ``events`` is set: the index of the one whose
    waiter woke first (of several set at once, the first set)."""
    first: int | None = None
    async with anyio.create_task_group() as tg:

        async def wait(index: int, event: anyio.Event) -> None:
            nonlocal first
            await event.wait()
            if first is None:
                first = index
            tg.cancel_scope.cancel()

        for index, event in enumerate(events):
            tg.start_soon(wait, index, event)
    assert first is not None
    return first


async def wait_unless(cancel: anyio.Event, wait: Callable[[], Awaitable[None]]) -> None:
    """Await ``wait()``, giving up (returning) as soon as ``cancel`` is set.
    An exception from ``wait()`` is raised as it is (not in a group)."""
    if cancel.is_set():
        return
    with anyio.CancelScope() as scope:

        async def watch() -> None:
            await cancel.wait()
            scope.cancel()

        await beside(watch, wait)


async def beside(
    background: Callable[[], Coroutine[Any, Any, None]], work: Callable[[], Awaitable[T]]
) -> T:
    """``work()`` with ``background()`` running beside it until work ends;
    work's exception is raised as it is (not in a group)."""
    result: list[T] = []
    failure: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(background)
        try:
            result.append(await work())
        except Exception as exc:
            failure = exc
        finally:
            tg.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return result[0]


@dataclass(frozen=True)
class Backoff:
    """The wait before a retry: ``base_s``, doubling with each retry in a
    row, never more than ``cap_s`` (restarts, the hot spare's retries)."""

    base_s: float
    cap_s: float

    def delay_s(self, retry: int) -> float:
        """The wait before retry number ``retry`` in a row (1: the first)."""
        doubling = 2.0 ** min(retry - 1, 30)  # capped: a float overflows past 2**1024
        return min(self.cap_s, self.base_s * doubling)

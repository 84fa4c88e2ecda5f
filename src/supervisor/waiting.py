"""Waiting on several things at once: the first of some events, a wait that
a cancel event cuts short, work with a watcher beside it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


async def first_of(*events: anyio.Event) -> None:
    """Return as soon as any of ``events`` is set."""
    async with anyio.create_task_group() as tg:

        async def wait(event: anyio.Event) -> None:
            await event.wait()
            tg.cancel_scope.cancel()

        for event in events:
            tg.start_soon(wait, event)


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

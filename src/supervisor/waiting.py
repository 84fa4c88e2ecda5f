"""Waiting on several things at once: the first of some events, or a wait
that a cancel event cuts short."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio


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
    failure: Exception | None = None
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            await cancel.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            await wait()
        except Exception as exc:
            failure = exc
        finally:
            tg.cancel_scope.cancel()
    if failure is not None:
        raise failure

"""Fault boundaries for the daemon's own tasks: a bug in one of them is
logged with its traceback and ends (or restarts) that task, never the
daemon's task group.

Runner tasks have theirs in the runner handle (a bug kills that runner),
client connections in their fronts; these are for the rest: keep-alive
expiry, the memory monitor, one-off work such as an expiry's unload.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import structlog

from supervisor.waiting import Backoff

log = structlog.get_logger("supervisor.boundary")

RETRY_FIRST_S = 0.1
RETRY_CAP_S = 5.0
"""A task that fails again at once is run again after a pause that doubles
from RETRY_FIRST_S up to this: a bug that recurs never spins the CPU, and a
passing one costs a tenth of a second."""


RETRY_BACKOFF = Backoff(RETRY_FIRST_S, RETRY_CAP_S)


def retry_delay_s(failures: int) -> float:
    """The pause before the next try after ``failures`` in a row (from 1)."""
    return RETRY_BACKOFF.delay_s(failures)


async def keep_running(name: str, task: Callable[[], Awaitable[None]]) -> None:
    """Run ``task``, meant to run until cancelled, and run it again after an
    unexpected error (see :data:`RETRY_CAP_S`); a run that lasted longer than
    the longest pause starts the count of failures afresh. Returns if it
    returns."""
    failures = 0
    while True:
        started = anyio.current_time()
        try:
            await task()
            return
        except Exception:
            healthy = anyio.current_time() - started > RETRY_CAP_S
            failures = 1 if healthy else failures + 1
            delay_s = retry_delay_s(failures)
            log.exception("daemon_task_failed", task=name, failures=failures,
                          retry_in_s=delay_s)  # fmt: skip
        await anyio.sleep(delay_s)


async def contained(name: str, task: Callable[..., Awaitable[None]], *args: Any) -> None:
    """Run a one-off ``task(*args)``; an unexpected error is logged, not raised."""
    try:
        await task(*args)
    except Exception:
        log.exception("daemon_task_failed", task=name)

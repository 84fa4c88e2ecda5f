"""The kill ladder: Shutdown message, join, SIGTERM, join, SIGKILL, reap.

One definition for every way a runner is stopped: unloads, evictions and
daemon shutdown start at the message; the stall watchdog at SIGTERM with a
short grace; a failed start, a protocol error or a bug in the supervisor at
SIGKILL. Each rung is named and timed; a process SIGKILL cannot end is given
up on rather than waited for (the runner decides what that means).
"""

from __future__ import annotations

import contextlib
import signal
import time
from typing import Any, Literal, Protocol

import anyio
from anyio.abc import Process

__all__ = ["Ending", "Killable", "ProcessEnd", "Rung", "Unwatched", "escalate", "signal_process"]

Rung = Literal["shutdown", "sigterm", "sigkill"]
"""Where the ladder starts."""


class Ending(Protocol):
    """A process's end as the ladder waits for it (an ``anyio.Event`` is one)."""

    def is_set(self) -> bool: ...
    async def wait(self) -> object: ...


class Killable(Protocol):
    """What the ladder needs of a runner."""

    @property
    def log(self) -> Any: ...
    @property
    def exited(self) -> Ending: ...

    def signal(self, signum: signal.Signals) -> None:
        """Send ``signum`` unless the process is reaped."""

    async def send_shutdown(self, reason: str) -> bool:
        """Send the Shutdown message; False when it cannot be (its pipe is closed)."""
        ...

    async def give_up(self, elapsed_s: float) -> bool:
        """SIGKILL has not ended it in time: stop waiting for it. False when
        it turns out to have ended after all."""
        ...


def signal_process(process: Process | None, signum: signal.Signals) -> None:
    """Send ``signum`` to ``process`` if it has not been reaped yet."""
    if process is not None and process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signum)


class ProcessEnd:
    """The end of a process as its own wait sees it: for a ladder climbed
    where nothing else watches the process (its watcher is being cancelled)."""

    def __init__(self, process: Process) -> None:
        self.process = process

    def is_set(self) -> bool:
        return self.process.returncode is not None

    async def wait(self) -> int:
        return await self.process.wait()


class Unwatched:
    """A runner's process once its watcher is being cancelled (the daemon is
    stopping): the ladder waits on the process itself, and one that SIGKILL
    cannot end is left to init, with a line in the log.

    Args:
        process: the process.
        log: the runner's logger.
    """

    def __init__(self, process: Process, log: Any) -> None:
        self.process = process
        self.log = log
        self.exited = ProcessEnd(process)

    def signal(self, signum: signal.Signals) -> None:
        signal_process(self.process, signum)

    async def send_shutdown(self, reason: str) -> bool:
        return False  # nothing reads its answer any more: the ladder starts at a signal

    async def give_up(self, elapsed_s: float) -> bool:
        self.log.error("runner_left_unkillable", pid=self.process.pid, waited_s=elapsed_s)
        return True


async def escalate(
    runner: Killable,
    reason: str,
    *,
    first: Rung,
    shutdown_grace_s: float,
    term_grace_s: float,
    sigkill_wait_s: float,
) -> list[str]:
    """Stop ``runner``, from rung ``first`` up until it has exited.

    Waits ``shutdown_grace_s`` after the message (the send included: a full
    pipe blocks it), ``term_grace_s`` after SIGTERM and ``sigkill_wait_s``
    after SIGKILL. Returns the steps taken; when it returns the process has
    been reaped, or, the last step ``unkillable``, given up on (see
    :meth:`Killable.give_up`).
    """
    steps: list[str] = []
    started = time.perf_counter()

    def elapsed() -> float:
        return round(time.perf_counter() - started, 3)

    if first == "shutdown" and not runner.exited.is_set():
        with anyio.move_on_after(shutdown_grace_s):
            if await runner.send_shutdown(reason):
                steps.append("shutdown")
                runner.log.info("escalate_shutdown_sent", reason=reason)
            await runner.exited.wait()
    if first != "sigkill" and not runner.exited.is_set():
        steps.append("sigterm")
        runner.log.warning("escalate_sigterm", reason=reason, elapsed_s=elapsed())
        runner.signal(signal.SIGTERM)
        with anyio.move_on_after(term_grace_s):
            await runner.exited.wait()
    if not runner.exited.is_set():
        steps.append("sigkill")
        runner.log.warning("escalate_sigkill", reason=reason, elapsed_s=elapsed())
        runner.signal(signal.SIGKILL)
        with anyio.move_on_after(sigkill_wait_s):
            await runner.exited.wait()
    if not runner.exited.is_set() and await runner.give_up(elapsed()):
        steps.append("unkillable")
        return steps
    runner.log.info("runner_reaped", steps=steps, elapsed_s=elapsed())
    return steps

"""The stall watchdog and the pings: a runner that hangs is killed from outside.

Two watches per runner. The stall watch knows the runner's phase (starting,
loading, joining, idle, prefill, decode) and kills it when the phase goes
without progress for longer than its limit: hangs that leave the process
answering pings (a blocked ``mx.eval`` releases the GIL). The liveness watch
pings it and kills it when nothing at all comes back: a frozen process
(SIGSTOP, a deadlock holding the GIL). Both kill by the ladder, from SIGTERM.
"""

from __future__ import annotations

import math
import time
from typing import Any, Protocol

import anyio

from ipc import ChannelClosed
from ipc.aio import AsyncChannel
from ipc.messages import Heartbeat, LoadProgress, Ping, Ready, RunnerEvent, Started
from supervisor.config import SupervisorConfig
from supervisor.runners.escalation import Rung
from supervisor.waiting import beside

__all__ = ["STALL_STEP_CAP", "STALL_STEP_MULTIPLE", "StallWatchdog", "Watched"]

STALL_STEP_MULTIPLE = 3
"""A step the runner said would take S seconds is a stall only after this
many times S without progress (when that is longer than the phase's limit)..."""
STALL_STEP_CAP = 10
"""...but never after more than this many times the phase's limit: a runner
that states nonsense cannot turn the watchdog off."""


class Watched(Protocol):
    """What the watchdog needs of its runner."""

    kill_cause: str | None

    @property
    def log(self) -> Any: ...
    @property
    def exited(self) -> anyio.Event: ...
    @property
    def stop_requested(self) -> bool: ...
    @property
    def channel(self) -> AsyncChannel[RunnerEvent] | None: ...

    def events_pending(self) -> bool:
        """Whether the runner has written frames we have not read yet."""
        ...

    async def escalate(
        self, reason: str, *, first: Rung = ..., term_grace_s: float | None = ...
    ) -> list[str]: ...


class StallWatchdog:
    """What one runner is doing and when it last showed progress, and the
    tasks that kill it when that stops.

    Progress is a counter and a timestamp (per token: no wake-up); a phase
    change wakes the stall watch, whose limit may be shorter.

    Args:
        runner: the runner watched.
        config: the limits (``*_stall_s``, ``ping_*``, ``stall_kill_grace_s``).
    """

    def __init__(self, runner: Watched, config: SupervisorConfig) -> None:
        self.runner = runner
        self.config = config
        # Phases: starting, loading, joining, idle, prefill, decode.
        self.phase = "starting"
        self.progress = 0
        self.last_progress_at = time.monotonic()
        self.last_alive_at = time.monotonic()  # any frame from the runner, pongs included
        # The runner's own estimate of its step under way, and the phase it was for.
        self.step: tuple[str, float] | None = None
        self.ping_unanswered_since: float | None = None  # the oldest ping with no frame after it
        self._phase_changed = anyio.Event()
        self._ping_seq = 0

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.note_progress()
        self._phase_changed.set()  # the watch recomputes its deadline

    def note_progress(self) -> None:
        # Per token: a counter and a timestamp, no wake-up (the watch reads them).
        self.progress += 1
        self.last_progress_at = time.monotonic()

    def note_alive(self) -> None:
        """A frame came from the runner: every ping so far is answered."""
        self.last_alive_at = time.monotonic()
        self.ping_unanswered_since = None

    def note_exit(self) -> None:
        """Wake the stall watch so it sees the exit."""
        self._phase_changed.set()

    def track(self, event: RunnerEvent) -> None:
        """Note the progress, or the phase, a runner event says (the frames
        of a request say theirs through the runner's routes)."""
        if (isinstance(event, Started) and self.phase == "starting") or isinstance(event, Ready):
            self.set_phase("idle")
        elif isinstance(event, LoadProgress) and event.phase == "join":
            # Joining a distributed group holds the runner's GIL: no pings
            # are answered until it is done, and the join has its own limit.
            self.set_phase("joining" if event.done < event.total else "loading")
        elif isinstance(event, Heartbeat):
            self.step = None if event.step_s is None else (event.phase, event.step_s)
            self.note_progress()
        elif isinstance(event, LoadProgress):
            self.note_progress()

    def stall_timeout_s(self) -> float:
        """How long the current phase may go without progress (idle: forever;
        liveness is the pings' job): the phase's limit, or a multiple of the
        time the runner said its step would take, the longer."""
        config = self.config
        limit = {
            "starting": config.load_stall_s,
            "loading": config.load_stall_s,
            "joining": config.group_join_s,
            "idle": math.inf,
            "prefill": config.prefill_stall_s,
            "decode": config.decode_stall_s,
        }[self.phase]
        if self.step is not None and self.step[0] == self.phase:  # a prefill's, or a decode's
            stated = min(STALL_STEP_MULTIPLE * self.step[1], STALL_STEP_CAP * limit)
            return max(limit, stated)
        return limit

    async def watch_stalls(self) -> None:
        """Kill the runner when its phase goes without progress for too long.

        Catches hangs that leave the process answering pings (a blocked
        ``mx.eval`` releases the GIL). Sleeps until the last progress plus
        the phase's timeout; progress only moves that deadline, and a phase
        change (whose timeout may be shorter) wakes it early.
        """
        runner = self.runner
        while not runner.exited.is_set():
            timeout = self.stall_timeout_s()
            remaining = self.last_progress_at + timeout - time.monotonic()
            if remaining > 0:
                self._phase_changed = anyio.Event()
                with anyio.move_on_after(remaining):
                    await self._phase_changed.wait()
                continue
            if runner.stop_requested:
                return
            if runner.events_pending():  # progress may be waiting in the pipe: read it first
                await anyio.sleep(0)
                continue
            await self.kill_stalled(f"stalled in {self.phase}: no progress for {timeout:g}s")
            return

    async def watch_liveness(self) -> None:
        """Kill a frozen runner in any phase: one that sends nothing, not even
        a Pong, for ``ping_timeout_s`` (SIGSTOP, a deadlock holding the GIL).

        The runner's pipe-reader thread answers pings whatever its main thread
        is doing; pings go out from a separate task, since a frozen runner's
        full pipe would block a send.
        """
        await beside(self._send_pings, self._watch_answers)

    async def _watch_answers(self) -> None:
        runner = self.runner
        timeout = self.config.ping_timeout_s
        while not runner.exited.is_set() and not runner.stop_requested:
            since = self.ping_unanswered_since
            waited_s = time.monotonic() - since if since is not None else 0.0
            if waited_s > timeout and self.phase != "joining":
                if runner.events_pending():  # it did answer; our loop was busy or paused
                    await anyio.sleep(0)
                    continue
                await self.kill_stalled(
                    f"frozen in {self.phase}: no answer to pings for {waited_s:.1f}s"
                )
                return
            interval_s = self.config.ping_interval_s
            next_check_s = timeout - waited_s if since is not None else interval_s
            if self.phase == "joining":  # the stall watch has this phase
                next_check_s = interval_s
            with anyio.move_on_after(next_check_s + 0.01):
                await runner.exited.wait()

    async def _send_pings(self) -> None:
        runner = self.runner
        channel = runner.channel
        assert channel is not None
        while not runner.exited.is_set():
            with anyio.move_on_after(self.config.ping_interval_s):  # the ping period
                await runner.exited.wait()
            if runner.exited.is_set() or runner.stop_requested:
                return
            if self.ping_unanswered_since is None:
                self.ping_unanswered_since = time.monotonic()
            self._ping_seq += 1
            try:
                with anyio.CancelScope(shield=True):  # never cut a frame in half
                    await channel.send(Ping(self._ping_seq))
            except ChannelClosed:
                return

    async def kill_stalled(self, reason: str) -> None:
        """Kill a hung runner from the outside: SIGTERM, a short grace, SIGKILL.

        A hung ``mx.eval`` cannot be interrupted from inside; SIGKILL can, but
        for a process in uninterruptible sleep (see ``RunnerHandle.give_up``).
        """
        runner = self.runner
        runner.kill_cause = reason
        runner.log.error(
            "runner_stalled",
            reason=reason,
            phase=self.phase,
            progress=self.progress,
            since_progress_s=round(time.monotonic() - self.last_progress_at, 3),
            since_alive_s=round(time.monotonic() - self.last_alive_at, 3),
        )
        await runner.escalate(reason, first="sigterm", term_grace_s=self.config.stall_kill_grace_s)

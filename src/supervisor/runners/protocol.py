"""What serves a model, as the registry sees it: one runner process
(:class:`~supervisor.runners.handle.RunnerHandle`) or a group of ranks
(:class:`~supervisor.runners.group.RunnerGroup`). Both implement
:class:`Runner`; a group answers for its ranks as one."""

from __future__ import annotations

import signal
from typing import Any, Protocol

import anyio

from ipc.messages import EngineStats, ExitInfo, MemoryFigures, RunnerCommand, RunnerEvent
from supervisor.config import ModelConfig, SupervisorConfig
from supervisor.runners.escalation import Rung
from supervisor.runners.requests import EventWaiter, RequestStream

__all__ = ["Runner"]


class Runner(Protocol):
    """A model's runner, single or a group: its process figures, its
    commands and events, its requests, its exit and the kill ladder."""

    spec: ModelConfig
    stop_requested: bool  # the supervisor asked it to stop (its exit is no failure)

    @property
    def config(self) -> SupervisorConfig: ...
    @property
    def log(self) -> Any: ...

    # --- the process, as status shows it --------------------------------------

    @property
    def pid(self) -> int | None: ...
    @property
    def alive(self) -> bool: ...
    @property
    def started_at(self) -> float | None:
        """When it was spawned (time.time())."""

    @property
    def started_monotonic(self) -> float:
        """When it was spawned (time.monotonic())."""

    @property
    def create_time(self) -> float | None:
        """The OS's start time of its process: with the pid, it names one process."""

    @property
    def memory(self) -> MemoryFigures:
        """MLX's memory as last reported."""

    @property
    def engine_stats(self) -> EngineStats | None: ...
    @property
    def footprint_bytes(self) -> int:
        """What it holds on this machine: RSS or MLX's active + cache, the larger."""

    @property
    def rss_bytes(self) -> int | None: ...
    def measure_rss(self) -> int | None:
        """Read its RSS now (kept, for after its death)."""

    # --- talking ----------------------------------------------------------------

    async def send(self, command: RunnerCommand) -> None:
        """Send ``command``.

        Raises:
            RunnerGone: it has exited.
        """

    async def next_event(self) -> RunnerEvent:
        """Its next event (load progress, Ready, LoadFailed...).

        Raises:
            RunnerGone: it has exited; no more events will come.
        """

    def open_request(self, request_id: int) -> RequestStream:
        """Route the frames of ``request_id`` to a new stream (before sending it)."""

    def close_request(self, request_id: int, *, end: bool = True) -> None:
        """Stop routing ``request_id``'s frames."""

    def expect(self, kind: type[Any], request_id: int | None = None) -> EventWaiter:
        """Start waiting for its next ``kind`` event (with ``request_id``, when
        given), before sending the command it answers."""

    # --- its end ------------------------------------------------------------------

    @property
    def exited(self) -> anyio.Event: ...
    @property
    def exit_info(self) -> ExitInfo | None: ...
    @property
    def kill_cause(self) -> str | None:
        """The supervisor's reason for killing it (a stall), if it did."""

    def signal(self, signum: signal.Signals) -> None:
        """Send ``signum`` to its process(es), unless reaped."""

    async def escalate(
        self,
        reason: str,
        *,
        first: Rung = "shutdown",
        term_grace_s: float | None = None,
        shutdown_grace_s: float | None = None,
    ) -> list[str]:
        """The kill ladder (see :mod:`supervisor.runners.escalation`); returns
        the steps taken, once it is reaped or given up on."""

"""The hot spare: one idle runner with mlx and mlx_lm already imported.

Importing mlx_lm costs a second or two; a load or a restart that takes the
spare does not pay it. After the spare is taken, a new one is started once the
model it went to is ready (or its runner gone), so making the next spare
never competes with a load for the CPU.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import structlog

from ipc.messages import FAULTS_ENV, SpareInfo
from supervisor.config import ModelConfig, SupervisorConfig
from supervisor.runner_handle import RunnerHandle, RunnerStartError
from supervisor.system import process_rss

log = structlog.get_logger("supervisor.spare")

SPARE_NAME = "(spare)"

Spawner = Callable[[RunnerHandle], Awaitable[None]]
"""Starts a handle's process in a task that owns it until it is reaped."""


async def first_of(*events: anyio.Event) -> None:
    """Return as soon as any of ``events`` is set."""
    async with anyio.create_task_group() as tg:

        async def wait(event: anyio.Event) -> None:
            await event.wait()
            tg.cancel_scope.cancel()

        for event in events:
            tg.start_soon(wait, event)


def spare_fits(spec: ModelConfig) -> bool:
    """Whether a runner started without ``spec.env`` can serve ``spec``."""
    if set(spec.env) - {FAULTS_ENV}:
        return False
    return "exit_in_handshake" not in spec.env.get(FAULTS_ENV, "")


class HotSpare:
    """Keeps one warm runner ready to be handed a model.

    Args:
        config: the daemon config.
        spawn: starts a handle (raises RunnerStartError).
    """

    def __init__(self, config: SupervisorConfig, spawn: Spawner) -> None:
        self.config = config
        self._spawn = spawn
        self.current: RunnerHandle | None = None
        self.closing = False

    def take(self, spec: ModelConfig) -> RunnerHandle | None:
        """The spare, adopted by ``spec``, or None if there is no live one.

        A model with its own environment needs a fresh process (the
        environment is fixed at exec), so it gets None; fault injection is the
        exception, as it also travels in the LoadModel message.
        """
        spare = self.current
        if spare is None or not spare.alive or not spare_fits(spec):
            return None
        self.current = None
        spare.adopt(spec)
        return spare

    def info(self) -> SpareInfo | None:
        spare = self.current
        if spare is None or spare.pid is None or not spare.alive:
            return None
        return SpareInfo(spare.pid, spare.warm.is_set(), process_rss(spare.pid))

    async def keep(self) -> None:
        """Run forever (until closing): keep a spare, replace it when taken or dead."""
        failures = 0
        while not self.closing:
            handle = RunnerHandle(ModelConfig(name=SPARE_NAME, model=""), self.config)
            try:
                await self._spawn(handle)
            except RunnerStartError as exc:
                failures += 1
                delay = min(self.config.restart_backoff_cap_s, 0.5 * 2**failures)
                log.error("spare_start_failed", error=str(exc), retry_in_s=delay)
                await anyio.sleep(delay)  # backoff before the next attempt
                continue
            failures = 0
            self.current = handle
            await first_of(handle.claimed, handle.exited)
            if self.current is handle:  # it died unclaimed
                self.current = None
                handle.log.warning("spare_died", cause=handle.exit_info and handle.exit_info.cause)
                continue
            await first_of(handle.ready, handle.exited)

    async def stop(self) -> None:
        """Stop making spares and shut the current one down (escalating)."""
        self.closing = True
        spare, self.current = self.current, None
        if spare is not None and spare.alive:
            await spare.escalate_shutdown("daemon shutdown")

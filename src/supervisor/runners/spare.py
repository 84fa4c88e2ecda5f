"""The hot spare: one idle runner with mlx and mlx_lm already imported.

Importing mlx_lm costs a second or two; a load or a restart that takes the
spare does not pay it. After the spare is taken, a new one is started once the
model it went to is ready (or its runner gone), so making the next spare
never competes with a load for the CPU.
"""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable
from typing import Literal

import anyio
import structlog

from ipc.messages import FAULTS_ENV, SpareInfo
from supervisor.config import ModelConfig, SupervisorConfig
from supervisor.runners.escalation import Rung
from supervisor.runners.handle import RunnerHandle, RunnerStartError
from supervisor.system import process_rss
from supervisor.waiting import Backoff, first_of

log = structlog.get_logger("supervisor.runners.spare")

SPARE_NAME = "(spare)"
FAILED_AFTER = 3  # spares failing in a row before status calls the spare failed

Spawner = Callable[[RunnerHandle], Awaitable[None]]
"""Starts a handle's process in a task that owns it until it is reaped."""


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
        self.failures = 0  # spares in a row that failed to start or died unclaimed
        self.failure: str | None = None  # the last one's cause
        self._spawn_done: anyio.Event | None = None  # set when the spawn in progress ends
        self._spawning: RunnerHandle | None = None  # the spare being spawned, until it says hello

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
        if spare is not None and spare.pid is not None and spare.alive:
            warm = spare.warm.is_set()
            state: Literal["starting", "warm", "failed"] = "warm" if warm else "starting"
            return SpareInfo(spare.pid, warm, process_rss(spare.pid), state, self.failure)
        if self.failures >= FAILED_AFTER:
            return SpareInfo(None, False, None, "failed", self.failure)
        return None

    def warm_footprint_bytes(self) -> int:
        """What the warm, unclaimed spare holds now, measured (its RSS, or MLX's own figures
        where larger): a runner's runtime before any model. 0 when there is no warm spare."""
        spare = self.current
        if spare is None or not spare.alive or not spare.warm.is_set():
            return 0
        spare.measure_rss()
        return spare.footprint_bytes

    async def keep(self) -> None:
        """Run until closing: keep a spare, replace it when taken or dead.

        A spare that fails to start, or dies before it has imported mlx,
        counts as a failure: the next try waits with backoff (restart_backoff_s doubling to
        restart_backoff_cap_s), and after a few in a row status shows the
        spare ``failed`` with the cause. A fault boundary: a bug here is
        logged and retried the same way, never raised into the daemon.
        """
        backoff = Backoff(self.config.restart_backoff_s, self.config.restart_backoff_cap_s)
        while not self.closing:
            try:
                healthy = await self._keep_one()
            except Exception as exc:
                log.exception("spare_task_failed")
                healthy, self.failure = False, f"internal error: {exc!r}"
            if self.closing:
                return
            if healthy:
                self.failures, self.failure = 0, None
                continue
            self.failures += 1
            delay = backoff.delay_s(self.failures)
            log.error("spare_failed", cause=self.failure, failures=self.failures,
                      retry_in_s=delay)  # fmt: skip
            await anyio.sleep(delay)  # the backoff before the next try

    async def _keep_one(self) -> bool:
        """Start one spare and keep it until it is claimed and its model is
        ready, or it dies. Returns whether it was healthy (it got warm);
        otherwise ``self.failure`` says why not."""
        if self.closing:  # the daemon began to stop while the last spare was claimed
            return True
        handle = RunnerHandle(ModelConfig(name=SPARE_NAME, model=""), self.config)
        spawn_done = self._spawn_done = anyio.Event()
        self._spawning = handle
        try:
            await self._spawn(handle)
        except RunnerStartError as exc:
            self.failure = str(exc)
            return False
        finally:
            self._spawning = None
            spawn_done.set()
        self.current = handle  # before stop() can look: it resumes only after we wait
        await first_of(handle.claimed, handle.exited)
        if self.current is handle:  # it died unclaimed
            self.current = None
            cause = handle.exit_info.cause if handle.exit_info else "spare died"
            handle.log.warning("spare_died", cause=cause, warm=handle.warm.is_set())
            if not handle.warm.is_set():
                self.failure = f"spare died before it imported mlx: {cause}"
            return handle.warm.is_set()
        await first_of(handle.ready, handle.exited)
        return True

    async def stop(self) -> None:
        """Stop making spares and shut the current one down (escalating).

        A spare still being spawned holds no model yet: it is SIGKILLed at
        once and its failed handshake reaps it (not waited for, which took up
        to its import time); it never outlives this call to die by the task
        group's cancel, outside the kill ladder.
        """
        self.closing = True
        if self._spawning is not None:  # no model in it yet: no need to wait for its hello
            self._spawning.signal(signal.SIGKILL)
        if self._spawn_done is not None:
            await self._spawn_done.wait()
        spare, self.current = self.current, None
        if spare is not None and spare.alive:
            # One still importing mlx reads no Shutdown until it is done: it holds nothing
            # that needs one, so SIGTERM ends it at once.
            first: Rung = "shutdown" if spare.warm.is_set() else "sigterm"
            spare.stop_requested = True  # either way, a stop we asked for: no failure
            await spare.escalate("daemon shutdown", first=first)

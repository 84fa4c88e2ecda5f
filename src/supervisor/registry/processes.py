"""The registry's runner processes: each one owned by a task in the
registry's task group from its start until it is reaped, the hot spare, and
a runner for a model (a group of ranks, the spare, or a new process)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import anyio
from anyio.abc import TaskGroup, TaskStatus

from supervisor.config import ModelConfig, SupervisorConfig
from supervisor.memory.admission import Admission
from supervisor.runners.group import RunnerGroup
from supervisor.runners.handle import RunnerHandle, RunnerStartError
from supervisor.runners.placement import is_group
from supervisor.runners.protocol import Runner
from supervisor.runners.spare import HotSpare


class RunnerProcesses:
    """Starts and owns runner processes.

    Args:
        config: the daemon config.
        task_group: where each process's owning task lives.
        live: the set of live processes, kept up to date here (the registry's
            ``live_handles``: the memory monitor and the state file read it).
        admission: told of each process's departure (its memory coming back).
        counters: the registry's counters.
        on_change: called when a process starts or is reaped.
    """

    def __init__(
        self,
        config: SupervisorConfig,
        task_group: TaskGroup,
        live: set[RunnerHandle],
        admission: Admission,
        counters: Counter[str],
        on_change: Callable[[], None],
    ) -> None:
        self.config = config
        self.task_group = task_group
        self.live = live
        self.admission = admission
        self.counters = counters
        self.on_change = on_change
        self.spare = HotSpare(config, self.spawn)

    async def spawn(self, handle: RunnerHandle) -> None:
        """Start ``handle``'s process in a task that owns it until it is reaped.

        Raises:
            RunnerStartError: it failed to start or to shake hands.
        """
        error: RunnerStartError | None = await self.task_group.start(self._own_process, handle)
        if error is not None:
            raise error

    async def _own_process(
        self, handle: RunnerHandle, *, task_status: TaskStatus[RunnerStartError | None]
    ) -> None:
        """A fault boundary: whatever fails here ends this runner, not the daemon."""
        started = False
        try:
            async with anyio.create_task_group() as runner_tasks:
                try:
                    await handle.start(runner_tasks)
                except RunnerStartError as exc:
                    started = True  # reported: whatever happens next, never again
                    task_status.started(exc)
                    return
                self.live.add(handle)
                started = True
                task_status.started(None)
                self.on_change()
                try:
                    await handle.exited.wait()
                    if handle.unkillable:
                        self.counters["unkillable"] += 1
                    await handle.reaped.wait()  # counted as holding memory until it is gone
                finally:
                    self.live.discard(handle)
                    self.admission.note_departure(
                        handle.spec.name, handle.footprint_bytes, handle.started_monotonic
                    )
                    self.on_change()
        except Exception as exc:
            handle.log.exception("runner_task_failed")
            cause = f"supervisor error: {exc!r}"
            handle.mark_exited(None, cause)  # the task group has killed and reaped it
            if not started:
                task_status.started(RunnerStartError(cause))

    async def obtain(self, spec: ModelConfig) -> Runner:
        """A runner for ``spec``: a group of ranks when it is sharded; else the
        hot spare if it fits, else a new process."""
        if is_group(spec):
            try:
                group = RunnerGroup(spec, self.config)
            except ValueError as exc:  # its hostfile changed since it was checked
                raise RunnerStartError(str(exc)) from None
            await group.start(self.spawn, self.task_group)
            return group
        spare = self.spare.take(spec)
        if spare is not None:
            self.counters["spare_used"] += 1
            return spare
        handle = RunnerHandle(spec, self.config)
        await self.spawn(handle)
        return handle

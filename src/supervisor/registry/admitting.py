"""The registry's side of memory: admission for each runner of its models
(``memory.admission`` decides; this estimates the model and evicts idle
models when told to), and keep-alive expiry, which unloads models idle
longer than their keep-alive."""

from __future__ import annotations

import functools
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import anyio
import msgspec
from anyio.abc import TaskGroup

from ipc.messages import MemoryPlan
from supervisor.boundary import contained
from supervisor.events import EventHub
from supervisor.memory.admission import Admission
from supervisor.memory.estimate import estimate_reference, with_draft
from supervisor.memory.ranks import group_estimate
from supervisor.metrics import Metrics
from supervisor.registry.entries import ModelEntry
from supervisor.runners.handle import RunnerHandle
from supervisor.runners.placement import Place, group_places, is_group
from supervisor.runners.spare import HotSpare, spare_fits
from supervisor.waiting import first_of

Evict = Callable[[str, str], Awaitable[bool]]
"""Unloads the model of that name, for that reason; False when it had gone
meanwhile (nothing was unloaded)."""


class Admitter:
    """Admits the registry's models' runners and expires idle models.

    Args:
        admission: the daemon's admission (the memory budget and its lock).
        spare: the hot spare, whose warm footprint the estimates plan for.
        entries: the registry's models, by name (read, never changed here).
        task_group: where runtime measurements and expiries run.
        counters: the registry's counters.
        evict: unloads a model to make room, or once it has expired.
        metrics: where evictions and refusals count, per model.
        events: where evictions, expiries and refusals are published.
    """

    def __init__(
        self,
        admission: Admission,
        spare: HotSpare,
        entries: dict[str, ModelEntry],
        task_group: TaskGroup,
        counters: Counter[str],
        evict: Evict,
        *,
        metrics: Metrics,
        events: EventHub,
    ) -> None:
        self.admission = admission
        self.spare = spare
        self.entries = entries
        self.task_group = task_group
        self.counters = counters
        self.evict = evict
        self.metrics = metrics
        self.events = events
        self._idle_changed = anyio.Event()

    def idle_changed(self) -> None:
        """A model became idle or busy: keep-alive recomputes its deadline."""
        self._idle_changed.set()

    async def admit(self, entry: ModelEntry, reason: str, floor_bytes: int) -> None:
        """Admission for the entry's next runner. The model is estimated afresh each
        time (a hub model is on disk only once a runner fetched it), with the runtime
        this daemon measured: its warm spare, else a runner at its start (see
        :meth:`_measure_runtime`). On success ``entry.plan`` is set and
        ``entry.admitted`` true.

        Raises:
            AdmissionRefused: it does not fit, even after evicting idle models.
        """
        self.metrics.model_seen(entry.name)
        estimate = None
        try:
            spec = entry.spec
            estimate = await anyio.to_thread.run_sync(functools.partial(
                estimate_reference, spec.model, spec.context_tokens,
                kv_bits=spec.kv_bits, kv_group_size=spec.kv_group_size,
            ))  # fmt: skip
            if estimate is not None and spec.draft_model is not None:  # the runner loads both
                draft = await anyio.to_thread.run_sync(functools.partial(
                    estimate_reference, spec.draft_model, spec.context_tokens,
                    kv_bits=spec.kv_bits, kv_group_size=spec.kv_group_size,
                ))  # fmt: skip
                if draft is None:  # not on this machine yet: the model's alone is planned
                    entry.log.warning("draft_estimate_missing", draft_model=spec.draft_model)
                else:
                    estimate = with_draft(estimate, draft, spec.draft_model)
        except (OSError, ValueError) as exc:  # unreadable or corrupt files: the load will say
            entry.log.warning("estimate_failed", error=str(exc))
        baseline = self.admission.baseline
        baseline.observe(self.spare.warm_footprint_bytes(), "spare")
        if estimate is not None:
            estimate = baseline.apply(estimate)
            try:  # a hostfile is read: off the event loop
                places = await anyio.to_thread.run_sync(group_places, entry.spec)
            except ValueError:  # the runner's start says so
                places = [Place(None, "")]
            here = sum(place.host is None for place in places)
            if len(places) > 1:
                one = group_estimate(estimate, len(places), local=1)
                entry.rank_need_bytes = one.total_bytes
            entry.estimate = group_estimate(estimate, len(places), here)
            entry.log.info("model_estimate", **msgspec.structs.asdict(entry.estimate))

        def spare_bytes() -> int:
            takes_spare = spare_fits(entry.spec) and not is_group(entry.spec)
            return self.spare.warm_footprint_bytes() if takes_spare else 0

        def grant(plan: MemoryPlan) -> None:  # under the admission lock
            entry.plan = plan
            entry.admitted = True

        await self.admission.admit(
            entry.name,
            entry.estimate,
            reason=reason,
            others=lambda: [e for e in list(self.entries.values()) if e is not entry],
            evict=functools.partial(self.evict_to_make_room, for_model=entry.name),
            grant=grant,
            spare_bytes=spare_bytes,
            floor_bytes=floor_bytes,
        )
        if not baseline.measured and not is_group(entry.spec):
            self.task_group.start_soon(contained, f"measure runtime {entry.name}",
                                       self._measure_runtime, entry)  # fmt: skip

    async def evict_to_make_room(self, name: str, reason: str, *, for_model: str) -> bool:
        """Unload ``name`` to make room for ``for_model``; counted and
        published once it is unloaded. False (nothing counted, nothing
        published) when it had gone meanwhile."""
        if not await self.evict(name, reason):
            return False
        self.metrics.evicted(name)
        self.events.publish("model_evicted", name, reason=reason, for_model=for_model)
        return True

    async def _measure_runtime(self, entry: ModelEntry) -> None:
        """Until a spare has been measured: the footprint of the entry's admitted runner
        as soon as it has imported mlx, before its weights, is the runtime every later
        estimate plans."""
        while entry.state == "starting":  # admitted: its runner is on its way
            await entry.state_changed.wait()
        handle = entry.handle
        if entry.state != "loading" or not isinstance(handle, RunnerHandle):
            return  # it failed to start, or was unloaded meanwhile
        await first_of(handle.warm, handle.exited)
        if handle.host is None:  # as it started, before its weights
            self.admission.baseline.observe(handle.runtime_bytes, "runner")

    def refuse(self, entry: ModelEntry, message: str) -> None:
        """Admission refused the entry's runner: a first load fails with
        insufficient_memory; a restart leaves the model failed, not looping."""
        entry.log.error("admission_refused", reason=message)
        self.events.publish("admission_refused", entry.name, reason=message)
        self.metrics.admission_refused(entry.name)
        entry.load_error = message
        entry.load_error_code = "insufficient_memory"
        entry.failure = f"insufficient memory: {message}"
        entry.plan = None
        if entry.state != "stopping":
            entry.move("failed")  # wakes requests waiting for it
        if entry.loaded.is_set() or entry.keep_if_first_load_fails:
            self.counters["failed"] += 1

    async def expire_idle(self) -> None:
        """Unload models idle longer than their keep-alive (never pinned ones),
        and models a reload removed from the config, once nothing uses them.

        Sleeps until the earliest deadline; a request starting or ending, or a
        model becoming ready, wakes it to recompute.
        """
        while True:
            self._idle_changed = anyio.Event()  # before the scan: no change is missed
            now = time.monotonic()
            next_deadline = math.inf
            for entry in list(self.entries.values()):
                deadline = entry.expires_at()
                if deadline is None:
                    continue
                if deadline <= now:
                    self.task_group.start_soon(contained, f"expire {entry.name}", self._expire,
                                               entry, name=f"expire {entry.name}")  # fmt: skip
                else:
                    next_deadline = min(next_deadline, deadline)
            with anyio.move_on_after(max(next_deadline - time.monotonic(), 0.0)):
                await self._idle_changed.wait()

    async def _expire(self, entry: ModelEntry) -> None:
        """Unload ``entry`` if it is still expired: a request may have come first."""
        now = time.monotonic()
        deadline = entry.expires_at()
        if deadline is None or deadline > now or self.entries.get(entry.name) is not entry:
            return
        # From the check to unload()'s stop_requested nothing yields: no request gets in.
        if entry.removed:
            await self.evict(entry.name, "removed from the config")
            return
        self.counters["expired"] += 1
        idle_s = round(now - entry.last_used, 1)
        self.events.publish("model_expired", entry.name, idle_s=idle_s,
                            keep_alive_s=entry.keep_alive_s)  # fmt: skip
        await self.evict(entry.name, f"expired: idle {idle_s}s (keep_alive "
                                     f"{entry.keep_alive_s:g}s)")  # fmt: skip

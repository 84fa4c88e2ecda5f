"""Admission: before every spawn (load, restart, restore), make sure the model fits.

The order of 000's combined model and ADR-016: wait for a dead runner's
memory to come back (the memory gate), keep to ``max_loaded_models``, refuse
a vision model above 70% of the machine, then check the estimate plus
headroom against available memory and the pressure threshold; when it does
not fit, unload idle models in least-recently-used order (never pinned, busy
or loading ones), re-measure, and try again. What still does not fit is
refused with ``insufficient_memory`` and the numbers.

Admissions run one at a time (a lock): two loads must not both count the
same free memory. Memory granted but not yet used counts as taken: a loaded
model's KV cache grows toward its budget as its contexts grow, so what
admission offers is the available memory less each runner's budget not yet
in use (``committed_bytes``).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import anyio
import structlog

from ipc.messages import MemoryPlan
from supervisor.config import SupervisorConfig
from supervisor.memory.estimate import Estimate
from supervisor.memory.monitor import MemoryMonitor, MemorySnapshot, MiB, default_guard_bytes
from supervisor.units import format_bytes

log = structlog.get_logger("supervisor.memory")

VISION_LIMIT_FRACTION = 0.70  # ADR-016: vision models above this share of memory crash on Metal
LARGE_MODEL_FRACTION = 0.70  # text models above it load, with a warning (they swap, slowly)
HEADROOM_FRACTION = 0.05
HEADROOM_FLOOR_BYTES = 256 * MiB
# Metal: the GPU's recommended working set is about 3/4 of RAM on Apple silicon;
# the sum of our runners' wired limits stays under it.
METAL_WORKING_SET_FRACTION = 0.75
# Memory has stopped coming back when two readings 250 ms apart differ by less
# than this share of what departed (or the floor).
SETTLED_SHARE = 0.02
SETTLED_FLOOR_BYTES = 8 * MiB


class AdmissionRefused(Exception):
    """The model does not fit; the message gives needed, available and what was evicted."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Candidate(Protocol):
    """What admission needs to know of a loaded model (a registry entry)."""

    @property
    def name(self) -> str: ...
    @property
    def evictable(self) -> bool: ...
    @property
    def last_used(self) -> float: ...
    @property
    def holds_runner(self) -> bool: ...
    @property
    def wired_limit_bytes(self) -> int | None: ...
    @property
    def budget_bytes(self) -> int | None: ...
    @property
    def footprint_bytes(self) -> int: ...


Evict = Callable[[str, str], Awaitable[None]]
"""Unload the named model, giving a reason (the registry's eviction)."""


@dataclass
class Departure:
    """A runner that just died or was unloaded: its memory is on its way back."""

    name: str
    footprint_bytes: int
    available_before: int  # the machine's available memory while it still lived
    at: float  # time.monotonic()


class Admission:
    """Decides whether a model may start a runner, and with what memory plan.

    Args:
        config: the daemon config (headroom, guard, gate timeout, caps).
        monitor: the memory monitor (fresh samples, the gate's polling).
        counters: the registry's counters (evictions, refusals, gate timeouts).
    """

    def __init__(
        self, config: SupervisorConfig, monitor: MemoryMonitor, counters: Counter[str]
    ) -> None:
        self.config = config
        self.monitor = monitor
        self.counters = counters
        self.lock = anyio.Lock()
        self.departures: list[Departure] = []

    # --- sizes -----------------------------------------------------------------

    def headroom_bytes(self, total_bytes: int) -> int:
        """Added to every estimate: what the estimate may miss."""
        if self.config.memory_headroom_bytes is not None:
            return self.config.memory_headroom_bytes
        return max(int(total_bytes * HEADROOM_FRACTION), HEADROOM_FLOOR_BYTES)

    def guard_bytes(self, snapshot: MemorySnapshot) -> int:
        """Memory the runners' guards keep free on the machine (0: off)."""
        if self.config.memory_guard_bytes is not None:
            return self.config.memory_guard_bytes
        return default_guard_bytes(snapshot.total_bytes, snapshot.real_total_bytes)

    # --- the memory gate ---------------------------------------------------------

    def note_departure(self, name: str, footprint_bytes: int, alive_since: float) -> None:
        """A runner of ``name`` holding ``footprint_bytes``, alive since the
        monotonic time ``alive_since``, has just been reaped."""
        latest = self.monitor.latest
        if footprint_bytes <= 0 or latest.taken_at < alive_since:
            return  # the last reading never saw it: its memory is not missing from it
        self.departures.append(Departure(name, footprint_bytes, latest.available_bytes,
                                         time.monotonic()))  # fmt: skip

    async def wait_returned(
        self, room: Callable[[MemorySnapshot], bool], footprint_bytes: int
    ) -> tuple[bool, MemorySnapshot]:
        """Poll every 250 ms until ``room`` holds or memory stops coming back.

        Freed memory reaches the OS late (wired Metal memory most of all) and
        no event says when: this waits while available memory still grows by
        more than :data:`SETTLED_SHARE` of ``footprint_bytes`` between two
        readings, up to ``memory_gate_timeout_s``. Returns whether it ended
        in time (room or settled), and the last snapshot.
        """
        previous: list[int] = []
        settle_bytes = max(int(footprint_bytes * SETTLED_SHARE), SETTLED_FLOOR_BYTES)

        def done(snapshot: MemorySnapshot) -> bool:
            if room(snapshot):
                return True
            grew = snapshot.available_bytes - previous[-1] if previous else None
            previous.append(snapshot.available_bytes)
            return grew is not None and grew < settle_bytes

        return await self.monitor.wait_for(done, timeout_s=self.config.memory_gate_timeout_s)

    async def gate(self, room: Callable[[MemorySnapshot], bool] | None) -> MemorySnapshot:
        """Wait for the memory of runners that just went (ADR-016 2b).

        Until the next model fits (``room``), or the departed memory has
        stopped coming back (see :meth:`wait_returned`); with no estimate,
        until what they held would fit again. On timeout logs a warning with
        the numbers and goes on. Returns a fresh snapshot.
        """
        timeout_s = self.config.memory_gate_timeout_s
        now = time.monotonic()
        pending = [d for d in self.departures if now - d.at < max(timeout_s, 0.001)]
        self.departures.clear()
        if not pending:
            return await self.monitor.sample_async()
        footprint = sum(d.footprint_bytes for d in pending)
        before = min(d.available_before for d in pending)
        started = time.monotonic()
        met, snapshot = await self.wait_returned(
            room or (lambda snapshot: snapshot.fits(footprint)), footprint
        )
        returned = snapshot.available_bytes - before
        fields = {
            "departed": [d.name for d in pending],
            "waited_s": round(time.monotonic() - started, 3),
            "footprint_bytes": footprint,
            "returned_bytes": returned,
            "returned_share": round(returned / footprint, 3) if footprint else None,
            "available_bytes": snapshot.available_bytes,
        }
        if met:
            log.info("memory_gate_passed", **fields)
        else:
            self.counters["memory_gate_timeouts"] += 1
            log.warning("memory_gate_timeout", timeout_s=timeout_s, **fields)
        return snapshot

    # --- admission -----------------------------------------------------------------

    async def admit(
        self,
        name: str,
        estimate: Estimate | None,
        *,
        reason: str,
        others: Callable[[], Iterable[Candidate]],
        evict: Evict,
        grant: Callable[[MemoryPlan], None],
        spare_bytes: Callable[[], int] = lambda: 0,
        floor_bytes: int = 0,
    ) -> None:
        """Admit ``name`` (estimated at ``estimate``) or raise AdmissionRefused.

        ``others()`` lists the other models; ``evict`` unloads one of them;
        ``grant`` receives the memory plan while the lock is still held, so
        the next admission already counts it. ``spare_bytes()`` is what the
        warm spare this load will take holds (already counted as used, and
        part of the estimate). ``floor_bytes``: after a memory death, what
        the dead runner reached; the restart must have room for at least
        that. ``reason`` (load, restart, ...) goes in the log.
        """
        async with self.lock:
            plan = await self._admit(
                name, estimate, reason, others, evict, spare_bytes(), floor_bytes
            )
            grant(plan)

    async def _admit(
        self,
        name: str,
        estimate: Estimate | None,
        reason: str,
        others: Callable[[], Iterable[Candidate]],
        evict: Evict,
        spare_bytes: int,
        floor_bytes: int,
    ) -> MemoryPlan:
        evicted: list[str] = []
        snapshot = await self.monitor.sample_async()
        headroom = self.headroom_bytes(snapshot.total_bytes)
        guard = self.guard_bytes(snapshot)
        needed: int | None = None
        if estimate is not None or floor_bytes:
            estimated = estimate.total_bytes if estimate is not None else 0
            needed = max(estimated, floor_bytes) + headroom

        def room(snapshot: MemorySnapshot) -> bool:
            # The spare's RSS is counted as used and is part of the estimate too.
            assert needed is not None
            less = self._less_committed(snapshot, others())
            wanted = max(needed - spare_bytes, 0)
            return less.fits(wanted) and less.available_bytes - wanted >= guard

        snapshot = await self.gate(room if needed is not None else None)

        cap = self.config.max_loaded_models
        while cap and sum(1 for o in others() if o.holds_runner) >= cap:
            victim = self._victim(others())
            if victim is None:
                self.counters["admission_refused"] += 1
                raise AdmissionRefused(
                    f"{name}: max_loaded_models={cap} reached and no idle model can be "
                    "unloaded (the others are pinned, busy or loading)"
                )
            footprint = victim.footprint_bytes
            await self._evict(victim, name, "max_loaded_models", evict, evicted)
            _, snapshot = await self.wait_returned(room if needed else lambda s: False,
                                                   footprint)  # fmt: skip

        total = snapshot.total_bytes
        if needed is None:
            log.warning("admission_without_estimate", model=name, reason=reason,
                        note="model not on this machine yet: no size to check")  # fmt: skip
            return self._plan(snapshot, None, others(), spare_bytes, guard)
        if (
            estimate is not None
            and estimate.vision
            and (estimate.total_bytes > VISION_LIMIT_FRACTION * total)
        ):
            self.counters["admission_refused"] += 1
            raise AdmissionRefused(
                f"{name} is a vision model needing {format_bytes(estimate.total_bytes)}, "
                f"more than {VISION_LIMIT_FRACTION:.0%} of this machine's "
                f"{format_bytes(total)}: vision encoders crash with Metal OOM there (ADR-016)"
            )
        if needed - headroom > LARGE_MODEL_FRACTION * total:
            log.warning("model_exceeds_70pct", model=name, estimate_bytes=needed - headroom,
                        total_bytes=total, note="expect swapping and extreme slowness")  # fmt: skip
        while not room(snapshot):
            victim = self._victim(others())
            if victim is None:
                self.counters["admission_refused"] += 1
                less = self._less_committed(snapshot, others())
                committed = self.committed_bytes(others())
                gone = f"; evicted {', '.join(evicted)}" if evicted else "; nothing idle to evict"
                basis = (
                    f"estimate {format_bytes(estimate.total_bytes)}" if estimate is not None
                    else "no estimate"
                )  # fmt: skip
                if floor_bytes:
                    basis += f", at least the {format_bytes(floor_bytes)} its last runner reached"
                raise AdmissionRefused(
                    f"{name} needs {format_bytes(needed)} ({basis}; + headroom "
                    f"{format_bytes(headroom)}), and {format_bytes(guard)} must stay free for "
                    f"the guards, but {less.describe()}"
                    + (f" after {format_bytes(committed)} granted to loaded models" if committed
                       else "")
                    + gone
                )  # fmt: skip
            footprint = victim.footprint_bytes
            await self._evict(victim, name, "memory", evict, evicted)
            _, snapshot = await self.wait_returned(room, footprint)
        log.info("admitted", model=name, reason=reason, needed_bytes=needed,
                 available_bytes=snapshot.available_bytes, evicted=evicted)  # fmt: skip
        return self._plan(snapshot, needed, others(), spare_bytes, guard)

    @staticmethod
    def committed_bytes(others: Iterable[Candidate]) -> int:
        """Granted to running models but not in use yet (budget above footprint)."""
        return sum(
            max((o.budget_bytes or 0) - o.footprint_bytes, 0) for o in others if o.holds_runner
        )

    def _less_committed(
        self, snapshot: MemorySnapshot, others: Iterable[Candidate]
    ) -> MemorySnapshot:
        committed = self.committed_bytes(others)
        if not committed:
            return snapshot
        return dataclasses.replace(
            snapshot, available_bytes=max(snapshot.available_bytes - committed, 0)
        )

    def _victim(self, others: Iterable[Candidate]) -> Candidate | None:
        """The least recently used model that may be unloaded, if any."""
        idle = [o for o in others if o.evictable]
        return min(idle, key=lambda o: o.last_used, default=None)

    async def _evict(
        self, victim: Candidate, for_name: str, why: str, evict: Evict, evicted: list[str]
    ) -> None:
        reason = f"evicted ({why}) to make room for {for_name}"
        log.warning("model_evicting", model=victim.name, reason=reason)
        self.counters["evicted"] += 1
        evicted.append(victim.name)
        with anyio.CancelScope(shield=True):  # an unload is never left half-way
            await evict(victim.name, reason)

    def _plan(
        self,
        snapshot: MemorySnapshot,
        needed: int | None,
        others: Iterable[Candidate],
        spare_bytes: int,
        guard: int,
    ) -> MemoryPlan:
        budget = needed  # what it was admitted with: estimate (or floor) + headroom
        wired = None
        if sys.platform == "darwin":
            working_set = int(snapshot.real_total_bytes * METAL_WORKING_SET_FRACTION)
            taken = sum(o.wired_limit_bytes or 0 for o in others if o.holds_runner)
            wired = max(min(budget or working_set, working_set - taken), 0)
        return MemoryPlan(
            total_bytes=snapshot.total_bytes,
            override=snapshot.override_mb is not None,
            # Under an override the runner counts what our other runners hold
            # as used; the spare it is about to become is itself.
            others_bytes=(
                max(snapshot.runners_bytes - spare_bytes, 0)
                if snapshot.override_mb is not None
                else 0
            ),
            budget_bytes=budget,
            guard_bytes=guard,
            threshold_pct=snapshot.threshold_pct,
            wired_limit_bytes=wired,
        )

"""Admission: before every spawn (load, restart, restore), make sure the model fits.

The order of 000's combined model and ADR-016: wait for a dead runner's
memory to come back (the memory gate), keep to ``max_loaded_models``, refuse
a vision model above 70% of the machine, then check the estimate plus
headroom against available memory and the pressure threshold; when it does
not fit, unload idle models in least-recently-used order (never pinned, busy
or loading ones), re-measure, and try again. What still does not fit is
refused with ``insufficient_memory`` and the numbers. A load that would not
fit even with every idle model gone (their measured footprints back, their
grants released) is refused before the first eviction: nothing is unloaded
for a load that is refused anyway.

The estimate's runtime part is this daemon's measurement (:attr:`Admission.baseline`,
fed by the registry), and its headroom a share of the model (``memory_headroom_bytes``
overrides it).

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
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import anyio
import msgspec
import structlog

from ipc.messages import MemoryPlan
from supervisor.config import SupervisorConfig
from supervisor.memory.baseline import RuntimeBaseline
from supervisor.memory.estimate import HEADROOM_SHARE, Estimate, describe_estimate
from supervisor.memory.monitor import MemoryMonitor, MemorySnapshot, MiB, default_guard_bytes
from supervisor.units import format_bytes

log = structlog.get_logger("supervisor.memory")

VISION_LIMIT_FRACTION = 0.70  # ADR-016: vision models above this share of memory crash on Metal
LARGE_MODEL_FRACTION = 0.70  # text models above it load, with a warning (they swap, slowly)
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


Evict = Callable[[str, str], Awaitable[bool]]
"""Unload the named model, giving a reason (the registry's eviction); False
when it had gone meanwhile (nothing was evicted)."""


def committed_bytes(others: Iterable[Candidate]) -> int:
    """Granted to running models but not in use yet (budget above footprint)."""
    return sum(max((o.budget_bytes or 0) - o.footprint_bytes, 0) for o in others if o.holds_runner)


def less_committed(snapshot: MemorySnapshot, others: Iterable[Candidate]) -> MemorySnapshot:
    """``snapshot`` with what the running ``others`` were granted and do not use yet taken
    from the available memory: what admission may offer."""
    committed = committed_bytes(others)
    if not committed:
        return snapshot
    return dataclasses.replace(
        snapshot, available_bytes=max(snapshot.available_bytes - committed, 0)
    )


def has_room(
    snapshot: MemorySnapshot, others: Iterable[Candidate], wanted_bytes: int, guard_bytes: int
) -> bool:
    """The admission rule: ``wanted_bytes`` more fit in what ``snapshot`` has available, less
    the others' grants not in use yet, without passing the pressure threshold, and with
    ``guard_bytes`` left over for the runners' guards."""
    less = less_committed(snapshot, others)
    return less.fits(wanted_bytes) and less.available_bytes - wanted_bytes >= guard_bytes


def with_unloaded(
    snapshot: MemorySnapshot, others: Sequence[Candidate], gone: Sequence[Candidate]
) -> tuple[MemorySnapshot, list[Candidate]]:
    """What admission would see with the models ``gone`` unloaded: their measured footprints
    available again (never beyond the total), and the others that would remain, so their
    grants no longer count."""
    names = {o.name for o in gone}
    back = sum(o.footprint_bytes for o in gone if o.holds_runner)
    after = dataclasses.replace(
        snapshot,
        available_bytes=min(snapshot.available_bytes + back, snapshot.total_bytes),
        runners_bytes=max(snapshot.runners_bytes - back, 0),
    )
    return after, [o for o in others if o.name not in names]


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
        self.baseline = RuntimeBaseline()  # the runtime part of every estimate, measured

    # --- sizes -----------------------------------------------------------------

    def with_headroom(self, estimate: Estimate) -> Estimate:
        """``estimate`` with the headroom admission adds to it: its own (a share of the
        model), or ``memory_headroom_bytes`` where configured."""
        configured = self.config.memory_headroom_bytes
        if configured is None:
            return estimate
        return msgspec.structs.replace(estimate, headroom_bytes=configured)

    def floor_headroom_bytes(self, floor_bytes: int) -> int:
        """Headroom over a floor (what a dead runner reached) when there is no estimate."""
        configured = self.config.memory_headroom_bytes
        return round(HEADROOM_SHARE * floor_bytes) if configured is None else configured

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
        guard = self.guard_bytes(snapshot)
        needed: int | None = None
        headroom = 0
        if estimate is not None:
            estimate = self.with_headroom(estimate)
            headroom = estimate.headroom_bytes
        elif floor_bytes:
            headroom = self.floor_headroom_bytes(floor_bytes)
        if estimate is not None or floor_bytes:
            estimated = estimate.total_bytes if estimate is not None else 0
            needed = max(estimated, floor_bytes) + headroom
        # The spare's RSS is counted as used and is part of the estimate too.
        wanted = max((needed or 0) - spare_bytes, 0)
        basis = self._basis(estimate, floor_bytes, headroom, spare_bytes)

        def room(snapshot: MemorySnapshot) -> bool:
            return has_room(snapshot, others(), wanted, guard)

        snapshot = await self.gate(room if needed is not None else None)
        if needed is not None:
            self._refuse_if_never_fits(name, estimate, needed, basis, wanted, guard, snapshot,
                                       list(others()))  # fmt: skip

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
        if needed - headroom > LARGE_MODEL_FRACTION * total:
            log.warning("model_exceeds_70pct", model=name, estimate_bytes=needed - headroom,
                        total_bytes=total, note="expect swapping and extreme slowness")  # fmt: skip
        while not room(snapshot):
            victim = self._victim(others())
            if victim is None:
                self.counters["admission_refused"] += 1
                less = less_committed(snapshot, others())
                committed = committed_bytes(others())
                gone = f"; evicted {', '.join(evicted)}" if evicted else "; nothing idle to evict"
                raise AdmissionRefused(
                    f"{name} needs {format_bytes(needed)} ({basis}), and {format_bytes(guard)} "
                    f"must stay free for the guards, but {less.describe()}"
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
    def _basis(
        estimate: Estimate | None, floor_bytes: int, headroom_bytes: int, spare_bytes: int
    ) -> str:
        """What a need was computed from, for the refusal: the estimate's parts, the floor
        after a memory death, the headroom, and the part the warm spare already holds."""
        if estimate is not None:
            basis = describe_estimate(estimate)
            if floor_bytes:
                basis += f"; at least the {format_bytes(floor_bytes)} its last runner reached"
        else:
            basis = (
                f"no estimate; at least the {format_bytes(floor_bytes)} its last runner "
                f"reached; + headroom {format_bytes(headroom_bytes)}"
            )
        if spare_bytes:
            basis += f"; the warm spare it takes holds {format_bytes(spare_bytes)} of it"
        return basis

    def _refuse_if_never_fits(
        self,
        name: str,
        estimate: Estimate | None,
        needed: int,
        basis: str,
        wanted: int,
        guard: int,
        snapshot: MemorySnapshot,
        others: Sequence[Candidate],
    ) -> None:
        """Refuse, before anything is evicted, a load that cannot fit whatever is evicted:
        a vision model too large for Metal (ADR-016), or one that would not fit even with
        every idle model unloaded (by :func:`has_room`, the rule the eviction loop uses)."""
        total = snapshot.total_bytes
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
        idle = [o for o in others if o.evictable]
        if not idle or has_room(snapshot, others, wanted, guard):
            return  # nothing to evict (the loop refuses), or it fits now
        after, remaining = with_unloaded(snapshot, others, idle)
        if has_room(after, remaining, wanted, guard):
            return
        self.counters["admission_refused"] += 1
        now = less_committed(snapshot, others).available_bytes
        more = less_committed(after, remaining).available_bytes - now
        committed = committed_bytes(others)
        log.warning("admission_never_fits", model=name, needed_bytes=needed,
                    available_bytes=now, evictable_bytes=more,
                    idle=[o.name for o in idle])  # fmt: skip
        raise AdmissionRefused(
            f"{name} needs {format_bytes(needed)} ({basis}); {format_bytes(now)} available"
            + (f" after {format_bytes(committed)} granted to loaded models" if committed else "")
            + f", {format_bytes(more)} more if every idle model were unloaded "
            f"({', '.join(o.name for o in idle)}), and {format_bytes(guard)} must stay free "
            f"for the guards ({snapshot.describe()}): it cannot fit, so nothing was evicted"
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
        with anyio.CancelScope(shield=True):  # an unload is never left half-way
            gone = await evict(victim.name, reason)
        if gone:  # counted once it is: one that went meanwhile was not evicted
            self.counters["evicted"] += 1
            evicted.append(victim.name)

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

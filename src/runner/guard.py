"""Memory limits and guards inside the runner.

The supervisor hands each runner a :class:`~ipc.messages.MemoryPlan` with its
LoadModel. From it this module:

- sets MLX's memory, cache and wired limits before the load, from four
  candidates (reference 000 §2); the smallest valid one wins;
- guards the load: after each layer is evaluated, the machine must keep the
  plan's ``guard_bytes`` free and the runner's footprint must stay within its
  ``budget_bytes``, else :class:`MemoryGuardError` (the runner exits with
  status 73);
- guards generation: every :data:`CHECK_EVERY_TOKENS` tokens it looks
  again, warns once per request past the plan's pressure threshold, and when
  memory is critical runs an emergency cleanup, then stops the request if it
  still is (``finish_reason="memory_pressure"``; the runner stays up). A
  full measurement (psutil: RSS and the machine) is at most
  :data:`FULL_MEASURE_INTERVAL_S` old at a check; in between, MLX's own
  counters (free to read) carry the last one forward, and any growth that
  could matter measures at once;
- keeps the latest :class:`~ipc.messages.MemoryFigures`, which the pipe-reader
  thread sends in Pongs without touching mlx.

On the CPU backend MLX only stores its limits (allocations never fail
against them; a real failure is a SIGSEGV), so the guards measure and enforce
the budget themselves: the footprint is the larger of the process's RSS and
MLX's active + cache memory. On Metal the limits apply as well.

Each check runs when its number is set: the free-memory check when
``guard_bytes > 0``, the budget check when ``budget_bytes`` is not None, the
pressure warning below ``threshold_pct``. Without a plan (an old client, a
test) nothing is checked and no limit is set, but figures are still measured.

The decisions (:func:`choose_memory_limits`, :func:`memory_view`,
:func:`assess`) are pure functions of numbers; :class:`MemoryGuard` is the
thin glue that measures (psutil, mlx) and acts.
"""

from __future__ import annotations

import gc
import importlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil
import structlog

from ipc.messages import MemoryFigures, MemoryPlan

__all__ = [
    "CACHE_FRACTION_OF_LIMIT",
    "CHECK_EVERY_TOKENS",
    "FULL_MEASURE_INTERVAL_S",
    "LIMIT_FRACTION_OF_TOTAL",
    "Assessment",
    "LimitCandidate",
    "MemoryGuard",
    "MemoryGuardError",
    "MemoryLimits",
    "MemorySample",
    "MemoryView",
    "RequestGuard",
    "assess",
    "choose_memory_limits",
    "describe_pressure",
    "format_gib",
    "limit_floor_bytes",
    "measure_memory",
    "memory_view",
    "neutralise_mlx_lm_wired_limit",
]

MiB = 1 << 20
GiB = 1 << 30

CHECK_EVERY_TOKENS = 16
"""The generation guard looks every this many tokens (the reference's
cadence): a decode step adds one token's KV, so 16 steps cannot outrun it."""

FULL_MEASURE_INTERVAL_S = 0.1
"""A generation check measures in full (psutil: the process's RSS, the
machine's available memory; ~150 us, ~350 us while mlx's threads hold both
cores) when the last full measurement is this old. Between, it reads MLX's
own counters (well under a microsecond) and adds their growth to the last
full view; growth that makes that estimate warn or go critical measures at
once. On a fast model (builtin:tiny: 16 tokens in ~25 ms) a full reading
every check cost 1.4 % of the decode rate; on the models the reference's
cadence was made for (16 tokens in 0.4-1 s) every check is still full. What
the estimate cannot see is other processes' growth, which is seen within
this interval."""

LIMIT_FRACTION_OF_TOTAL = 0.85
"""The ``fraction_of_total`` candidate: the largest machine tier of exo's
thresholds; the rest is the OS's and other programs'."""

CACHE_FRACTION_OF_LIMIT = 0.25
"""MLX's buffer cache may hold this share of the memory limit: enough for
decode to reuse its buffers, little enough that freed memory is returned
(the guards count the cache in the footprint)."""

LIMIT_FLOOR_SHARE = 1 / 256
LIMIT_FLOOR_MIN_BYTES = 64 * MiB
"""A limit candidate at or below the floor is discarded as nonsense (a
momentarily full machine, a device that reports nothing). The reference used
2 GiB on 512 GiB machines: 1/256 of the total, here at least 64 MiB."""

log = structlog.get_logger("runner")


def format_gib(n: int | None) -> str:
    """Bytes for people, as the guard messages write them: ``3.2 GiB``, or
    ``12.5 MiB`` below a tenth of a GiB; None is ``none``."""
    if n is None:
        return "none"
    if abs(n) >= GiB // 10:
        return f"{n / GiB:.1f} GiB"
    return f"{n / MiB:.1f} MiB"


# --- the view of memory from inside the runner (pure) ---------------------------------------


@dataclass(frozen=True, slots=True)
class MemorySample:
    """One measurement of this process and the machine, in bytes."""

    rss_bytes: int
    active_bytes: int  # MLX's, as the rest
    cache_bytes: int
    peak_bytes: int
    available_bytes: int  # the machine's own available memory
    total_bytes: int  # the machine's own total

    @property
    def footprint_bytes(self) -> int:
        """What this runner holds: its RSS or MLX's active + cache, the larger."""
        return max(self.rss_bytes, self.active_bytes + self.cache_bytes)


@dataclass(frozen=True, slots=True)
class MemoryView:
    """Memory as the guards see it: the plan's machine and this runner's footprint."""

    total_bytes: int
    remaining_bytes: int
    footprint_bytes: int

    @property
    def pressure_pct(self) -> float:
        """Share of the machine in use, in percent."""
        if self.total_bytes <= 0:
            return 0.0
        return 100.0 * (self.total_bytes - self.remaining_bytes) / self.total_bytes


def memory_view(sample: MemorySample, plan: MemoryPlan | None) -> MemoryView:
    """The guards' view of ``sample`` under ``plan``.

    Remaining memory is the machine's available memory; under an override it
    is at most what the believed machine has left once the daemon's other
    runners (``others_bytes``) and this one are counted. Without a plan the
    machine's own total is used.
    """
    total = sample.total_bytes if plan is None else plan.total_bytes
    remaining = sample.available_bytes
    if plan is not None and plan.override:
        remaining = min(remaining, plan.total_bytes - plan.others_bytes - sample.footprint_bytes)
    return MemoryView(total, max(remaining, 0), sample.footprint_bytes)


@dataclass(frozen=True, slots=True)
class Assessment:
    """What the guards make of one view."""

    warn: bool  # pressure at or past the plan's threshold
    low_memory: bool  # less than guard_bytes left on the machine
    over_budget: bool  # the footprint is past budget_bytes

    @property
    def critical(self) -> bool:
        """Whether the runner must free memory, or stop what it is doing."""
        return self.low_memory or self.over_budget


def assess(view: MemoryView, plan: MemoryPlan | None) -> Assessment:
    """Judge ``view`` against ``plan``; every check whose number is unset is off."""
    if plan is None:
        return Assessment(warn=False, low_memory=False, over_budget=False)
    return Assessment(
        warn=view.pressure_pct >= plan.threshold_pct,
        low_memory=plan.guard_bytes > 0 and view.remaining_bytes < plan.guard_bytes,
        over_budget=plan.budget_bytes is not None and view.footprint_bytes > plan.budget_bytes,
    )


def describe_pressure(view: MemoryView, plan: MemoryPlan, where: str) -> str:
    """The ``detail`` of a request stopped by the generation guard, e.g.
    ``memory pressure: 0.4 GiB left (guard 1.0 GiB), footprint 3.1 GiB over
    budget 2.5 GiB; request stopped at token 48``."""
    left = f"{format_gib(view.remaining_bytes)} left"
    parts = [f"{left} (guard {format_gib(plan.guard_bytes)})" if plan.guard_bytes > 0 else left]
    if plan.budget_bytes is not None:
        over = "over" if view.footprint_bytes > plan.budget_bytes else "within"
        parts.append(
            f"footprint {format_gib(view.footprint_bytes)} {over} "
            f"budget {format_gib(plan.budget_bytes)}"
        )
    return f"memory pressure: {', '.join(parts)}; request stopped {where}"


class MemoryGuardError(RuntimeError):
    """The load guard stopped a load: memory ran short after ``layer`` of ``layers``.

    The message names the layer and the numbers, e.g. ``memory guard:
    remaining memory 3.2 GiB is below the safety threshold 5.0 GiB at layer
    45/182 (footprint 508.8 GiB, budget none, total 512.0 GiB)``.
    """

    def __init__(
        self,
        *,
        layer: int,
        layers: int,
        remaining: int,
        threshold: int,
        footprint: int,
        budget: int | None,
        total: int,
    ) -> None:
        self.layer = layer
        self.layers = layers
        self.remaining = remaining
        self.threshold = threshold
        self.footprint = footprint
        self.budget = budget
        self.total = total
        super().__init__(f"memory guard: {self.reason}")

    @property
    def reason(self) -> str:
        """The message without its ``memory guard:`` prefix."""
        at = f"at layer {self.layer}/{self.layers}"
        if self.threshold > 0 and self.remaining < self.threshold:
            return (
                f"remaining memory {format_gib(self.remaining)} is below the safety threshold "
                f"{format_gib(self.threshold)} {at} (footprint {format_gib(self.footprint)}, "
                f"budget {format_gib(self.budget)}, total {format_gib(self.total)})"
            )
        return (
            f"footprint {format_gib(self.footprint)} is over the budget "
            f"{format_gib(self.budget)} {at} (remaining memory {format_gib(self.remaining)}, "
            f"safety threshold {format_gib(self.threshold)}, total {format_gib(self.total)})"
        )


# --- MLX limits (pure) ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LimitCandidate:
    """One way to size the memory limit (reference 000 §2).

    ``raw_bytes`` is None where the device has no such figure; ``limit_bytes``
    is the value capped by the budget; ``valid`` says whether it counts.
    """

    name: str
    raw_bytes: int | None
    limit_bytes: int | None
    valid: bool


@dataclass(frozen=True, slots=True)
class MemoryLimits:
    """The limits chosen for one load; ``winner`` names the candidate that set
    ``memory_limit_bytes`` (``budget`` when no candidate was valid)."""

    candidates: tuple[LimitCandidate, ...]
    winner: str
    memory_limit_bytes: int
    cache_limit_bytes: int
    wired_limit_bytes: int | None  # None: not set (no Metal working set on this device)


def limit_floor_bytes(total_bytes: int) -> int:
    """Candidates at or below this are discarded: 1/256 of the total, at least 64 MiB."""
    return max(LIMIT_FLOOR_MIN_BYTES, int(total_bytes * LIMIT_FLOOR_SHARE))


def choose_memory_limits(
    plan: MemoryPlan, *, remaining_bytes: int, max_recommended_bytes: int | None
) -> MemoryLimits | None:
    """Pick MLX's limits for a load from the four candidates of reference 000 §2.

    The candidates are ``fraction_of_total`` (:data:`LIMIT_FRACTION_OF_TOTAL`
    of the plan's total), ``total_minus_reserve`` (the total less the plan's
    guard), ``max_recommended_working_set`` (Metal's own figure; absent
    elsewhere) and ``available_minus_margin`` (memory remaining now less the
    guard). A candidate is valid when it is above :func:`limit_floor_bytes`;
    each is capped by the plan's budget, and the smallest valid one wins.
    When none is valid the budget is the limit, or there is none (None).

    The cache limit is :data:`CACHE_FRACTION_OF_LIMIT` of the limit; the wired
    limit (only where Metal reports a working set) is the smallest of the
    limit, the plan's ``wired_limit_bytes`` and the working set.

    Args:
        plan: what the supervisor granted this runner.
        remaining_bytes: memory remaining now, as :func:`memory_view` counts it.
        max_recommended_bytes: ``max_recommended_working_set_size`` from
            ``mx.device_info()``, or None.
    """
    floor = limit_floor_bytes(plan.total_bytes)
    raw: list[tuple[str, int | None]] = [
        ("fraction_of_total", int(plan.total_bytes * LIMIT_FRACTION_OF_TOTAL)),
        ("total_minus_reserve", plan.total_bytes - plan.guard_bytes),
        ("max_recommended_working_set", max_recommended_bytes),
        ("available_minus_margin", remaining_bytes - plan.guard_bytes),
    ]
    budget = plan.budget_bytes

    def capped(value: int | None) -> int | None:
        return value if value is None or budget is None else min(value, budget)

    candidates = tuple(
        LimitCandidate(name, value, capped(value), valid=value is not None and value > floor)
        for name, value in raw
    )
    valid = [c for c in candidates if c.valid and c.limit_bytes is not None]
    if valid:
        best = min(valid, key=lambda c: c.limit_bytes or 0)
        winner, limit = best.name, best.limit_bytes or 0
    elif budget is not None and budget > 0:
        winner, limit = "budget", budget
    else:
        return None
    wired = None
    if max_recommended_bytes is not None:
        wired = min(limit, max_recommended_bytes)
        if plan.wired_limit_bytes is not None:
            wired = min(wired, plan.wired_limit_bytes)
    return MemoryLimits(
        candidates=candidates,
        winner=winner,
        memory_limit_bytes=limit,
        cache_limit_bytes=int(limit * CACHE_FRACTION_OF_LIMIT),
        wired_limit_bytes=wired,
    )


# --- the glue: measuring and acting -----------------------------------------------------------


_process: psutil.Process | None = None


def measure_memory() -> MemorySample:
    """Measure this process (RSS, MLX counters) and the machine now.

    MLX's counters read 0 while ``mlx.core`` is not imported; this never
    imports it. Call it from the main thread only: MLX is not thread-safe.
    """
    global _process
    if _process is None:
        _process = psutil.Process()
    machine = psutil.virtual_memory()
    active = cache = peak = 0
    mx: Any = sys.modules.get("mlx.core")
    if mx is not None:
        try:
            active = int(mx.get_active_memory())
            cache = int(mx.get_cache_memory())
            peak = int(mx.get_peak_memory())
        except AttributeError:  # half-way through its import
            pass
    return MemorySample(
        rss_bytes=int(_process.memory_info().rss),
        active_bytes=active,
        cache_bytes=cache,
        peak_bytes=peak,
        available_bytes=int(machine.available),
        total_bytes=int(machine.total),
    )


def _keep_wired_limit() -> None:
    """Stands in for mlx-lm's ``maybe_set_recommended_wired_limit``: returning
    None makes its ``wired_limit`` context manager (and BatchGenerator) leave
    the wired limit alone."""
    return None


def neutralise_mlx_lm_wired_limit() -> None:
    """Stop mlx-lm from raising the wired limit to the whole working set.

    ``mlx_lm.generate`` imports ``maybe_set_recommended_wired_limit`` from
    ``mlx_lm.utils`` and looks it up in its own globals each time
    ``wired_limit`` (stream_generate) or ``BatchGenerator`` starts; both names
    are replaced. (``mlx_lm.generate`` the attribute is the function, so the
    module is fetched by name.)
    """
    for name in ("mlx_lm.utils", "mlx_lm.generate"):
        module = importlib.import_module(name)
        setattr(module, "maybe_set_recommended_wired_limit", _keep_wired_limit)  # noqa: B010


class MemoryGuard:
    """The runner's memory limits and guards, for the plan of its model.

    ``figures`` holds the latest measured MLX figures (the peak over the
    runner's life); the main thread replaces it on every :meth:`refresh` and
    the pipe-reader thread only reads it, so Pongs never wait on mlx.

    Args:
        plan: the supervisor's plan, or None (no limits, no checks).
        measure: how to measure (tests may pass recorded samples).
    """

    def __init__(
        self,
        plan: MemoryPlan | None = None,
        *,
        measure: Callable[[], MemorySample] = measure_memory,
    ) -> None:
        self.plan = plan
        self.figures = MemoryFigures()
        self.last_view: MemoryView | None = None
        self.limits: MemoryLimits | None = None
        self.cleanup_hooks: list[Callable[[], object]] = []
        self._measure = measure
        self._peak_bytes = 0
        self._measured_at = float("-inf")  # time.monotonic() of the last full measurement
        self._mlx_bytes_then = 0  # MLX's active + cache at that measurement

    def refresh(self) -> MemoryView:
        """Measure now; update ``figures`` and ``last_view``. Main thread only."""
        sample = self._measure()
        self._measured_at = time.monotonic()
        self._mlx_bytes_then = sample.active_bytes + sample.cache_bytes
        self._peak_bytes = max(self._peak_bytes, sample.peak_bytes)
        self.figures = MemoryFigures(sample.active_bytes, sample.cache_bytes, self._peak_bytes)
        view = memory_view(sample, self.plan)
        self.last_view = view
        return view

    def estimate(self) -> MemoryView | None:
        """The last full view carried forward by MLX's own counters (the
        runner's growth since: more footprint, less left), or None when a
        full measurement is due (none yet, or the last is
        :data:`FULL_MEASURE_INTERVAL_S` old). Main thread only."""
        view = self.last_view
        if view is None or time.monotonic() - self._measured_at >= FULL_MEASURE_INTERVAL_S:
            return None
        mx: Any = sys.modules.get("mlx.core")
        if mx is None:
            return None
        grown = int(mx.get_active_memory()) + int(mx.get_cache_memory()) - self._mlx_bytes_then
        if grown <= 0:
            return view
        return MemoryView(
            view.total_bytes, max(view.remaining_bytes - grown, 0), view.footprint_bytes + grown
        )

    def apply_limits(self) -> MemoryLimits | None:
        """Set MLX's memory, cache and (on Metal) wired limits for the plan.

        Logs ``memory_limits`` with every candidate and the winner. Without a
        plan MLX keeps its own defaults. Also stops mlx-lm from raising the
        wired limit during generation (:func:`neutralise_mlx_lm_wired_limit`).
        """
        if self.plan is None:
            log.info("memory_limits", winner=None, reason="no memory plan: MLX defaults kept")
            return None
        import mlx.core as mx

        view = self.refresh()
        recommended = mx.device_info().get("max_recommended_working_set_size")
        limits = choose_memory_limits(
            self.plan,
            remaining_bytes=view.remaining_bytes,
            max_recommended_bytes=None if recommended is None else int(recommended),
        )
        self.limits = limits
        if limits is None:
            log.warning("memory_limits", winner=None, reason="no valid candidate, no budget")
            return None
        mx.set_memory_limit(limits.memory_limit_bytes)
        mx.set_cache_limit(limits.cache_limit_bytes)
        if limits.wired_limit_bytes is not None:
            mx.set_wired_limit(limits.wired_limit_bytes)
        neutralise_mlx_lm_wired_limit()
        log.info(
            "memory_limits",
            winner=limits.winner,
            memory_limit_bytes=limits.memory_limit_bytes,
            cache_limit_bytes=limits.cache_limit_bytes,
            wired_limit_bytes=limits.wired_limit_bytes,
            candidates={c.name: c.limit_bytes if c.valid else None for c in limits.candidates},
            total_bytes=self.plan.total_bytes,
            budget_bytes=self.plan.budget_bytes,
            guard_bytes=self.plan.guard_bytes,
        )
        return limits

    def check_load(self, layer: int, layers: int, view: MemoryView | None = None) -> MemoryView:
        """The load guard, after ``layer`` of ``layers`` was evaluated.

        Measures (unless given ``view``) and raises when the machine keeps
        less than the plan's guard free or the footprint is over budget.

        Raises:
            MemoryGuardError: naming the layer and the numbers.
        """
        if view is None:
            view = self.refresh()
        verdict = assess(view, self.plan)
        if self.plan is not None and verdict.critical:
            raise MemoryGuardError(
                layer=layer,
                layers=layers,
                remaining=view.remaining_bytes,
                threshold=self.plan.guard_bytes,
                footprint=view.footprint_bytes,
                budget=self.plan.budget_bytes,
                total=view.total_bytes,
            )
        return view

    def add_cleanup_hook(self, hook: Callable[[], object]) -> None:
        """Run ``hook`` first in an emergency cleanup (e.g. evict the prefix cache)."""
        self.cleanup_hooks.append(hook)

    def emergency_cleanup(self, reason: str) -> MemoryView:
        """Free what can be freed: the hooks, then gc and MLX's buffer cache.

        A hook that fails is logged and skipped. Returns the view after.
        """
        before = self.last_view
        for hook in self.cleanup_hooks:
            try:
                hook()
            except Exception:
                log.exception("memory_cleanup_hook_failed", hook=repr(hook))
        gc.collect()
        mx: Any = sys.modules.get("mlx.core")
        if mx is not None:
            mx.clear_cache()
        after = self.refresh()
        log.warning(
            "memory_emergency_cleanup",
            reason=reason,
            footprint_before=None if before is None else before.footprint_bytes,
            footprint_after=after.footprint_bytes,
            remaining_after=after.remaining_bytes,
        )
        return after

    def start_request(self, request_id: int) -> RequestGuard:
        """The generation guard for one request."""
        return RequestGuard(self, request_id)


class RequestGuard:
    """The generation guard of one request: warns at most once, stops it when
    memory stays critical after an emergency cleanup."""

    def __init__(self, guard: MemoryGuard, request_id: int) -> None:
        self.guard = guard
        self.request_id = request_id
        self.warned = False

    def at_token(self, tokens: int) -> str | None:
        """Check every :data:`CHECK_EVERY_TOKENS` tokens; the stop detail, or None."""
        if tokens % CHECK_EVERY_TOKENS:
            return None
        return self.at_cadence(f"at token {tokens}")

    def at_cadence(self, where: str) -> str | None:
        """A generation check: from the estimate while it is fresh and
        says nothing new (see :data:`FULL_MEASURE_INTERVAL_S`), else
        :meth:`check` measures in full."""
        estimate = self.guard.estimate()
        if estimate is not None:
            verdict = assess(estimate, self.guard.plan)
            if not verdict.critical and (self.warned or not verdict.warn):
                return None
        return self.check(where)

    def check(self, where: str) -> str | None:
        """Measure and judge now; return why the request must stop, or None.

        ``where`` ends the detail: ``at token 48``, ``in prefill ...``.
        """
        view = self.guard.refresh()  # also the figures Pongs and heartbeats carry
        plan = self.guard.plan
        if plan is None:
            return None
        verdict = assess(view, plan)
        if verdict.warn and not self.warned:
            self.warned = True
            log.warning(
                "memory_pressure_warning",
                request_id=self.request_id,
                pressure_pct=round(view.pressure_pct, 1),
                threshold_pct=plan.threshold_pct,
                remaining_bytes=view.remaining_bytes,
                footprint_bytes=view.footprint_bytes,
                where=where,
            )
        if not verdict.critical:
            return None
        view = self.guard.emergency_cleanup(f"request {self.request_id} {where}")
        if not assess(view, plan).critical:
            return None
        detail = describe_pressure(view, plan, where)
        log.error("memory_pressure_stop", request_id=self.request_id, detail=detail)
        return detail

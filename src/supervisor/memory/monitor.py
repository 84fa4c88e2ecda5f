"""How much memory the machine has, as the daemon believes it.

One reading of the real machine is a :class:`SystemMemory`: psutil
everywhere, and on macOS ``sysctl -n hw.memsize`` plus ``vm_stat``, whose
page categories say what kind of memory is free. *Available* on macOS is
free + speculative + inactive + purgeable pages (see
:func:`macos_available_bytes`); pages held by the compressor are never
counted as available.

A :class:`MemorySnapshot` is what the daemon believes: the reading with the
memory override applied, the pressure threshold, and what our own runners
hold. :class:`MemoryMonitor` keeps the latest snapshot fresh, logs when the
pressure crosses the threshold, and is the memory gate (:meth:`MemoryMonitor.wait_for`).

Override semantics (``OVERRIDE_MEMORY_MB`` or the config key
``memory_override_mb``): with an override of N MB the daemon believes the
machine has ``total = N MiB`` and that this simulated machine runs only us, so
``available = min(real available, total - runners_bytes)``, where
``runners_bytes`` is what our runners hold (the footprint callback). The
``min`` keeps the simulation from ever being more optimistic than the real
machine. Without an override, total and available are the real ones;
``runners_bytes`` is still reported. The threshold is the configured one, or
else :func:`default_threshold_pct` of the total as believed.

Threads: :meth:`MemoryMonitor.sample` is synchronous. The async paths
(:meth:`~MemoryMonitor.run`, :meth:`~MemoryMonitor.wait_for`) always take the
reading in a worker thread (``anyio.to_thread``), on every platform: on macOS
it runs two subprocesses, and one rule is simpler than two. The footprint
callback is called on the event loop thread, since it reads the daemon's own
state.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import anyio
import anyio.to_thread
import psutil
import structlog

from supervisor.events import EventHub

log = structlog.get_logger("supervisor.memory")

GiB = 1 << 30
MiB = 1 << 20

OVERRIDE_ENV = "OVERRIDE_MEMORY_MB"
"""Environment variable that simulates a machine of that many MiB."""

SUBPROCESS_TIMEOUT_S = 2.0  # sysctl and vm_stat answer in milliseconds; a hung one must not stall
GUARD_FLOOR_BYTES = 5 * GiB
PRESSURE_HYSTERESIS_PCT = 1.0  # back to normal only this far below the threshold: no log flapping

MACOS_DETAIL_KEYS = (
    "free",
    "active",
    "inactive",
    "speculative",
    "wired",
    "purgeable",
    "compressed",
)
LINUX_DETAIL_KEYS = ("free", "cached", "buffers", "shared")

_PAGE_SIZE_RE = re.compile(r"page size of (\d+) bytes")
_VM_STAT_LINE_RE = re.compile(r'^\s*"?([^":]+)"?:\s+(\d+)\.?\s*$')
_VM_STAT_RENAMES = {"wired_down": "wired", "occupied_by_compressor": "compressed"}


@dataclass(frozen=True, slots=True)
class SystemMemory:
    """One raw reading of the real machine, in bytes.

    ``details`` holds the page categories on macOS (free, active, inactive,
    speculative, wired, purgeable, compressed) and psutil's extra figures on
    Linux (free, cached, buffers, shared); empty where there are none.
    """

    total_bytes: int
    available_bytes: int
    details: dict[str, int] = field(default_factory=dict)


def parse_vm_stat(text: str) -> dict[str, int]:
    """Bytes per category from the output of macOS ``vm_stat``.

    The page size comes from the first line (``Mach Virtual Memory
    Statistics: (page size of 16384 bytes)``); every ``Name: N.`` line becomes
    ``N * page size`` under a snake_case key without the ``pages`` word:
    ``free``, ``active``, ``inactive``, ``speculative``, ``throttled``,
    ``wired`` (``Pages wired down``), ``purgeable``, ``compressed`` (``Pages
    occupied by compressor``), ``stored_in_compressor``, ``file_backed``,
    ``anonymous``, and the counters since boot (``translation_faults``,
    ``pageins``, ``swapouts``, ...), which are event counts scaled by the page
    size like the rest and only good for diagnostics.

    Raises:
        ValueError: the text has no page size line, so is not vm_stat output.
    """
    match = _PAGE_SIZE_RE.search(text)
    if match is None:
        raise ValueError("not vm_stat output: no 'page size of N bytes' line")
    page_size = int(match.group(1))
    categories: dict[str, int] = {}
    for line in text.splitlines():
        parsed = _VM_STAT_LINE_RE.match(line)
        if parsed is None:
            continue
        words = parsed.group(1).strip().lower().replace("-", " ").split()
        words = [word for word in words if word != "pages"]
        key = "_".join(words)
        categories[_VM_STAT_RENAMES.get(key, key)] = int(parsed.group(2)) * page_size
    return categories


def macos_available_bytes(pages: dict[str, int]) -> int:
    """Memory a new allocation can get without swapping, from :func:`parse_vm_stat`.

    free + speculative + inactive + purgeable. Speculative pages are counted
    because vm_stat prints ``Pages free`` as the kernel's free count *minus*
    the speculative (read-ahead) pages, which the kernel reclaims first; the
    kernel itself counts them free. Pages occupied by the compressor are not
    counted: they hold live data. Purgeable pages also sit on the active or
    inactive queue, so this may count a few of them twice; purgeable is small
    (tens to hundreds of MiB) beside the rest, and the monitor's threshold
    leaves far more headroom than that.
    """
    return sum(pages.get(key, 0) for key in ("free", "speculative", "inactive", "purgeable"))


def _run_tool(argv: list[str]) -> str:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, check=True
    ).stdout


def _psutil_reading() -> SystemMemory:
    vm = psutil.virtual_memory()
    keys = MACOS_DETAIL_KEYS if sys.platform == "darwin" else LINUX_DETAIL_KEYS
    details = {key: int(getattr(vm, key)) for key in keys if hasattr(vm, key)}
    return SystemMemory(int(vm.total), int(vm.available), details)


def read_system_memory() -> SystemMemory:
    """Read the real machine's memory now.

    On macOS (``sys.platform == "darwin"``) the total is ``sysctl -n
    hw.memsize`` and the available memory :func:`macos_available_bytes` of
    ``vm_stat``; ``details`` then holds the page categories, among them
    ``compressed``. If either tool fails or times out, this falls back to
    psutil without logging (``details`` then lacks ``compressed``: the caller
    can tell and log). Elsewhere it is psutil's total and available.
    """
    if sys.platform != "darwin":
        return _psutil_reading()
    try:
        total = int(_run_tool(["/usr/sbin/sysctl", "-n", "hw.memsize"]).strip())
        pages = parse_vm_stat(_run_tool(["/usr/bin/vm_stat"]))
    except (OSError, subprocess.SubprocessError, ValueError):
        return _psutil_reading()
    details = {key: pages.get(key, 0) for key in MACOS_DETAIL_KEYS}
    return SystemMemory(total, min(macos_available_bytes(pages), total), details)


def default_threshold_pct(total_bytes: int) -> float:
    """Pressure threshold by machine size: bigger machines keep a smaller share free.

    Below 32 GiB: 70 %, below 64 GiB: 75 %, below 128 GiB: 80 %, else 85 %.
    """
    if total_bytes < 32 * GiB:
        return 70.0
    if total_bytes < 64 * GiB:
        return 75.0
    if total_bytes < 128 * GiB:
        return 80.0
    return 85.0


MIN_OVERRIDE_MB = 64  # the config key's range (supervisor.config)
MAX_OVERRIDE_MB = 1 << 30


def override_mb(config_value: int | None, environ: Mapping[str, str] = os.environ) -> int | None:
    """The memory override in MB (MiB), or None for the real machine.

    ``OVERRIDE_MEMORY_MB`` in ``environ`` wins over ``config_value`` (the
    config key ``memory_override_mb``). An empty variable counts as unset.

    Raises:
        ValueError: the variable or the config value is not a positive integer.
    """
    raw = environ.get(OVERRIDE_ENV, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if not MIN_OVERRIDE_MB <= value <= MAX_OVERRIDE_MB:
            raise ValueError(
                f"{OVERRIDE_ENV}={raw!r} is out of range: {MIN_OVERRIDE_MB} to "
                f"{MAX_OVERRIDE_MB} MB, as for memory_override_mb"
            )
        return value
    if config_value is not None and config_value <= 0:
        raise ValueError(f"memory_override_mb = {config_value} is not a positive number of MB")
    return config_value


def default_guard_bytes(total_bytes: int, real_total_bytes: int) -> int:
    """Memory the load and generation guards keep free: max(10 % of total, 5 GiB).

    Under an override (``total_bytes < real_total_bytes``) the 5 GiB floor
    shrinks in proportion, so a simulated 8 GiB machine is not all guard.
    """
    floor = GUARD_FLOOR_BYTES
    if 0 < total_bytes < real_total_bytes:
        floor = GUARD_FLOOR_BYTES * total_bytes // real_total_bytes
    return max(total_bytes // 10, floor)


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    """What the daemon believes about memory at one moment (override applied).

    ``real_*`` are the machine's own figures; ``runners_bytes`` is what our
    runners hold; ``taken_at`` is ``time.monotonic()``.
    """

    total_bytes: int
    available_bytes: int
    real_total_bytes: int
    real_available_bytes: int
    override_mb: int | None
    threshold_pct: float
    runners_bytes: int
    taken_at: float
    details: dict[str, int] = field(default_factory=dict)

    @property
    def used_bytes(self) -> int:
        """Total minus available."""
        return self.total_bytes - self.available_bytes

    @property
    def pressure_pct(self) -> float:
        """Share of the total in use, in percent."""
        if self.total_bytes <= 0:
            return 100.0
        return 100.0 * self.used_bytes / self.total_bytes

    def fits(self, needed_bytes: int) -> bool:
        """Whether ``needed_bytes`` more fit: within what is available, and
        without taking the pressure past the threshold."""
        if needed_bytes > self.available_bytes or self.total_bytes <= 0:
            return False
        return (self.used_bytes + needed_bytes) * 100.0 / self.total_bytes <= self.threshold_pct

    def describe(self) -> str:
        """One line for people.

        For example ``12.3 GiB available of 24.0 GiB (48.7% used, threshold 70%)``,
        with ``, override 8192 MB`` inside the brackets under an override.
        """
        extra = f", override {self.override_mb} MB" if self.override_mb is not None else ""
        return (
            f"{self.available_bytes / GiB:.1f} GiB available of {self.total_bytes / GiB:.1f} GiB"
            f" ({self.pressure_pct:.1f}% used, threshold {self.threshold_pct:g}%{extra})"
        )


class MemoryMonitor:
    """Keeps :attr:`latest` fresh, logs pressure crossings, gates on memory.

    Args:
        override_mb: simulate a machine of this many MiB (see the module doc).
        threshold_pct: pressure threshold in percent; None for
            :func:`default_threshold_pct` of the believed total.
        poll_s: seconds between samples in :meth:`run`.
        footprint: bytes our runners hold now; called on the event loop thread.
        read: the reader of the real machine (a recorded one in tests).
        events: where pressure crossings are published (the daemon's hub).

    Raises:
        ValueError: a non-positive override or poll interval, or a threshold
            outside (0, 100].
    """

    def __init__(
        self,
        *,
        override_mb: int | None,
        threshold_pct: float | None,
        poll_s: float,
        footprint: Callable[[], int],
        read: Callable[[], SystemMemory] = read_system_memory,
        events: EventHub | None = None,
    ) -> None:
        if override_mb is not None and override_mb <= 0:
            raise ValueError(f"memory override must be a positive number of MB, not {override_mb}")
        if threshold_pct is not None and not 0.0 < threshold_pct <= 100.0:
            raise ValueError(f"memory threshold must be in (0, 100] percent, not {threshold_pct}")
        if not poll_s > 0:
            raise ValueError(f"memory poll interval must be positive, not {poll_s}")
        self.override_mb = override_mb
        self.threshold_pct = threshold_pct
        self.poll_s = poll_s
        self._footprint = footprint
        self._read = read
        self._high = False
        self._reading_failed = False
        self._fallback_logged = False
        self.events = events if events is not None else EventHub()
        self.latest: MemorySnapshot = self.sample()

    @property
    def under_pressure(self) -> bool:
        """True from ``memory_pressure_high`` until ``memory_pressure_normal``."""
        return self._high

    def sample(self) -> MemorySnapshot:
        """Take a fresh reading now (synchronously) and make it :attr:`latest`.

        Raises whatever the reader or the footprint callback raises.
        """
        return self._record(self._read())

    async def sample_async(self) -> MemorySnapshot:
        """:meth:`sample` with the reading taken in a worker thread.

        Use this from async code: on macOS a reading runs two subprocesses.
        Raises whatever the reader or the footprint callback raises.
        """
        reading = await anyio.to_thread.run_sync(self._read)
        return self._record(reading)

    async def run(self) -> None:
        """Sample every ``poll_s`` seconds, forever.

        Logs ``memory_pressure_high`` once when the pressure rises past the
        threshold and ``memory_pressure_normal`` when it is back below it
        (by :data:`PRESSURE_HYSTERESIS_PCT`); every sample takes part, the
        gate's and :meth:`sample`'s too, so each crossing is logged once. A
        failed reading is logged once per run of failures and the previous
        snapshot kept; nothing raises out of the loop but cancellation.
        """
        while True:
            await anyio.sleep(self.poll_s)
            await self._try_sample()

    async def wait_for(
        self,
        predicate: Callable[[MemorySnapshot], bool],
        *,
        timeout_s: float,
        interval_s: float = 0.25,
    ) -> tuple[bool, MemorySnapshot]:
        """The memory gate: re-sample until ``predicate`` holds or ``timeout_s`` passes.

        Freed memory comes back to the OS with a delay and no event tells
        when, so this polls every ``interval_s``. Returns whether the
        predicate was met, and the last snapshot (:attr:`latest`: the one
        before, if the last reading failed).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            snapshot = await self._try_sample()
            if snapshot is not None and predicate(snapshot):
                return True, snapshot
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False, self.latest
            await anyio.sleep(min(interval_s, remaining))

    async def _try_sample(self) -> MemorySnapshot | None:
        """A fresh snapshot, or None (logged) if the reading failed."""
        try:
            snapshot = await self.sample_async()
        except Exception:
            if not self._reading_failed:
                log.warning("memory_reading_failed", exc_info=True, kept=self.latest.describe())
            self._reading_failed = True
            return None
        if self._reading_failed:
            log.info("memory_reading_recovered", memory=snapshot.describe())
            self._reading_failed = False
        return snapshot

    def _record(self, reading: SystemMemory) -> MemorySnapshot:
        runners = max(0, int(self._footprint()))
        total = reading.total_bytes
        available = reading.available_bytes
        if self.override_mb is not None:
            total = self.override_mb * MiB
            available = min(available, total - runners)
        available = max(0, min(available, total))
        threshold = self.threshold_pct
        if threshold is None:
            threshold = default_threshold_pct(total)
        snapshot = MemorySnapshot(
            total_bytes=total,
            available_bytes=available,
            real_total_bytes=reading.total_bytes,
            real_available_bytes=reading.available_bytes,
            override_mb=self.override_mb,
            threshold_pct=threshold,
            runners_bytes=runners,
            taken_at=time.monotonic(),
            details=dict(reading.details),
        )
        self.latest = snapshot
        self._observe(snapshot, reading)
        return snapshot

    def _observe(self, snapshot: MemorySnapshot, reading: SystemMemory) -> None:
        if sys.platform == "darwin" and "compressed" not in reading.details:
            if not self._fallback_logged:
                log.warning("memory_vm_stat_unavailable", using="psutil")
                self._fallback_logged = True
        fields = {
            "pressure_pct": round(snapshot.pressure_pct, 1),
            "threshold_pct": snapshot.threshold_pct,
            "available_bytes": snapshot.available_bytes,
            "total_bytes": snapshot.total_bytes,
            "runners_bytes": snapshot.runners_bytes,
            "override_mb": snapshot.override_mb,
        }
        pressure = snapshot.pressure_pct
        if not self._high and pressure > snapshot.threshold_pct:
            self._high = True
            log.warning("memory_pressure_high", memory=snapshot.describe(), **fields)
            self.events.publish("memory_pressure_high", **fields)
        elif self._high and pressure < snapshot.threshold_pct - PRESSURE_HYSTERESIS_PCT:
            self._high = False
            log.info("memory_pressure_normal", memory=snapshot.describe(), **fields)
            self.events.publish("memory_pressure_normal", **fields)

"""The last minutes of memory, for the dashboard's timeline.

:class:`MemoryHistory` takes a :class:`MemoryPoint` at the memory monitor's
poll: the machine's used memory and the pressure threshold as the monitor
saw them last (override applied), and each runner's footprint by model. It
keeps the points of the last ``span_s`` seconds (15 minutes) in a ring, and
tells its listeners of each new one. It reads what the monitor measured and
measures nothing itself: a point costs no system call.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

import anyio
import msgspec

from supervisor.memory.monitor import MemoryMonitor

SPAN_S = 15 * 60.0  # the timeline's length
MAX_POINTS = 1800  # at most this many points, whatever the poll (a 0.05 s poll: 1 in 10)


class MemoryPoint(msgspec.Struct, frozen=True, array_like=True):
    """Memory at one moment: ``ts`` unix time; ``used_bytes`` and
    ``total_bytes`` of the machine as the daemon believes it; the pressure
    threshold in percent; ``runners`` each model's runner footprint in bytes
    (RSS or MLX active + cache, the larger; the hot spare as ``(spare)``).
    Sent as an array: ``[ts, used, total, threshold, {model: bytes}]``."""

    ts: float
    used_bytes: int
    total_bytes: int
    threshold_pct: float
    runners: dict[str, int]


class MemoryHistory:
    """The ring of :class:`MemoryPoint` of the last ``span_s`` seconds.

    Args:
        monitor: the memory monitor (its latest snapshot and its poll).
        footprints: each model's runner footprint now, in bytes, by name.
        span_s: how far back the ring reaches.
        clock: unix time now.
    """

    def __init__(
        self,
        monitor: MemoryMonitor,
        footprints: Callable[[], dict[str, int]],
        span_s: float = SPAN_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.monitor = monitor
        self.span_s = span_s
        self.interval_s = max(monitor.poll_s, span_s / MAX_POINTS)
        self._footprints = footprints
        self._clock = clock
        self._points: deque[MemoryPoint] = deque(maxlen=math.ceil(span_s / self.interval_s) + 1)
        self._listeners: list[Callable[[MemoryPoint], None]] = []

    def points(self, after_ts: float | None = None) -> list[MemoryPoint]:
        """The points kept, oldest first (those taken after ``after_ts``)."""
        if after_ts is None:
            return list(self._points)
        newer: list[MemoryPoint] = []
        for point in reversed(self._points):  # the newest first: a page asks for the last few
            if point.ts <= after_ts:
                break
            newer.append(point)
        newer.reverse()
        return newer

    def record(self) -> MemoryPoint:
        """Take a point from the monitor's latest snapshot, keep it, tell the listeners."""
        snapshot = self.monitor.latest
        point = MemoryPoint(
            ts=round(self._clock(), 3),
            used_bytes=snapshot.used_bytes,
            total_bytes=snapshot.total_bytes,
            threshold_pct=snapshot.threshold_pct,
            runners=self._footprints(),
        )
        self._points.append(point)
        horizon = point.ts - self.span_s
        while self._points and self._points[0].ts < horizon:  # after a sleep of the machine
            self._points.popleft()
        for listener in list(self._listeners):
            listener(point)
        return point

    def listen(self, listener: Callable[[MemoryPoint], None]) -> Callable[[], None]:
        """Call ``listener`` with each new point; returns what stops it."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    async def run(self) -> None:
        """Take a point every ``interval_s`` (the monitor's poll), forever."""
        while True:
            self.record()
            await anyio.sleep(self.interval_s)

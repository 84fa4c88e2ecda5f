"""Per-process figures (psutil); the machine's memory is supervisor.memory.monitor's."""

from __future__ import annotations

import psutil


def process_rss(pid: int) -> int | None:
    """Resident set size of ``pid`` in bytes, or None if it is gone."""
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return None


def process_state(pid: int | None) -> str:
    """What ``pid`` is doing as psutil names it (``disk-sleep``: uninterruptible,
    ``zombie``, ...), or ``gone``."""
    if pid is None:
        return "gone"
    try:
        return str(psutil.Process(pid).status())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return "gone"
    except psutil.AccessDenied:
        return "unknown"

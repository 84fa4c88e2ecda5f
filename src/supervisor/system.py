"""What the machine has: memory totals and per-process figures (psutil)."""

from __future__ import annotations

import psutil

from ipc.messages import SystemInfo


def system_info() -> SystemInfo:
    """Total and available memory of the machine, in bytes."""
    vm = psutil.virtual_memory()
    return SystemInfo(memory_total_bytes=int(vm.total), memory_available_bytes=int(vm.available))


def process_rss(pid: int) -> int | None:
    """Resident set size of ``pid`` in bytes, or None if it is gone."""
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return None

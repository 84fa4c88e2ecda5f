"""Per-process figures (psutil), signal names, and the synchronous kill
ladder for a child process or a pid; the machine's memory is
supervisor.memory.monitor's."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from typing import Any, Literal

import psutil

TERM_WAIT_S = 10.0
"""How long :func:`stop_process` waits after SIGTERM, unless told."""
KILL_WAIT_S = 10.0
"""How long :func:`stop_process` waits after SIGKILL before it gives up."""

Ending = Literal["exited", "sigterm", "sigkill", "unkillable"]
"""How :func:`stop_process` left a process: the rung that ended it, or
``unkillable`` when SIGKILL did not end it in time."""


def process_rss(pid: int) -> int | None:
    """Resident set size of ``pid`` in bytes, or None if it is gone."""
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return None


def process_tree_rss(pid: int) -> int | None:
    """RSS of ``pid`` and all its descendants together (a daemon, its runners and its
    spare), in bytes; a descendant that goes meanwhile counts 0. None if ``pid`` is gone."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return None
    return sum(process_rss(process.pid) or 0 for process in processes)


def process_peak_rss(pid: int) -> int | None:
    """The most RSS ``pid`` has had so far (``VmHWM`` in ``/proc/PID/status``), in bytes;
    None if it is gone or there is no such figure (no ``/proc``: not Linux)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
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


def process_create_time(pid: int) -> float | None:
    """When ``pid`` started (seconds since the epoch), or None if it is gone: with the pid,
    it names one process, which a reused pid does not."""
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def signal_name(signum: int) -> str:
    """``SIGKILL``, ``SIGRTMIN+6`` for a realtime signal, else ``SIG40``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        pass
    rtmin = getattr(signal, "SIGRTMIN", None)
    rtmax = getattr(signal, "SIGRTMAX", None)
    if rtmin is not None and rtmax is not None and rtmin < signum <= rtmax:
        return f"SIGRTMIN+{signum - rtmin}"
    return f"SIG{signum}"


def stop_process(
    process: subprocess.Popen[Any] | psutil.Process | int,
    *,
    join_s: float = 0.0,
    term_wait_s: float | None = TERM_WAIT_S,
    kill_wait_s: float = KILL_WAIT_S,
) -> Ending:
    """The kill ladder, synchronous (for harnesses: tests, benchmarks, a
    daemon started as a child; runners have the async one in
    ``supervisor.runners.escalation``): join, SIGTERM, join, SIGKILL, reap.

    Args:
        process: a child (``Popen``: reaped, its ``returncode`` set), or any
            process by ``psutil.Process`` or pid (a child of ours is reaped).
        join_s: how long it may take to end on its own first (the caller
            asked it to stop, or expects it to end).
        term_wait_s: how long after SIGTERM before SIGKILL; None: no SIGTERM.
        kill_wait_s: how long after SIGKILL before giving up on it.

    Returns:
        ``exited`` (it ended on its own, or was gone already), ``sigterm``,
        ``sigkill``, or ``unkillable`` (still there after SIGKILL).
    """
    if isinstance(process, int):
        try:
            process = psutil.Process(process)
        except psutil.NoSuchProcess:
            return "exited"
    if _join(process, join_s):
        return "exited"
    if term_wait_s is not None:
        _send_signal(process, signal.SIGTERM)
        if _join(process, term_wait_s):
            return "sigterm"
    _send_signal(process, signal.SIGKILL)
    return "sigkill" if _join(process, kill_wait_s) else "unkillable"


def _join(process: subprocess.Popen[Any] | psutil.Process, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``process`` to end (reaping a child); whether it has."""
    try:
        process.wait(timeout_s)
    except (subprocess.TimeoutExpired, psutil.TimeoutExpired):
        return False
    return True


def _send_signal(process: subprocess.Popen[Any] | psutil.Process, signum: signal.Signals) -> None:
    """Send ``signum`` unless the process is gone (a Popen reaped, a pid no longer ours)."""
    with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):
        process.send_signal(signum)

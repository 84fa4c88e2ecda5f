"""Figure 4 of ``bench_daemon.py``: the share of memory given back to the system when
a model is unloaded, beside ``del model; gc.collect(); mx.clear_cache()`` in a python
process, and a numpy block freed in a child as a check of the meter.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from common import (
    Daemon,
    daemon_generate,
    fmt,
    mib,
    ms,
    note,
    verdict,
    worker,
)
from daemon_common import DECODE_PROMPT, Row, short
from supervisor.figures import median
from supervisor.system import process_rss, process_tree_rss

# Target (see the brief in bench/README.md).
MEMORY_SHARE_TARGET = 0.99

MEMORY_WINDOW_S = 1.0  # how long available memory is watched after an unload/release
MEMORY_INTERVAL_S = 0.01
MEMORY_WITHIN = 0.99  # "got within 99%": share returned >= this


# --- memory readings -----------------------------------------------------------


_ZONEINFO = Path("/proc/zoneinfo")
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def daemon_tree_rss(pid: int) -> int:
    """The RSS of the daemon's process tree; the daemon must still be there."""
    rss = process_tree_rss(pid)
    if rss is None:
        raise RuntimeError(f"the daemon (pid {pid}) is gone")
    return rss


def pcp_free_bytes() -> int:
    """Free pages parked on Linux's per-CPU page lists (0 elsewhere).

    The kernel frees pages to per-CPU lists first and drains them to the buddy
    allocator later; ``MemFree`` and ``MemAvailable`` do not count them. Since the
    lists are auto-tuned (Linux 6.7+) they can hold a hundred MB or more per CPU
    right after a big process exits.
    """
    try:
        text = _ZONEINFO.read_text()
    except OSError:
        return 0
    pages = 0
    for line in text.splitlines():
        key, _, value = line.strip().partition(":")
        if key == "count":  # only the per-CPU pagesets have a "count"
            pages += int(value)
    return pages * _PAGE_SIZE


@dataclass(frozen=True)
class Reading:
    """System available memory (psutil), and free pages on the per-CPU lists."""

    available: int
    pcp: int

    @property
    def counted(self) -> int:
        """Available memory including the per-CPU lists' free pages."""
        return self.available + self.pcp


def reading() -> Reading:
    return Reading(int(psutil.virtual_memory().available), pcp_free_bytes())


def available_now(samples: int = 5) -> Reading:
    """Median of a few readings, 10 ms apart."""
    readings = []
    for index in range(samples):
        if index:
            time.sleep(MEMORY_INTERVAL_S)
        readings.append(reading())
    return Reading(
        int(statistics.median(r.available for r in readings)),
        int(statistics.median(r.pcp for r in readings)),
    )


# --- the rounds ----------------------------------------------------------------


def share(before: int, loaded: int, after: int) -> float | None:
    taken = before - loaded
    return (after - loaded) / taken if taken > 0 else None


def watch_return(before: Reading, loaded: Reading, since: float) -> dict[str, Any]:
    """Sample memory for MEMORY_WINDOW_S after ``since``; keep the last sample.

    The top-level figures use psutil's available memory alone (the definition);
    ``with_pcp`` the same with the per-CPU lists' free pages counted as free.
    """
    samples: list[tuple[float, Reading]] = []
    deadline = since + MEMORY_WINDOW_S
    while True:
        now = time.perf_counter()
        samples.append((now - since, reading()))
        if now >= deadline:
            break
        time.sleep(min(MEMORY_INTERVAL_S, max(0.0, deadline - now)))

    def figures(value: Callable[[Reading], int]) -> dict[str, Any]:
        b, lo = value(before), value(loaded)
        within = next(
            (t for t, r in samples if (share(b, lo, value(r)) or 0.0) >= MEMORY_WITHIN), None
        )
        last = value(samples[-1][1])
        return {
            "before": b,
            "loaded": lo,
            "taken": b - lo,
            "after": last,
            "share": share(b, lo, last),
            "within_99_s": within,
            "min": min(value(r) for _, r in samples),
            "max": max(value(r) for _, r in samples),
        }

    return {
        **figures(lambda r: r.available),
        "first_sample_s": samples[0][0],
        "samples": len(samples),
        "with_pcp": figures(lambda r: r.counted),
    }


def memory_round_daemon(d: Daemon, model: str, tokens: int) -> dict[str, Any]:
    """Available memory before load, loaded (after a generation), and after unload.

    The daemon is settled before each reading: with a hot spare, taking it for the
    load starts a new one, which is then part of both ``loaded`` and ``after``.
    """
    name, client, daemon_pid = "bench-mem", d.client, d.process.pid
    d.settle()
    daemon_rss_before = process_rss(daemon_pid)
    tree_before = daemon_tree_rss(daemon_pid)
    before = available_now()
    loaded_reply = client.load(model, name)
    daemon_generate(client, name, DECODE_PROMPT, tokens)
    d.settle()
    status = client.status()
    runner = next(r for r in status.runners if r.name == name)
    spare = getattr(status, "spare", None)
    tree_loaded = daemon_tree_rss(daemon_pid)
    loaded = available_now()
    unload_started = time.perf_counter()
    unloaded = client.unload(name)
    returned = time.perf_counter()
    window = watch_return(before, loaded, returned)
    tree_after = daemon_tree_rss(daemon_pid)
    return {
        **window,
        # the same share from the RSS of the daemon's process tree: blind to the rest
        # of the machine, so other people's processes cannot move it
        "tree_rss": [tree_before, tree_loaded, tree_after],
        "rss_share": share(-tree_before, -tree_loaded, -tree_after),
        "unload_call_s": returned - unload_started,
        "runner_pid": loaded_reply.pid,
        "runner_rss_loaded": runner.rss_bytes,
        "spare_rss": spare.rss_bytes if spare is not None else None,
        "runner_alive_after": psutil.pid_exists(unloaded.pid),
        "daemon_rss_before": daemon_rss_before,
        "daemon_rss_after": process_rss(daemon_pid),
    }


def memory_round_inproc(path: Path, tokens: int, log_path: Path) -> dict[str, Any]:
    with worker(log_path) as w:
        before = available_now()
        rss_before = process_rss(w.pid)
        w.request("load", key="m", path=str(path))
        w.request("generate", key="m", prompt=DECODE_PROMPT, max_tokens=tokens)
        loaded = available_now()
        rss_loaded = process_rss(w.pid)
        released = w.request("release", key="m")
        window = watch_return(before, loaded, time.perf_counter())
        rss_after = process_rss(w.pid)
    after_exit = available_now().available
    grown = rss_loaded - rss_before if rss_loaded and rss_before else None
    return {
        **window,
        "rss_before_load": rss_before,
        "rss_loaded": rss_loaded,
        "rss_after_release": rss_after,
        "rss_grown": grown,
        "rss_kept": rss_after - rss_before if rss_after and rss_before else None,
        "rss_share": share(-rss_before, -rss_loaded, -rss_after)
        if rss_before and rss_loaded and rss_after
        else None,
        "mlx_active_after_release": released["active_bytes"],
        "mlx_cache_after_release": released["cache_bytes"],
        "after_exit": after_exit,
        "share_after_exit": share(before.available, loaded.available, after_exit),
    }


_CALIBRATION_CHILD = """
import sys
import numpy as np
sys.stdin.readline()
block = np.ones({size} // 8)  # touched: every page is really allocated
print("allocated", flush=True)
sys.stdin.readline()
del block  # a block this big is its own mmap: free() unmaps it at once
print("freed", flush=True)
sys.stdin.readline()
"""


def memory_round_meter(size: int) -> dict[str, Any]:
    """The same share for memory that certainly goes back at once: a numpy block of
    ``size`` bytes, allocated and freed in a child. Shows how well available memory,
    as this machine reports it, can measure the rounds above."""
    code = _CALIBRATION_CHILD.format(size=size)
    process = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert process.stdin is not None and process.stdout is not None

    def step() -> None:
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write("\n")
        process.stdin.flush()
        process.stdout.readline()

    try:
        before = available_now()
        step()
        loaded = available_now()
        step()
        window = watch_return(before, loaded, time.perf_counter())
        process.stdin.write("\n")
        process.stdin.flush()
    finally:
        process.stdin.close()
        process.stdout.close()
        if process.wait(10) != 0:
            raise RuntimeError(f"the memory meter's child exited with {process.returncode}")
    return {"size": size, **window}


def bench_memory(
    d: Daemon, model: str, path: Path, rounds: int, tokens: int, tmp: Path
) -> dict[str, Any]:
    daemon_rounds, inproc_rounds, meter_rounds = [], [], []
    for index in range(rounds):
        daemon_rounds.append(memory_round_daemon(d, model, tokens))
        log_path = tmp / f"memory-worker-{index}.log"
        d.settle()
        inproc_rounds.append(memory_round_inproc(path, tokens, log_path))
        grown = inproc_rounds[-1]["rss_grown"] or daemon_rounds[-1]["taken"]
        meter_rounds.append(memory_round_meter(max(grown, 1 << 20)))
        note(
            f"  memory round {index + 1}/{rounds}: share returned daemon "
            f"{fmt(daemon_rounds[-1]['share'], '.3f')}, in-process "
            f"{fmt(inproc_rounds[-1]['share'], '.3f')}, numpy meter check "
            f"{fmt(meter_rounds[-1]['share'], '.3f')}"
        )

    def med(items: list[dict[str, Any]], key: str) -> float | None:
        values = [r[key] for r in items if r.get(key) is not None]
        return float(statistics.median(values)) if values else None

    def summary(items: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "median_share": med(items, "share"),
            "median_share_with_pcp": med([r["with_pcp"] for r in items], "share"),
            "median_rss_share": med(items, "rss_share"),
            "median_taken_bytes": med(items, "taken"),
            # over the rounds that got within 99% inside the window
            "median_within_99_s": med(items, "within_99_s"),
            "rounds_within_99": sum(r["within_99_s"] is not None for r in items),
        }

    return {
        "model": model,
        "rounds": rounds,
        "window_s": MEMORY_WINDOW_S,
        "daemon": {**summary(daemon_rounds), "rounds": daemon_rounds},
        "inproc": {
            **summary(inproc_rounds),
            "median_rss_grown": med(inproc_rounds, "rss_grown"),
            "median_rss_kept": med(inproc_rounds, "rss_kept"),
            "median_share_after_exit": med(inproc_rounds, "share_after_exit"),
            "rounds": inproc_rounds,
        },
        # a numpy block the size the worker grew by, allocated and freed in a child
        "meter": {
            **summary(meter_rounds),
            "median_taken_of_size": median(r["taken"] / r["size"] for r in meter_rounds),
            "rounds": meter_rounds,
        },
    }


# --- the table ---------------------------------------------------------------


def memory_rows(mem: dict[str, Any]) -> list[Row]:
    daemon, inproc, meter = mem["daemon"], mem["inproc"], mem["meter"]
    d_share, d_rss = daemon["median_share"], daemon["median_rss_share"]
    kept = f"of {mib(inproc['median_rss_grown'])} grown"
    return [
        (
            f"4 share of memory returned in 1 s ({short(mem['model'])}, median of {mem['rounds']})",
            fmt(d_share, ".3f"),
            fmt(inproc["median_share"], ".3f"),
            "unload vs del+gc+clear_cache",
            f">= {MEMORY_SHARE_TARGET}",
            verdict(None if d_share is None else d_share >= MEMORY_SHARE_TARGET),
        ),
        (
            "4 ... counting the kernel's per-CPU free page lists too",
            fmt(daemon["median_share_with_pcp"], ".3f"),
            fmt(inproc["median_share_with_pcp"], ".3f"),
            f"meter check {fmt(meter['median_share_with_pcp'], '.3f')}",
            "",
            "",
        ),
        (
            "4 ... same share by RSS (daemon's process tree / worker)",
            fmt(daemon["median_rss_share"], ".3f"),
            fmt(inproc["median_rss_share"], ".3f"),
            "blind to other processes",
            f">= {MEMORY_SHARE_TARGET}",
            verdict(None if d_rss is None else d_rss >= MEMORY_SHARE_TARGET),
        ),
        (
            "4 meter check: a numpy block that size, allocated+freed",
            "",
            "",
            f"share {fmt(meter['median_share'], '.3f')}; available fell by "
            f"{fmt(meter['median_taken_of_size'], '.0%')} of it",
            "",
            "",
        ),
        (
            "4 available memory taken by load+generate",
            mib(daemon["median_taken_bytes"]),
            mib(inproc["median_taken_bytes"]),
            "",
            "",
            "",
        ),
        (
            "4 within 99% after the call returned (rounds that got there)",
            f"{ms(daemon['median_within_99_s'])} ({daemon['rounds_within_99']}/{mem['rounds']})",
            f"{ms(inproc['median_within_99_s'])} ({inproc['rounds_within_99']}/{mem['rounds']})",
            "",
            "",
            "",
        ),
        (
            "4 in-process RSS kept after del/gc/clear_cache",
            "",
            mib(inproc["median_rss_kept"]),
            kept,
            "",
            "",
        ),
    ]

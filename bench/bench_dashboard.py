"""What the dashboard costs the daemon, and how fast it shows a death.

Usage::

    python bench/bench_dashboard.py [--quick] [--out bench/results/dashboard.json]

One run starts a private daemon with its HTTP front on a free port and four
``builtin:tiny`` models loaded, and a headless Chromium (Playwright; Debian's
``chromium`` or $MLX_SUPERVISOR_CHROMIUM) that opens the dashboard or not,
side by side in the same run:

1. The daemon's CPU seconds per minute with the page open ÷ without it (the
   page closed), in alternating windows of the same length (target ≤ 1.1).
   The daemon process alone: the runners and the browser are not counted.
2. The latency from a runner's SIGKILL to the page showing its death: the
   time the page rendered the ``runner_died`` event (a timestamp it stamps
   on the item) minus the time of the kill, over ``kills`` kills (p50), and
   to the model's row showing the restart (its restart count; the status
   comes at most once a second, and a random pause before each kill puts
   it anywhere in that second).
3. ``status`` over the socket under bench_hardening.py's load (64 clients
   streaming from the model, ``max_queue = 32``), with the page open and
   without, in alternating phases (its ``load_phase``): p50 and p99.

Screenshots of the page go to ``bench/results/dashboard-*.png``. It prints
a table and writes the JSON (machine info, settings, every raw sample).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_hardening import Settings as LoadSettings
from bench_hardening import load_phase, summary
from common import (
    RESULTS_DIR,
    Daemon,
    children_left,
    cpu_s,
    load_average,
    machine_info,
    mlx_device,
    ms,
    note,
    ratio,
    run_alternating,
    runner_info,
    verdict,
    write_json,
)
from supervisor.figures import render_table

DEFAULT_OUT = RESULTS_DIR / "dashboard.json"
MODEL = "builtin:tiny"
NAMES = ("tiny", "tiny2", "tiny3", "tiny4")  # "tiny": the model bench_hardening's load uses
CPU_RATIO_TARGET = 1.1
DEATH_SHOWN_TARGET_S = 2.0
STATUS_P99_TARGET_S = 0.010
CHROMIUM_ENV = "MLX_SUPERVISOR_CHROMIUM"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]  # fmt: skip
STEP_MS = 60_000


@dataclass(frozen=True)
class Settings:
    cpu_window_s: float = 60.0  # one side's CPU window
    cpu_rounds: int = 3  # pairs of windows (page open, page closed), order alternating
    kills: int = 10
    load_rounds: int = 2  # pairs of load phases (page open, page closed)
    load_samples: int = 300  # status round trips per load phase
    quick: bool = False


def settings_from_args(args: argparse.Namespace) -> Settings:
    base = Settings(cpu_window_s=20.0, cpu_rounds=2, kills=6, load_rounds=1, load_samples=150,
                    quick=True) if args.quick else Settings()  # fmt: skip
    overrides = {"cpu_window_s": args.cpu_window_s, "cpu_rounds": args.cpu_rounds,
                 "kills": args.kills, "load_rounds": args.load_rounds}  # fmt: skip
    return Settings(**{**asdict(base), **{k: v for k, v in overrides.items() if v is not None}})


def config_text() -> str:
    """Restarts at once and never out of budget (the kills would spend it), and
    bench_hardening's queue bound."""
    return "max_queue = 32\nmax_restarts = 1000\nrestart_backoff_s = 0\n"


# --- the browser ---------------------------------------------------------------


class Dashboard:
    """A headless Chromium that opens the dashboard (one page) or closes it."""

    def __init__(self, context: Any, url: str) -> None:
        self.context = context
        self.url = url
        self.page: Any = None
        self.errors: list[str] = []

    def open(self) -> None:
        self.page = self.context.new_page()
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.page.goto(self.url + "/")
        self.page.wait_for_selector('#conn[data-connected="true"]', timeout=STEP_MS)

    def close(self) -> None:
        if self.page is not None:
            self.page.close()
            self.page = None

    def screenshot(self, name: str) -> str:
        path = RESULTS_DIR / f"dashboard-{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(path), full_page=True)
        return str(path.relative_to(RESULTS_DIR.parent.parent))


@contextlib.contextmanager
def chromium(url: str, profile: Path) -> Iterator[Dashboard]:
    from playwright.sync_api import sync_playwright

    executable = os.environ.get(CHROMIUM_ENV) or shutil.which("chromium")
    if executable is None:
        raise SystemExit(f"no Chromium: install Debian's chromium (bash run.sh system) or set "
                         f"{CHROMIUM_ENV}")  # fmt: skip
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=executable, args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1100},
        )  # fmt: skip
        try:
            yield Dashboard(context, url)
        finally:
            context.close()


# --- the three figures ---------------------------------------------------------


def cpu_window(daemon: Daemon, window_s: float) -> float:
    """The daemon's CPU seconds per minute over ``window_s`` of wall time."""
    pid = daemon.process.pid
    started, cpu_before = time.perf_counter(), cpu_s(pid)
    time.sleep(window_s)  # the measurement itself: a span of wall time
    return (cpu_s(pid) - cpu_before) / (time.perf_counter() - started) * 60


def cpu_phases(daemon: Daemon, page: Dashboard, s: Settings) -> dict[str, Any]:
    def with_page() -> float:
        page.open()
        daemon.settle()
        try:
            return cpu_window(daemon, s.cpu_window_s)
        finally:
            page.close()

    def without_page() -> float:
        daemon.settle()
        return cpu_window(daemon, s.cpu_window_s)

    opened: list[float] = []
    closed: list[float] = []
    for index in range(s.cpu_rounds):
        note(f"CPU round {index + 1}/{s.cpu_rounds}: {s.cpu_window_s:g} s with the page, "
             f"{s.cpu_window_s:g} s without")  # fmt: skip
        a, b = run_alternating(index, with_page, without_page)
        opened.append(a)
        closed.append(b)
    ratios = [a / b for a, b in zip(opened, closed, strict=True) if b > 0]
    return {"page_open_cpu_s_per_min": opened, "page_closed_cpu_s_per_min": closed,
            "ratio_each_round": ratios,
            "ratio": statistics.median(ratios) if ratios else None}  # fmt: skip


def kill_latencies(daemon: Daemon, page: Dashboard, s: Settings) -> dict[str, Any]:
    """SIGKILL a runner ``kills`` times (the models in turn), each after its
    model is ready again; how long the page took to show each death."""
    died_s: list[float] = []
    row_s: list[float] = []
    cause_classes: list[str] = []
    rng = random.Random(0)
    for index in range(s.kills):
        name = NAMES[index % len(NAMES)]
        daemon.settle()
        before = runner_info(daemon.client, name)
        assert before.pid is not None
        page.page.wait_for_selector(f'#model-rows tr[data-model="{name}"][data-state="ready"]'
                                    f'[data-pid="{before.pid}"]', timeout=STEP_MS)  # fmt: skip
        # The page just drew the row (a status write): kill at any moment of its 1 s throttle.
        time.sleep(rng.uniform(0.0, 2.0))
        died = f'#event-list li[data-kind="runner_died"][data-pid="{before.pid}"]'
        row = f'#model-rows tr[data-model="{name}"][data-restarts="{before.restarts + 1}"]'
        killed_at = time.time()
        psutil.Process(before.pid).kill()
        page.page.wait_for_selector(died, timeout=STEP_MS)
        page.page.wait_for_selector(row, timeout=STEP_MS)
        row_s.append(time.time() - killed_at)
        died_s.append(int(page.page.get_attribute(died, "data-received-ms")) / 1000 - killed_at)
        cause_classes.append(page.page.get_attribute(died, "data-cause-class") or "")
        note(f"kill {index + 1}/{s.kills} ({name}, pid {before.pid}): shown after "
             f"{died_s[-1] * 1000:.0f} ms, row after {row_s[-1] * 1000:.0f} ms")  # fmt: skip
        if index == 0:
            page.page.wait_for_selector(f'#model-rows tr[data-model="{name}"][data-state="ready"]',
                                        timeout=STEP_MS)  # fmt: skip
            page.screenshot("restarted")
    return {"death_shown_s": died_s, "row_shown_s": row_s, "cause_classes": cause_classes,
            "death": summary(died_s), "row": summary(row_s)}  # fmt: skip


def status_under_load(daemon: Daemon, page: Dashboard, s: Settings) -> dict[str, Any]:
    load = LoadSettings(samples=s.load_samples, rounds=1, quick=s.quick)

    def with_page(index: int) -> dict[str, Any]:
        page.open()
        try:
            phase = load_phase(daemon, daemon.client, load, index)
            if index == 0:
                page.screenshot("under-load")
            return phase
        finally:
            page.close()

    opened: list[dict[str, Any]] = []
    closed: list[dict[str, Any]] = []
    for index in range(s.load_rounds):
        daemon.settle()
        a, b = run_alternating(
            index,
            functools.partial(with_page, index),
            functools.partial(load_phase, daemon, daemon.client, load, index),
        )
        opened.append(a)
        closed.append(b)

    def latencies(phases: list[dict[str, Any]]) -> list[float]:
        return [x for phase in phases for x in phase["latency_s"]]

    def clients(phases: list[dict[str, Any]]) -> dict[str, int]:
        total: dict[str, int] = {}
        for phase in phases:
            for outcome, count in phase["clients"]["outcomes"].items():
                total[outcome] = total.get(outcome, 0) + count
        return total

    return {
        "load_settings": asdict(load),
        "page_open": summary(latencies(opened)),
        "page_closed": summary(latencies(closed)),
        "page_open_clients": clients(opened),
        "page_closed_clients": clients(closed),
        "status_errors": [e for p in opened + closed for e in p["errors"]],
        "phases": {"page_open": opened, "page_closed": closed},
    }


# --- the run -------------------------------------------------------------------


def run(s: Settings) -> dict[str, Any]:
    started = time.perf_counter()
    results: dict[str, Any] = {"settings": asdict(s), "machine": machine_info(mlx_device())}
    with (
        tempfile.TemporaryDirectory(prefix="mlx-bench-dashboard-") as tmp_name,
        contextlib.ExitStack() as stack,
    ):
        tmp = Path(tmp_name)
        daemon = Daemon.start(stack, tmp, "dashboard", config_text(), http="127.0.0.1:0")
        url = daemon.client.status().supervisor.http
        assert url is not None
        results["daemon"] = {"pid": daemon.process.pid, "config": config_text(), "url": url}
        note(f"daemon pid {daemon.process.pid} at {url}; loading {len(NAMES)} x {MODEL}")
        for name in NAMES:
            daemon.client.load(MODEL, name)
        daemon.settle()
        with chromium(url, tmp / "chromium-profile") as page:
            results["cpu"] = cpu_phases(daemon, page, s)
            page.open()
            results["screenshots"] = [page.screenshot("overview")]
            results["kills"] = kill_latencies(daemon, page, s)
            results["screenshots"].append("bench/results/dashboard-restarted.png")
            page.close()
            results["status_under_load"] = status_under_load(daemon, page, s)
            results["screenshots"].append("bench/results/dashboard-under-load.png")
            results["page_errors"] = page.errors
        results["counters"] = daemon.client.status().counters
        results["daemon"]["exit"] = daemon.shutdown()
    results["children_left"] = children_left()
    results["machine"]["loadavg_end"] = load_average()
    results["duration_s"] = time.perf_counter() - started
    return results


def checks(r: dict[str, Any]) -> dict[str, bool]:
    cpu, kills, load = r["cpu"]["ratio"], r["kills"], r["status_under_load"]
    return {
        f"daemon CPU, page open / closed <= {CPU_RATIO_TARGET}": (
            cpu is not None and cpu <= CPU_RATIO_TARGET
        ),
        f"death shown p50 <= {DEATH_SHOWN_TARGET_S:g} s": (
            kills["death"]["p50"] is not None and kills["death"]["p50"] <= DEATH_SHOWN_TARGET_S
        ),
        "status p99 under load, page open < 10 ms": (
            load["page_open"]["p99"] is not None and load["page_open"]["p99"] < STATUS_P99_TARGET_S
        ),
        "status never failed": not load["status_errors"],
        "no console error on the page": not r["page_errors"],
        "clean shutdown (exit 0), no child left": (
            r["daemon"]["exit"]["code"] == 0 and not r["children_left"]
        ),
    }


def table(r: dict[str, Any]) -> str:
    s, mach, cpu, kills = r["settings"], r["machine"], r["cpu"], r["kills"]
    load = r["status_under_load"]
    quick = " (--quick: a smoke run)" if s["quick"] else ""
    title = (
        f"mlx-supervisor: what the dashboard costs{quick}, {mach['date']}\n"
        f"{mach['platform']}, {mach['cpu_count']} CPUs ({mach['cpu']}), python {mach['python']}, "
        f"mlx {mach['mlx']} on {mach['mlx_device']}\n"
        f"{len(NAMES)} x {MODEL} loaded; headless Chromium on the page or not; "
        f"{s['cpu_rounds']} x {s['cpu_window_s']:g} s CPU windows per side, {s['kills']} kills, "
        f"{s['load_rounds']} load phase(s) per side of {load['load_settings']['clients']} clients"
    )
    open_cpu = statistics.median(cpu["page_open_cpu_s_per_min"])
    closed_cpu = statistics.median(cpu["page_closed_cpu_s_per_min"])
    cpu_rows = [
        ("daemon CPU s per minute (median)", f"{open_cpu:.3f}", f"{closed_cpu:.3f}",
         f"{cpu['ratio']:.3f}" if cpu["ratio"] is not None else "-",
         f"<= {CPU_RATIO_TARGET}"),
        ("status p50 under load", ms(load["page_open"]["p50"], ".2f"),
         ms(load["page_closed"]["p50"], ".2f"),
         ratio(load["page_open"]["p50"], load["page_closed"]["p50"]), ""),
        ("status p99 under load", ms(load["page_open"]["p99"], ".2f"),
         ms(load["page_closed"]["p99"], ".2f"),
         ratio(load["page_open"]["p99"], load["page_closed"]["p99"]), "< 10 ms"),
        ("status samples under load", str(load["page_open"]["n"]), str(load["page_closed"]["n"]),
         "", ""),
    ]  # fmt: skip
    kill_rows = [
        ("SIGKILL -> death on the page (event list)", ms(kills["death"]["p50"], ".1f"),
         ms(kills["death"]["p99"], ".1f"), ms(kills["death"]["max"], ".1f"),
         f"p50 <= {DEATH_SHOWN_TARGET_S * 1000:.0f} ms"),
        ("SIGKILL -> restart count in the model's row", ms(kills["row"]["p50"], ".1f"),
         ms(kills["row"]["p99"], ".1f"), ms(kills["row"]["max"], ".1f"), ""),
    ]  # fmt: skip
    check_rows = [(name, verdict(ok)) for name, ok in checks(r).items()]
    footer = (
        f"cause classes shown: {', '.join(sorted(set(kills['cause_classes'])))}; "
        f"screenshots: {', '.join(r['screenshots'])}\n"
        f"ran {r['duration_s']:.0f} s; load average {mach['loadavg_start'][0]:.2f} at start, "
        f"{mach['loadavg_end'][0]:.2f} at end"
    )
    return "\n\n".join([
        title,
        render_table(("figure", "page open", "page closed", "open / closed", "target"), cpu_rows),
        render_table(("latency", "p50", "p99", "max", "target"), kill_rows),
        render_table(("check", "result"), check_rows),
        footer,
    ])  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="short windows, fewer kills (~3 min)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    parser.add_argument("--cpu-window-s", type=float, help="one side's CPU window (60)")
    parser.add_argument("--cpu-rounds", type=int, help="pairs of CPU windows (3)")
    parser.add_argument("--kills", type=int, help="runner kills (10)")
    parser.add_argument("--load-rounds", type=int, help="pairs of load phases (2)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(settings_from_args(args))
    write_json(results, args.out)
    print(table(results))
    print(f"\nresults: {args.out}")
    integrity = [ok for name, ok in checks(results).items() if "CPU" not in name]
    return 0 if all(integrity) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Figure 3 of ``bench_daemon.py``: load-to-ready through the daemon (with and without
its hot spare) / a fresh ``python -c "mlx_lm.load(...)"``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import Daemon, note
from daemon_common import Row, short
from supervisor.figures import median


def baseline_load(path: Path) -> dict[str, float]:
    """Wall time of a fresh ``python -c "import mlx_lm; mlx_lm.load(PATH)"``.

    ``wall_s`` is spawn -> reaped (what ``subprocess.run`` sees); ``ready_s`` is
    spawn -> a line printed right after ``load`` returned (no interpreter teardown).
    """
    code = f"import mlx_lm; mlx_lm.load({str(path)!r}); print('ready', flush=True)"
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    ready = time.perf_counter()
    _, err = process.communicate()
    wall = time.perf_counter()
    if process.returncode != 0 or line.strip() != "ready":
        raise RuntimeError(f"baseline load failed ({process.returncode}): {err[-2000:]}")
    return {"wall_s": wall - started, "ready_s": ready - started}


def bench_load(daemons: dict[str, Daemon], model: str, path: Path, rounds: int) -> dict[str, Any]:
    """Interleaved: baseline, then a load (and unload) on each daemon, per round.

    Every daemon is settled before each timed step, so a hot spare being remade
    after the previous load never runs during one.
    """
    name = "bench-load"

    def settle_all() -> None:
        for d in daemons.values():
            d.settle()

    samples: list[dict[str, Any]] = []
    for index in range(rounds + 1):  # round 0 warms the page cache on every side
        settle_all()
        base = baseline_load(path)
        sample: dict[str, Any] = {
            "baseline_wall_s": base["wall_s"],
            "baseline_ready_s": base["ready_s"],
        }
        for variant, d in daemons.items():
            settle_all()
            started = time.perf_counter()
            loaded = d.client.load(model, name)
            load_s = time.perf_counter() - started
            unloaded = d.client.unload(name)
            sample[variant] = {
                "load_s": load_s,
                "runner_load_s": loaded.load_s,
                "unload_s": unloaded.elapsed_s,
                "ratio": load_s / base["wall_s"],
                "ratio_vs_ready": load_s / base["ready_s"],
            }
        if index == 0:
            continue
        samples.append(sample)
        took = ", ".join(f"{v} {sample[v]['load_s']:.2f} s" for v in daemons)
        note(f"  load round {index}/{rounds}: baseline {base['wall_s']:.2f} s, {took}")

    variants = {
        variant: {
            key: median(s[variant][key] for s in samples)
            for key in ("load_s", "ratio", "ratio_vs_ready", "runner_load_s", "unload_s")
        }
        for variant in daemons
    }
    return {
        "model": model,
        "rounds": rounds,
        "median_baseline_wall_s": median(s["baseline_wall_s"] for s in samples),
        "median_baseline_ready_s": median(s["baseline_ready_s"] for s in samples),
        "daemons": {v: {f"median_{k}": x for k, x in m.items()} for v, m in variants.items()},
        "samples": samples,
    }


# --- the table ---------------------------------------------------------------


def load_rows(ld: dict[str, Any]) -> list[Row]:
    what = f"{short(ld['model'])}, median of {ld['rounds']}"
    rows: list[Row] = [
        (
            f"3 load-to-ready, s ({what}): python -c mlx_lm.load",
            "",
            f"{ld['median_baseline_wall_s']:.3f}",
            f"until load() returned: {ld['median_baseline_ready_s']:.3f}",
            "",
            "",
        )
    ]
    for variant, d in ld["daemons"].items():
        rows.append(
            (
                f"3 load-to-ready, s: Client.load ({variant})",
                f"{d['median_load_s']:.3f}",
                "",
                f"ratio {d['median_ratio']:.3f} (to returned: {d['median_ratio_vs_ready']:.3f})",
                "",
                "",
            )
        )
    return rows

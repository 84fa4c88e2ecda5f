"""What the daemon costs compared with plain in-process mlx-lm, measured side by side.

Usage::

    python bench/bench_daemon.py [--model builtin:small] [--quick] [--per-token-only]
                                 [--out bench/results/daemon.json]

One run starts a private daemon (on a socket in a temp dir) and a plain python
worker (``bench/inproc_worker.py``) and measures, alternating between the two
sides and never running both models at once:

1. decode tokens/s through the daemon / in-process ``mlx_lm.stream_generate``;
2. time to first token through the daemon - in-process (the two IPC hops);
3. load-to-ready through the daemon / a fresh ``python -c "mlx_lm.load(...)"``;
4. the share of memory given back to the system when a model is unloaded,
   beside ``del model; gc.collect(); mx.clear_cache()`` in a python process;
5. per-token, as a user sees it: the rate of ``mlx-supervisor generate --json``
   streaming from the daemon, read from its stdout, / ``stream_generate`` in a fresh
   python process, on builtin:tiny; each round a fresh runner and worker, with
   several timed pairs back to back (``--per-token-only`` runs this one alone).

The machine is shared and noisy, so every figure is a ratio or a difference of
things measured in this same run. It prints a table and writes the JSON
(machine info, settings, every raw sample). See bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS_DIR,
    Daemon,
    Worker,
    alternate,
    children_left,
    cpu_s,
    cpu_time,
    daemon_generate,
    fmt,
    inproc_generate,
    load_average,
    machine_info,
    median,
    mib,
    mlx_device,
    ms,
    note,
    percentile,
    percentiles,
    render_table,
    run_alternating,
    runner_info,
    signed_ms,
    verdict,
    worker,
    write_json,
)
from runner.builtin import ensure_builtin_model, is_builtin
from supervisor.client import Client

DEFAULT_OUT = RESULTS_DIR / "daemon.json"

IPC_MODEL = "builtin:tiny"  # ~1 MB: its compute is tiny, so the IPC overhead stands out
PER_TOKEN_MODEL = IPC_MODEL  # ~1-3 ms a token on CPU: what the daemon adds per token shows
PER_TOKEN_PAIRS = 5  # timed pairs per round of figure 5, back to back
DECODE_PROMPT = "The supervisor starts one runner process for every model it serves."
TTFT_PROMPT = "Hello"

# Targets (see the brief in bench/README.md).
DECODE_RATIO_TARGET = 0.97
PER_TOKEN_RATIO_TARGET = 0.97
TTFT_P50_TARGET_S = 0.002
MEMORY_SHARE_TARGET = 0.99

MEMORY_WINDOW_S = 1.0  # how long available memory is watched after an unload/release
MEMORY_INTERVAL_S = 0.01
MEMORY_WITHIN = 0.99  # "got within 99%": share returned >= this


@dataclass(frozen=True)
class Settings:
    model: str
    decode_tokens: int
    decode_epochs: int  # fresh worker + runner each
    decode_rounds: int  # per epoch
    ttft_pairs: int
    ipc_model: str | None  # also measured for figures 1 and 2 (None: the model is tiny)
    ipc_decode_tokens: int
    ipc_ttft_pairs: int
    load_rounds: int
    memory_rounds: int
    quick: bool = False
    ttft_tokens: int = 2
    memory_tokens: int = 4
    warmup_tokens: int = 4
    ttft_warmup: int = 3
    per_token_rounds: int = 5  # a fresh worker and a fresh runner each
    per_token_tokens: int = 512  # ~0.5-1 s of decode on builtin:tiny
    per_token_only: bool = False


def settings_from_args(args: argparse.Namespace) -> Settings:
    model = args.model or ("builtin:tiny" if args.quick else "builtin:small")
    ipc_model = None if model == IPC_MODEL else IPC_MODEL
    if args.quick:
        base = Settings(
            model, 128, 2, 2, 30, ipc_model, 128, 30, 2, 1, quick=True, per_token_rounds=2
        )
    else:
        base = Settings(model, 32, 3, 3, 15, ipc_model, 128, 200, 5, 5)
    overrides = {
        "decode_tokens": args.decode_tokens,
        "decode_epochs": args.epochs,
        "decode_rounds": args.rounds,
        "ttft_pairs": args.ttft_pairs,
        "load_rounds": args.load_rounds,
        "memory_rounds": args.memory_rounds,
        "ttft_tokens": args.ttft_tokens,
        "per_token_rounds": args.per_token_rounds,
        "per_token_tokens": args.per_token_tokens,
    }
    fields = {**asdict(base), **{k: v for k, v in overrides.items() if v is not None}}
    return Settings(**{**fields, "per_token_only": args.per_token_only})


# --- models and memory readings ------------------------------------------------


def model_path(model: str) -> Path:
    """The local directory of ``model``: a builtin (made once, cached) or a directory."""
    if is_builtin(model):
        return ensure_builtin_model(model)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise SystemExit(f"--model must be builtin:NAME or a local model directory: {model}")
    return path


def short(model: str) -> str:
    return model.removeprefix("builtin:") if is_builtin(model) else Path(model).name


def model_info(model: str, path: Path) -> dict[str, Any]:
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    weights = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return {
        "model": model,
        "path": str(path),
        "dtype": config.get("torch_dtype"),
        "layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "weights_bytes": weights,
    }


_ZONEINFO = Path("/proc/zoneinfo")
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


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


def rss(pid: int) -> int | None:
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return None


def tree_rss(pid: int) -> int:
    """RSS of ``pid`` and all its descendants (the daemon, its runners, its spare)."""
    root = psutil.Process(pid)
    total = 0
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += int(process.memory_info().rss)
    return total


Side = Callable[[], dict[str, Any]]


def stream_tps(run: dict[str, Any]) -> float:
    """Decode rate seen by the consumer: tokens after the first / first -> end."""
    return float((run["frames"] - 1) / run["stream_s"])


# --- figure 1: decode tokens/s -----------------------------------------------


def with_cpu(run: Side, pids: dict[str, int]) -> dict[str, Any]:
    """``run()``, plus the CPU seconds each of ``pids`` (and this process) spent in it."""
    before = {who: cpu_s(pid) for who, pid in pids.items()}
    own = time.process_time()
    result = run()
    own = time.process_time() - own
    result["cpu_s"] = {who: cpu_s(pid) - before[who] for who, pid in pids.items()}
    result["cpu_s"]["client"] = own  # includes DaemonProcess's log-reader thread
    return result


def bench_decode(
    d: Daemon,
    model: str,
    path: Path,
    max_tokens: int,
    epochs: int,
    rounds: int,
    warmup_tokens: int,
    tmp: Path,
) -> dict[str, Any]:
    """``epochs`` times: a fresh worker and a fresh runner, then ``rounds`` pairs.

    A process's decode speed varies by several percent from one process to the next
    (two identical plain workers differ by up to ~8% on the shared 2-core VM) and
    stays put for its lifetime, so rounds within one pair of processes cannot
    average it out: fresh processes per epoch do.
    """
    name, client = short(model), d.client
    samples: list[dict[str, Any]] = []
    for epoch in range(epochs):
        with worker(tmp / f"decode-{name}-{epoch}.log") as w:
            w.request("load", key=name, path=str(path))
            client.load(model, name)
            try:
                d.settle()
                inproc_generate(w, name, DECODE_PROMPT, warmup_tokens)
                daemon_generate(client, name, DECODE_PROMPT, warmup_tokens)
                runner_pid = runner_info(client, name).pid
                assert runner_pid is not None
                pids = {"daemon": d.process.pid, "runner": runner_pid}
                for _ in range(rounds):
                    samples.append(
                        decode_round(len(samples), epoch, client, w, name, max_tokens, pids)
                    )
            finally:
                client.unload(name)
    tokens_equal = all(
        s["inproc_tokens"] == s["daemon_tokens"] == s["daemon_frames"] for s in samples
    )

    def med(key: str, items: list[dict[str, Any]] = samples) -> float:
        return median(s[key] for s in items)

    return {
        "model": model,
        "max_tokens": max_tokens,
        "epochs": epochs,
        "rounds": rounds * epochs,
        "prompt": DECODE_PROMPT,
        "median_ratio": med("ratio"),
        "ratio_p25_p75": [
            percentile([s["ratio"] for s in samples], 25),
            percentile([s["ratio"] for s in samples], 75),
        ],
        "epoch_median_ratios": [
            med("ratio", [s for s in samples if s["epoch"] == e]) for e in range(epochs)
        ],
        "median_reported_ratio": med("reported_ratio"),
        "median_inproc_tps": med("inproc_tps"),
        "median_daemon_tps": med("daemon_tps"),
        "median_inproc_reported_tps": med("inproc_reported_tps"),
        "median_daemon_reported_tps": med("daemon_reported_tps"),
        "median_cpu_per_token_s": {
            who: median(s["cpu_per_token_s"][who] for s in samples)
            for who in ("worker", "runner", "daemon", "client")
        },
        "tokens_equal": tokens_equal,
        "ran_to_max_tokens": all(s["inproc_tokens"] == max_tokens for s in samples),
        "same_text": all(s["same_text"] for s in samples),
        "samples": samples,
    }


def decode_round(
    index: int,
    epoch: int,
    client: Client,
    w: Worker,
    name: str,
    max_tokens: int,
    pids: dict[str, int],
) -> dict[str, Any]:
    inproc, daemon = run_alternating(
        index,
        lambda: with_cpu(
            lambda: inproc_generate(w, name, DECODE_PROMPT, max_tokens), {"worker": w.pid}
        ),
        lambda: with_cpu(lambda: daemon_generate(client, name, DECODE_PROMPT, max_tokens), pids),
    )
    tokens = inproc["generation_tokens"]
    sample = {
        "round": index,
        "epoch": epoch,
        "first": alternate(index, "in-process", "daemon")[0],
        "inproc_tps": stream_tps(inproc),
        "daemon_tps": stream_tps(daemon),
        "inproc_reported_tps": inproc["reported_tps"],
        "daemon_reported_tps": daemon["reported_tps"],
        "inproc_tokens": inproc["generation_tokens"],
        "daemon_tokens": daemon["generation_tokens"],
        "daemon_frames": daemon["frames"],
        "inproc_finish": inproc["finish_reason"],
        "daemon_finish": daemon["finish_reason"],
        "same_text": inproc["text"] == daemon["text"],
        "inproc_sync_s": inproc["sync_s"],
        # CPU seconds per generated token, by process
        "cpu_per_token_s": {
            "worker": inproc["cpu_s"]["worker"] / tokens,
            "runner": daemon["cpu_s"]["runner"] / tokens,
            "daemon": daemon["cpu_s"]["daemon"] / tokens,
            "client": daemon["cpu_s"]["client"] / tokens,
        },
    }
    sample["ratio"] = sample["daemon_tps"] / sample["inproc_tps"]
    sample["reported_ratio"] = sample["daemon_reported_tps"] / sample["inproc_reported_tps"]
    note(
        f"  decode {name} epoch {epoch + 1} round {index + 1}: in-process "
        f"{sample['inproc_tps']:.2f} tok/s, daemon {sample['daemon_tps']:.2f} tok/s, "
        f"ratio {sample['ratio']:.3f}"
    )
    return sample


# --- figure 2: time to first token -------------------------------------------


def bench_ttft(
    client: Client, w: Worker, model: str, pairs: int, warmup: int, max_tokens: int
) -> dict[str, Any]:
    name = short(model)
    rows = []
    for index in range(warmup + pairs):
        inproc, daemon = run_alternating(
            index,
            lambda: inproc_generate(w, name, TTFT_PROMPT, max_tokens),
            lambda: daemon_generate(client, name, TTFT_PROMPT, max_tokens),
        )
        if index >= warmup:
            rows.append(
                {
                    "inproc_s": inproc["ttft_s"],
                    "daemon_s": daemon["ttft_s"],
                    "daemon_e2e_s": daemon["e2e_ttft_s"],
                    "runner_s": daemon["runner_ttft_s"],
                }
            )

    def column(key: str) -> list[float]:
        return [float(r[key]) for r in rows]

    def diffs(key: str) -> list[float]:
        return [r[key] - r["inproc_s"] for r in rows]

    def summary(values: list[float]) -> dict[str, float]:
        return percentiles(values, (25, 50, 75, 99))

    inproc_s, daemon_s = column("inproc_s"), column("daemon_s")
    result: dict[str, Any] = {
        "model": model,
        "pairs": pairs,
        "max_tokens": max_tokens,
        "prompt": TTFT_PROMPT,
        "inproc": summary(inproc_s),
        "daemon": summary(daemon_s),
        "daemon_e2e": summary(column("daemon_e2e_s")),
        "runner": summary(column("runner_s")),
        # headline: per-pair differences (each daemon request minus the in-process one
        # next to it), then their percentiles
        "paired_diff": summary(diffs("daemon_s")),
        "paired_diff_e2e": summary(diffs("daemon_e2e_s")),
        # the other reading: percentile of one distribution minus that of the other
        "distribution_diff": {
            "p50": percentile(daemon_s, 50) - percentile(inproc_s, 50),
            "p99": percentile(daemon_s, 99) - percentile(inproc_s, 99),
        },
        # the two hops alone: client-seen TTFT minus the runner's own TTFT
        "hops_only": summary([r["daemon_s"] - r["runner_s"] for r in rows]),
        "samples": rows,
    }
    note(
        f"  ttft {name}: {pairs} pairs, paired diff p50 "
        f"{1000 * result['paired_diff']['p50']:.3f} ms, p99 "
        f"{1000 * result['paired_diff']['p99']:.3f} ms"
    )
    return result


# --- figure 3: load to ready -------------------------------------------------


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


# --- figure 4: memory given back ---------------------------------------------


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
    daemon_rss_before = rss(daemon_pid)
    tree_before = tree_rss(daemon_pid)
    before = available_now()
    loaded_reply = client.load(model, name)
    daemon_generate(client, name, DECODE_PROMPT, tokens)
    d.settle()
    status = client.status()
    runner = next(r for r in status.runners if r.name == name)
    spare = getattr(status, "spare", None)
    tree_loaded = tree_rss(daemon_pid)
    loaded = available_now()
    unload_started = time.perf_counter()
    unloaded = client.unload(name)
    returned = time.perf_counter()
    window = watch_return(before, loaded, returned)
    tree_after = tree_rss(daemon_pid)
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
        "daemon_rss_after": rss(daemon_pid),
    }


def memory_round_inproc(path: Path, tokens: int, log_path: Path) -> dict[str, Any]:
    with worker(log_path) as w:
        before = available_now()
        rss_before = rss(w.pid)
        w.request("load", key="m", path=str(path))
        w.request("generate", key="m", prompt=DECODE_PROMPT, max_tokens=tokens)
        loaded = available_now()
        rss_loaded = rss(w.pid)
        released = w.request("release", key="m")
        window = watch_return(before, loaded, time.perf_counter())
        rss_after = rss(w.pid)
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


# --- figure 5: per-token cost, as a user sees it ------------------------------


def cli_argv() -> list[str]:
    """The command a user runs: the ``mlx-supervisor`` script installed beside this
    python, else ``python -m supervisor`` (the same entry point)."""
    script = Path(sys.executable).with_name("mlx-supervisor")
    return [str(script)] if script.exists() else [sys.executable, "-m", "supervisor"]


def cli_generate(
    socket_path: Path, name: str, prompt: str, max_tokens: int, log_path: Path
) -> dict[str, Any]:
    """``mlx-supervisor generate NAME PROMPT --max-tokens N --json`` against the daemon on
    ``socket_path``, its stdout read here as it streams.

    The CLI writes (and flushes) each piece of text as it arrives, then, after ``done``,
    a newline and a JSON summary line (flushed as it exits). The time of every read is
    taken here, so the figure sees what a terminal would: the first byte, the last byte
    of the text (the last token) and the last byte of all (the summary).

    Raises:
        RuntimeError: the CLI failed or printed no text.
    """
    argv = [*cli_argv(), "generate", name, prompt, "--max-tokens", str(max_tokens), "--json",
            "--socket", str(socket_path)]  # fmt: skip
    reads: list[tuple[float, int]] = []  # (when, bytes read so far)
    chunks: list[bytes] = []
    with log_path.open("ab") as log:
        started = time.perf_counter()
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log
        )
        assert process.stdout is not None
        size = 0
        with process.stdout as stdout:
            while chunk := os.read(stdout.fileno(), 1 << 16):
                now = time.perf_counter()
                size += len(chunk)
                reads.append((now, size))
                chunks.append(chunk)
        end_of_output = time.perf_counter()
        code = process.wait()
        reaped = time.perf_counter()
    output = b"".join(chunks)
    body, _, summary_line = output.rstrip(b"\n").rpartition(b"\n")
    if code != 0 or not body:
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-2000:]
        printed = output[-200:]
        raise RuntimeError(f"{' '.join(argv)} exited with {code}, printed {printed!r}:\n{tail}")
    summary = json.loads(summary_line)
    first = reads[0][0]
    last_text = next(when for when, size in reads if size >= len(body))
    last = reads[-1][0]
    tokens = int(summary["generation_tokens"])
    return {
        "generation_tokens": tokens,
        "finish_reason": summary["finish_reason"],
        "text": body.decode("utf-8", errors="replace"),
        "reads": len(reads),
        "tps": (tokens - 1) / (last - first),
        "text_tps": (tokens - 1) / (last_text - first),
        "first_byte_s": first - started,  # python starts, imports, connects; prefill
        "summary_after_text_s": last - last_text,
        "exit_after_output_s": reaped - end_of_output,
        "summary": summary,
    }


def bench_per_token(
    d: Daemon,
    path: Path,
    rounds: int,
    max_tokens: int,
    warmup_tokens: int,
    tmp: Path,
    pairs: int = PER_TOKEN_PAIRS,
) -> dict[str, Any]:
    """Per round, on builtin:tiny: a fresh runner through the daemon and a fresh
    ``inproc_worker.py`` (a process keeps its own decode speed for its lifetime), both
    loaded and warmed up (a ``warmup_tokens`` generation each, untimed); then ``pairs``
    timed pairs, alternating which side goes first: the CLI's ``generate --json``
    streaming from the daemon, and ``stream_generate`` in the worker. Only one side
    computes at a time.

    This VM's speed changes in phases of seconds (the same decode runs at 450 or 700
    tok/s), so one long sample per side and round can land in different phases; a
    round's ratio is the median of its pairs' ratios, each pair measured back to back.
    """
    model, name, client = PER_TOKEN_MODEL, short(PER_TOKEN_MODEL), d.client

    def run_daemon(index: int, pair: int) -> dict[str, Any]:
        log_path = tmp / f"per-token-cli-{index}-{pair}.log"
        return cli_generate(d.process.socket_path, name, DECODE_PROMPT, max_tokens, log_path)

    samples: list[dict[str, Any]] = []
    for index in range(rounds):
        client.load(model, name)
        try:
            with worker(tmp / f"per-token-worker-{index}.log") as w:
                w.request("load", key=name, path=str(path))
                inproc_generate(w, name, DECODE_PROMPT, warmup_tokens)
                daemon_generate(client, name, DECODE_PROMPT, warmup_tokens)
                d.settle()
                measured = [
                    run_alternating(
                        index + pair,
                        partial(inproc_generate, w, name, DECODE_PROMPT, max_tokens),
                        partial(run_daemon, index, pair),
                    )
                    for pair in range(pairs)
                ]
        finally:
            client.unload(name)
        pair_ratios = [cli["tps"] / stream_tps(inproc) for inproc, cli in measured]
        pair_text_ratios = [cli["text_tps"] / stream_tps(inproc) for inproc, cli in measured]
        inproc, cli = measured[-1]
        sample = {
            "round": index,
            "pairs": pairs,
            "first": alternate(index, "in-process", "daemon")[0],
            "inproc_tps": median(stream_tps(i) for i, _ in measured),
            "daemon_tps": median(c["tps"] for _, c in measured),
            "daemon_text_tps": median(c["text_tps"] for _, c in measured),
            "inproc_tokens": inproc["generation_tokens"],
            "daemon_tokens": cli["generation_tokens"],
            "inproc_finish": inproc["finish_reason"],
            "daemon_finish": cli["finish_reason"],
            "same_text": all(i["text"] == c["text"] for i, c in measured),
            "tokens_equal": all(
                i["generation_tokens"] == c["generation_tokens"] for i, c in measured
            ),
            "pair_ratios": pair_ratios,
            "ratio": median(pair_ratios),
            "text_ratio": median(pair_text_ratios),
            **{k: median(c[k] for _, c in measured)
               for k in ("reads", "first_byte_s", "summary_after_text_s", "exit_after_output_s")},
        }  # fmt: skip
        samples.append(sample)
        note(
            f"  per-token round {index + 1}/{rounds}: in-process {sample['inproc_tps']:.1f} "
            f"tok/s, CLI {sample['daemon_tps']:.1f} tok/s, ratio {sample['ratio']:.3f} "
            f"(pairs {'/'.join(f'{r:.2f}' for r in pair_ratios)})"
        )

    def med(key: str) -> float:
        return median(s[key] for s in samples)

    return {
        "model": model,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "prompt": DECODE_PROMPT,
        "cli": [*cli_argv(), "generate", name, "PROMPT", "--max-tokens", str(max_tokens),
                "--json", "--socket", "SOCKET"],
        "median_ratio": med("ratio"),
        "median_text_ratio": med("text_ratio"),
        "ratios": [s["ratio"] for s in samples],
        "median_daemon_tps": med("daemon_tps"),
        "median_daemon_text_tps": med("daemon_text_tps"),
        "median_inproc_tps": med("inproc_tps"),
        "median_summary_after_text_s": med("summary_after_text_s"),
        "pairs_per_round": pairs,
        "tokens_equal": all(s["tokens_equal"] for s in samples),
        "ran_to_max_tokens": all(s["inproc_tokens"] == max_tokens for s in samples),
        "same_text": all(s["same_text"] for s in samples),
        "samples": samples,
    }  # fmt: skip


# --- the run -----------------------------------------------------------------


def run(settings: Settings) -> dict[str, Any]:
    started = time.perf_counter()
    at_start = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "loadavg_start": load_average(),
    }
    s = settings
    model, ipc_model = s.model, s.ipc_model
    models = [model] + ([ipc_model] if ipc_model else [])  # PER_TOKEN_MODEL is one of them
    paths = {m: model_path(m) for m in models}
    results: dict[str, Any] = {"settings": asdict(s)}
    with (
        tempfile.TemporaryDirectory(prefix="mlx-bench-") as tmp_name,
        contextlib.ExitStack() as stack,
    ):
        tmp = Path(tmp_name)
        daemon = Daemon.start(stack, tmp, "daemon", "# defaults\n")
        results["daemon"] = {"pid": daemon.process.pid, "hot_spare": daemon.keeps_spare}
        note(f"daemon pid {daemon.process.pid}")
        if s.per_token_only:
            results["machine"] = {**machine_info(mlx_device()), **at_start}
            per_token_path = paths[PER_TOKEN_MODEL]
            results["models"] = {PER_TOKEN_MODEL: model_info(PER_TOKEN_MODEL, per_token_path)}
        else:
            results.update(figures_1_to_4(s, daemon, paths, at_start, stack, tmp))
        note("figure 5: per-token, the CLI streaming vs a fresh in-process stream_generate")
        results["per_token_cli"] = bench_per_token(
            daemon, paths[PER_TOKEN_MODEL], s.per_token_rounds, s.per_token_tokens,
            s.warmup_tokens, tmp,
        )  # fmt: skip
        results["daemon"]["exit"] = daemon.shutdown()
    results["children_left"] = children_left()
    results["machine"]["loadavg_end"] = load_average()
    results["duration_s"] = time.perf_counter() - started
    return results


def figures_1_to_4(
    s: Settings,
    daemon: Daemon,
    paths: dict[str, Path],
    at_start: dict[str, Any],
    stack: contextlib.ExitStack,
    tmp: Path,
) -> dict[str, Any]:
    """Decode, TTFT, load and memory (the JSON's ``decode``, ``ttft``, ``load`` and
    ``memory``), with ``machine`` (from the worker) and ``models``."""
    model, ipc_model, client = s.model, s.ipc_model, daemon.client
    models = list(paths)
    results: dict[str, Any] = {}
    note("figure 1: decode tokens/s")
    decode_args = (s.decode_epochs, s.decode_rounds, s.warmup_tokens, tmp)
    results["decode"] = [bench_decode(daemon, model, paths[model], s.decode_tokens, *decode_args)]
    if ipc_model:
        results["decode"].append(
            bench_decode(daemon, ipc_model, paths[ipc_model], s.ipc_decode_tokens, *decode_args)
        )
    note("figure 2: time to first token")
    with worker(tmp / "worker.log") as w:
        results["machine"] = {**machine_info(w.hello["device"]), **at_start}
        results["models"] = {m: model_info(m, paths[m]) for m in models}
        for m in models:
            w.request("load", key=short(m), path=str(paths[m]))
            client.load(m, short(m))
        daemon.settle()
        results["ttft"] = [bench_ttft(client, w, model, s.ttft_pairs, s.ttft_warmup, s.ttft_tokens)]
        if ipc_model:
            results["ttft"].append(
                bench_ttft(client, w, ipc_model, s.ipc_ttft_pairs, s.ttft_warmup, s.ttft_tokens)
            )
        for m in models:
            client.unload(short(m))
    note("figure 3: load to ready")
    daemons = {"daemon": daemon}
    if daemon.keeps_spare:
        # the same daemon without its hot spare: every load starts python and imports mlx
        daemons = {
            "hot spare": daemon,
            "no spare": Daemon.start(stack, tmp, "cold", "hot_spare = false\n"),
        }
    results["load"] = bench_load(daemons, model, paths[model], s.load_rounds)
    for d in daemons.values():
        if d is not daemon:
            d.shutdown()
    note("figure 4: memory given back")
    results["memory"] = bench_memory(
        daemon, model, paths[model], s.memory_rounds, s.memory_tokens, tmp
    )
    return results


# --- the table ---------------------------------------------------------------


Row = tuple[str, str, str, str, str, str]


def _decode_rows(d: dict[str, Any]) -> list[Row]:
    m, target = short(d["model"]), DECODE_RATIO_TARGET
    what = f"{m}, {d['max_tokens']} tok, median of {d['rounds']}"
    epochs = "/".join(f"{r:.3f}" for r in d["epoch_median_ratios"])
    checks = f"{'yes' if d['tokens_equal'] else 'NO'} / {'yes' if d['same_text'] else 'NO'}"
    cpu = d["median_cpu_per_token_s"]
    return [
        (
            f"1 decode tok/s, client-seen ({what})",
            f"{d['median_daemon_tps']:.2f}",
            f"{d['median_inproc_tps']:.2f}",
            f"ratio {d['median_ratio']:.3f} (epochs {epochs})",
            f">= {target}",
            verdict(d["median_ratio"] >= target),
        ),
        (
            f"1 decode tok/s, mlx-lm generation_tps ({m})",
            f"{d['median_daemon_reported_tps']:.2f}",
            f"{d['median_inproc_reported_tps']:.2f}",
            f"ratio {d['median_reported_ratio']:.3f}",
            f">= {target}",
            verdict(d["median_reported_ratio"] >= target),
        ),
        (
            f"1 CPU per token: runner / worker; daemon + client ({m})",
            f"{cpu_time(cpu['runner'])} + {cpu_time(cpu['daemon'] + cpu['client'])}",
            cpu_time(cpu["worker"]),
            f"daemon {cpu_time(cpu['daemon'])}, client {cpu_time(cpu['client'])}",
            "",
            "",
        ),
        (
            f"1 check: same token count / same text ({m})",
            "",
            "",
            checks,
            "yes / yes",
            verdict(d["tokens_equal"]),
        ),
    ]


def _ttft_rows(t: dict[str, Any], checked: bool) -> list[Row]:
    """``checked``: the row the target applies to (the model whose compute is smallest)."""
    m, paired = short(t["model"]), t["paired_diff"]
    dist, e2e, hops = t["distribution_diff"], t["paired_diff_e2e"], t["hops_only"]
    iqr = f"IQR {signed_ms(paired['p25'])} to {signed_ms(paired['p75'])}"
    return [
        (
            f"2 TTFT p50, Generation.ttft_s ({m}, {t['pairs']} pairs, max_tokens "
            f"{t['max_tokens']})",
            ms(t["daemon"]["p50"]),
            ms(t["inproc"]["p50"]),
            f"paired diff {signed_ms(paired['p50'])} ({iqr})",
            f"< {TTFT_P50_TARGET_S * 1000:g} ms" if checked else "",
            verdict(paired["p50"] < TTFT_P50_TARGET_S) if checked else "",
        ),
        (
            f"2 TTFT p99, Generation.ttft_s ({m})",
            ms(t["daemon"]["p99"]),
            ms(t["inproc"]["p99"]),
            f"paired diff {signed_ms(paired['p99'])}",
            "",
            "",
        ),
        (
            f"2 TTFT p50(daemon)-p50(in-proc) / p99-p99 ({m})",
            "",
            "",
            f"{signed_ms(dist['p50'])} / {signed_ms(dist['p99'])}",
            "",
            "",
        ),
        (
            f"2 TTFT incl. connect+handshake, paired p50 / p99 ({m})",
            ms(t["daemon_e2e"]["p50"]),
            "",
            f"{signed_ms(e2e['p50'])} / {signed_ms(e2e['p99'])}",
            "",
            "",
        ),
        (
            f"2 the hops alone: client ttft - runner ttft, p50 / p99 ({m})",
            "",
            "",
            f"{signed_ms(hops['p50'])} / {signed_ms(hops['p99'])}",
            "",
            "",
        ),
    ]


def _load_rows(ld: dict[str, Any]) -> list[Row]:
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


def _memory_rows(mem: dict[str, Any]) -> list[Row]:
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


def _per_token_rows(p: dict[str, Any]) -> list[Row]:
    m, target = short(p["model"]), PER_TOKEN_RATIO_TARGET
    pairs = p.get("pairs_per_round", 1)
    what = f"{m}, {p['max_tokens']} tok, median of {p['rounds']} rounds x {pairs} pairs"
    rounds = "/".join(f"{r:.3f}" for r in p["ratios"])
    checks = f"{'yes' if p['tokens_equal'] else 'NO'} / {'yes' if p['same_text'] else 'NO'}"
    return [
        (
            f"5 per-token tok/s, CLI --json ({what})",
            f"{p['median_daemon_tps']:.2f}",
            f"{p['median_inproc_tps']:.2f}",
            f"ratio {p['median_ratio']:.3f} (rounds {rounds})",
            f">= {target}",
            verdict(p["median_ratio"] >= target),
        ),
        (
            f"5 ... to the CLI's last token, not its summary ({m})",
            f"{p['median_daemon_text_tps']:.2f}",
            "",
            f"ratio {p['median_text_ratio']:.3f}; summary "
            f"{ms(p['median_summary_after_text_s'])} after it",
            "",
            "",
        ),
        (
            f"5 check: same token count / same text ({m})",
            "",
            "",
            checks,
            "yes / yes",
            verdict(p["tokens_equal"]),
        ),
    ]


def table(results: dict[str, Any]) -> str:
    rows: list[Row] = []
    for d in results.get("decode", []):
        rows += _decode_rows(d)
    ttfts = results.get("ttft", [])
    for index, t in enumerate(ttfts):
        rows += _ttft_rows(t, checked=index == len(ttfts) - 1)
    if "load" in results:
        rows += _load_rows(results["load"])
    if "memory" in results:
        rows += _memory_rows(results["memory"])
    rows += _per_token_rows(results["per_token_cli"])
    header: Row = ("figure", "daemon", "in-process", "result", "target", "")
    mach = results["machine"]
    quick = " (--quick: a smoke run, not a measurement)" if results["settings"]["quick"] else ""
    title = (
        f"mlx-supervisor daemon vs in-process mlx-lm{quick}, {mach['date']}\n"
        f"{mach['platform']}, {mach['cpu_count']} CPUs ({mach['cpu']}), "
        f"{mach['memory_total_bytes'] / 2**30:.1f} GiB, python {mach['python']}, "
        f"mlx {mach['mlx']} on {mach['mlx_device']}, mlx-lm {mach['mlx_lm']}"
    )
    footer = (
        f"ran {results['duration_s']:.0f} s; load average {mach['loadavg_start'][0]:.2f} at "
        f"start, {mach['loadavg_end'][0]:.2f} at end; child processes left: "
        f"{len(results['children_left'])}"
    )
    return "\n".join([title, "", render_table(header, rows), "", footer])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="builtin:NAME or a model directory (builtin:small)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny, few rounds")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    parser.add_argument("--decode-tokens", type=int, help="max_tokens of figure 1's decodes")
    parser.add_argument("--epochs", type=int, help="figure 1's fresh process pairs")
    parser.add_argument("--rounds", type=int, help="figure 1's rounds per epoch")
    parser.add_argument("--ttft-pairs", type=int, help="figure 2's pairs for --model")
    parser.add_argument("--ttft-tokens", type=int, help="max_tokens of figure 2's requests (2)")
    parser.add_argument("--load-rounds", type=int, help="figure 3's rounds")
    parser.add_argument("--memory-rounds", type=int, help="figure 4's rounds")
    parser.add_argument("--per-token-rounds", type=int, help="figure 5's rounds (5; --quick 2)")
    parser.add_argument("--per-token-tokens", type=int, help="max_tokens of figure 5 (512)")
    parser.add_argument(
        "--per-token-only", action="store_true", help="run figure 5 alone (per-token, CLI)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(settings_from_args(args))
    write_json(results, args.out)
    print(table(results))
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

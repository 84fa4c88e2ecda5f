"""Status latency while the model's queue is full, and what happens to every request.

Usage::

    python bench/bench_hardening.py [--quick] [--no-queue-bound]
                                    [--out bench/results/hardening.json]

One run starts a private daemon with ``max_queue = 32`` and ``builtin:tiny``
loaded, and measures ``status`` round trips (a new connection each, as the CLI
makes them) side by side in the same run:

- on the idle daemon (the anchor), before and after each load phase;
- while 64 clients stream generations from the model without pause: one is
  served, 32 wait in its queue, the rest are refused with ``busy`` at once and
  retry after a short pause.

The ratio loaded / idle of p50 and p99 is the figure; the target is p99 < 10 ms
under load. Then every request the clients started is accounted for: it
completed with the expected token count, or was refused ``busy``, or failed
with a cause; none hung (each client call has a timeout) and none was lost
(started = completed + refused + failed). It prints a table and writes the
JSON (machine info, settings, every raw sample). See bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS_DIR,
    Daemon,
    children_left,
    cpu_s_each,
    load_average,
    machine_info,
    mlx_device,
    ms,
    note,
    ratio,
    runner_info,
    verdict,
    write_json,
)
from supervisor.client import Client, ClientError
from supervisor.figures import percentiles, render_table

DEFAULT_OUT = RESULTS_DIR / "hardening.json"
MODEL = "builtin:tiny"
NAME = "tiny"
PROMPT = "The supervisor keeps every model in a runner process of its own."
STATUS_P99_TARGET_S = 0.010


@dataclass(frozen=True)
class Settings:
    clients: int = 64
    max_queue: int | None = 32  # None: the daemon's default (no bound reached by 64 clients)
    max_tokens: int = 32
    samples: int = 500  # status round trips per phase
    interval_s: float = 0.02  # between one status reply and the next request
    rounds: int = 2  # load phases; an idle phase before the first and after each
    busy_pause_s: float = 0.05  # a refused client's mean pause before it tries again
    busy_jitter: bool = True  # pause uniform in 0.5..1.5 x; False: all alike, a herd in step
    call_timeout_s: float = 30.0  # a client call silent this long has hung
    fill_timeout_s: float = 60.0  # to wait for the queue to fill before measuring
    quick: bool = False


def settings_from_args(args: argparse.Namespace) -> Settings:
    base = Settings(samples=150, rounds=1, quick=True) if args.quick else Settings()
    overrides: dict[str, Any] = {
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "samples": args.samples,
        "rounds": args.rounds,
    }
    fields = {**asdict(base), **{k: v for k, v in overrides.items() if v is not None}}
    if args.no_queue_bound:
        fields["max_queue"] = None
    if args.busy_pause_ms is not None:
        fields["busy_pause_s"] = args.busy_pause_ms / 1000
    if args.no_jitter:
        fields["busy_jitter"] = False
    return Settings(**fields)


def config_text(s: Settings) -> str:
    """The daemon's config file: an explicit one keeps a user's own config out."""
    return "# defaults\n" if s.max_queue is None else f"max_queue = {s.max_queue}\n"


# --- the load: a child process with one thread per client --------------------
# Its own process, as real clients are: 64 threads in the measuring process would
# compete with the status probe for its GIL, and that would be measured too.


class Tally:
    """What the client threads saw, counted under a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()  # started, completed, refused_busy, ...
        self.failed: Counter[str] = Counter()  # failed with a cause, by error code
        self.examples: dict[str, str] = {}  # the first message seen of each kind
        self.completed_s: list[float] = []  # call -> done, queue wait included
        self.completed_queued = 0  # completed requests that were told a queue position
        self.refused_s: list[float] = []  # call -> busy error

    def add(self, outcome: str, seconds: float | None = None, detail: str = "") -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if outcome == "completed" and seconds is not None:
                self.completed_s.append(seconds)
            elif outcome == "refused_busy" and seconds is not None:
                self.refused_s.append(seconds)
            if detail:
                self.examples.setdefault(outcome, detail)

    def as_dict(self) -> dict[str, Any]:
        with self.lock:
            return {
                "outcomes": dict(self.outcomes),
                "failed_by_code": dict(self.failed),
                "examples": dict(self.examples),
                "completed_queued": self.completed_queued,
                "completed_s": [round(x, 6) for x in self.completed_s],
                "refused_s": [round(x, 6) for x in self.refused_s],
            }


def stream_until_stopped(client: Client, s: Settings, stop: Event, tally: Tally, seed: int) -> None:
    """One client: generate, generate, ... until ``stop``; pause after a ``busy``."""
    rng = random.Random(seed)
    while not stop.is_set():
        tally.add("started")
        started = time.perf_counter()
        try:
            with client.generate(NAME, PROMPT, max_tokens=s.max_tokens) as gen:
                for _ in gen:
                    pass
        except ClientError as exc:
            elapsed = time.perf_counter() - started
            if exc.code == "busy":
                tally.add("refused_busy", elapsed, exc.message)
                stop.wait(s.busy_pause_s * (rng.uniform(0.5, 1.5) if s.busy_jitter else 1.0))
            elif exc.code == "timeout":
                tally.add("hung", elapsed, exc.message)
            else:
                with tally.lock:
                    tally.failed[exc.code] += 1
                tally.add("failed", elapsed, f"{exc.code}: {exc.message}")
            continue
        except Exception as exc:  # the accounting must see everything a client saw
            tally.add("crashed", time.perf_counter() - started, repr(exc))
            continue
        elapsed = time.perf_counter() - started
        done = gen.done
        if done is not None and done.generation_tokens == s.max_tokens == gen.tokens:
            tally.add("completed", elapsed)
            if gen.position is not None:
                with tally.lock:
                    tally.completed_queued += 1
        else:
            got = "no done" if done is None else f"{done.generation_tokens} ({done.finish_reason})"
            tally.add("wrong_tokens", elapsed, f"expected {s.max_tokens} tokens, got {got}")


def generate_load(
    socket_path: str, settings: dict[str, Any], stop: Event, out: Queue[dict[str, Any]]
) -> None:
    """The load generator (a child process): ``clients`` threads stream from the
    model until ``stop`` is set; then the tally goes on ``out``."""
    s = Settings(**settings)
    client = Client(socket_path, timeout_s=s.call_timeout_s)  # one connection per call
    tally = Tally()
    threads = [
        threading.Thread(
            target=stream_until_stopped, args=(client, s, stop, tally, seed), daemon=True
        )
        for seed in range(s.clients)
    ]
    for thread in threads:
        thread.start()
    stop.wait()
    deadline = time.monotonic() + s.call_timeout_s + 10  # a call in flight may take that long
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    out.put({**tally.as_dict(), "threads_stuck": sum(t.is_alive() for t in threads)})


# --- the probe: status round trips from the main thread ----------------------


def probe_status(client: Client, samples: int, interval_s: float) -> dict[str, Any]:
    """``samples`` status round trips, each ``interval_s`` after the last reply."""
    latency_s: list[float] = []
    queue_depth: list[int | None] = []
    state: list[str | None] = []
    errors: list[str] = []
    for _ in range(samples):
        started = time.perf_counter()
        try:
            reply = client.status()
        except ClientError as exc:
            errors.append(f"{exc.code}: {exc.message}")
        else:
            latency_s.append(time.perf_counter() - started)
            runner = next((r for r in reply.runners if r.name == NAME), None)
            queue_depth.append(None if runner is None else runner.queue_depth)
            state.append(None if runner is None else runner.state)
        time.sleep(interval_s)
    return {"latency_s": latency_s, "queue_depth": queue_depth, "state": state, "errors": errors}


def queue_depth(client: Client) -> int:
    return runner_info(client, NAME).queue_depth


def idle_phase(daemon: Daemon, client: Client, s: Settings, index: int) -> dict[str, Any]:
    note(f"idle phase {index}: {s.samples} status round trips")
    settle_s = daemon.settle()
    return {"kind": "idle", "index": index, "settle_s": settle_s,
            **probe_status(client, s.samples, s.interval_s)}  # fmt: skip


def load_phase(daemon: Daemon, client: Client, s: Settings, index: int) -> dict[str, Any]:
    note(f"load phase {index}: {s.clients} clients, then {s.samples} status round trips")
    full = s.max_queue if s.max_queue is not None else s.clients - 1
    busy_before = client.status().counters.get("requests_refused_busy", 0)
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    out: Queue[dict[str, Any]] = ctx.Queue()
    generator = ctx.Process(
        target=generate_load, args=(str(client.socket_path), asdict(s), stop, out), daemon=True
    )
    started = time.perf_counter()
    generator.start()
    try:
        fill_s: float | None = None
        while time.perf_counter() - started < s.fill_timeout_s:
            if queue_depth(client) >= full:
                fill_s = time.perf_counter() - started
                break
            time.sleep(0.02)
        if fill_s is None:
            note(f"the queue did not reach {full} within {s.fill_timeout_s:g} s; measuring anyway")
        pids = {"daemon": daemon.process.pid, "runner": runner_info(client, NAME).pid,
                "clients": generator.pid, "probe": os.getpid()}  # fmt: skip
        lines_before, cpu_before = daemon.process.line_count, cpu_s_each(pids)
        probe_started = time.perf_counter()
        probe = probe_status(client, s.samples, s.interval_s)
        probe_s = time.perf_counter() - probe_started
        log_lines, cpu_after = daemon.process.line_count - lines_before, cpu_s_each(pids)
    finally:
        stop.set()
        try:  # before join, so the queue's pipe drains
            tally = out.get(timeout=s.call_timeout_s + 60)
        except queue.Empty:  # the generator died: count every client as stuck
            tally = {**Tally().as_dict(), "threads_stuck": s.clients}
        generator.join(30)
    load_s = time.perf_counter() - started
    busy_counted = client.status().counters.get("requests_refused_busy", 0) - busy_before
    return {
        "kind": "load",
        "index": index,
        "fill_s": fill_s,
        "load_s": load_s,
        "probe_s": probe_s,
        "daemon_log_lines_per_s": log_lines / probe_s,
        "cpu_cores_busy": {
            k: (cpu_after[k] - cpu_before[k]) / probe_s for k in cpu_after if k in cpu_before
        },
        "daemon_refused_busy": busy_counted,
        "generator_exit": generator.exitcode,
        **probe,
        "clients": tally,
    }


# --- the run -----------------------------------------------------------------


def summary(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None, "n": 0}
    return {**percentiles(values, (50, 99)), "max": max(values), "n": len(values)}


def accounting(phases: list[dict[str, Any]], s: Settings) -> dict[str, Any]:
    """Every request the clients started, by outcome, over all load phases."""
    outcomes: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    examples: dict[str, str] = {}
    completed_s: list[float] = []
    refused_s: list[float] = []
    stuck = daemon_busy = queued = 0
    load_s = 0.0
    for phase in phases:
        c = phase["clients"]
        outcomes.update(c["outcomes"])
        failed.update(c["failed_by_code"])
        for kind, example in c["examples"].items():
            examples.setdefault(kind, example)
        completed_s += c["completed_s"]
        refused_s += c["refused_s"]
        stuck += c["threads_stuck"]
        queued += c["completed_queued"]
        daemon_busy += phase["daemon_refused_busy"]
        load_s += phase["load_s"]
    ended = ("completed", "refused_busy", "failed", "hung", "wrong_tokens", "crashed")
    lost = outcomes["started"] - sum(outcomes[k] for k in ended)
    return {
        "started": outcomes["started"],
        "completed": outcomes["completed"],
        "completed_after_waiting": queued,
        "refused_busy": outcomes["refused_busy"],
        "refused_busy_per_s": outcomes["refused_busy"] / load_s if load_s else None,
        "daemon_refused_busy": daemon_busy,
        "failed_with_cause": outcomes["failed"],
        "failed_by_code": dict(failed),
        "hung": outcomes["hung"],
        "wrong_tokens": outcomes["wrong_tokens"],
        "crashed": outcomes["crashed"],
        "lost": lost,
        "threads_stuck": stuck,
        "examples": examples,
        "completed_s": summary(completed_s),
        "refused_s": summary(refused_s),
        "expected_tokens": s.max_tokens,
    }


def run(s: Settings) -> dict[str, Any]:
    started = time.perf_counter()
    results: dict[str, Any] = {"settings": asdict(s)}
    results["machine"] = machine_info(mlx_device())
    phases: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="mlx-bench-hardening-") as tmp_name,
        contextlib.ExitStack() as stack,
    ):
        daemon = Daemon.start(stack, Path(tmp_name), "hardening", config_text(s))
        results["daemon"] = {"pid": daemon.process.pid, "config": config_text(s)}
        note(f"daemon pid {daemon.process.pid}; loading {MODEL}")
        client = Client(daemon.process.socket_path, timeout_s=s.call_timeout_s)
        client.load(MODEL, NAME)
        daemon.settle()
        for _ in range(20):  # warm-up: first connections, first generation
            client.status()
        client.generate_text(NAME, PROMPT, max_tokens=s.max_tokens)
        phases.append(idle_phase(daemon, client, s, 0))
        for index in range(s.rounds):
            phases.append(load_phase(daemon, client, s, index))
            phases.append(idle_phase(daemon, client, s, index + 1))
        results["counters"] = client.status().counters
        results["daemon"]["exit"] = daemon.shutdown()
    idle = [x for p in phases if p["kind"] == "idle" for x in p["latency_s"]]
    loaded = [x for p in phases if p["kind"] == "load" for x in p["latency_s"]]
    depths = [d for p in phases if p["kind"] == "load" for d in p["queue_depth"]]
    full = s.max_queue if s.max_queue is not None else s.clients - 1
    load_phases = [p for p in phases if p["kind"] == "load"]
    results["status_s"] = {"idle": summary(idle), "load": summary(loaded)}
    results["queue_full_share"] = sum(d == full for d in depths) / len(depths) if depths else None
    known = [d for d in depths if d is not None]
    results["queue_depth_median"] = statistics.median(known) if known else None
    results["status_errors"] = [e for p in phases for e in p["errors"]]
    results["daemon_log_lines_per_s"] = statistics.median(
        p["daemon_log_lines_per_s"] for p in load_phases
    )
    results["cpu_cores_busy_under_load"] = {
        k: statistics.median(p["cpu_cores_busy"].get(k, 0.0) for p in load_phases)
        for k in load_phases[0]["cpu_cores_busy"]
    }
    results["requests"] = accounting(load_phases, s)
    results["phases"] = phases
    results["children_left"] = children_left()
    results["machine"]["loadavg_end"] = load_average()
    results["duration_s"] = time.perf_counter() - started
    return results


# --- the table ---------------------------------------------------------------


def checks(r: dict[str, Any]) -> dict[str, bool]:
    """Pass/fail of each target and each accounting rule."""
    q, load_p99 = r["requests"], r["status_s"]["load"]["p99"]
    bounded = r["settings"]["max_queue"] is not None
    return {
        "status p99 under load < 10 ms": load_p99 is not None and load_p99 < STATUS_P99_TARGET_S,
        "status never failed": not r["status_errors"],
        "none hung": q["hung"] == 0 and q["threads_stuck"] == 0,
        "none lost (started = completed + refused + failed)": q["lost"] == 0,
        "every request completed, with the expected tokens, or was refused busy": (
            q["failed_with_cause"] + q["wrong_tokens"] + q["crashed"] + q["hung"] + q["lost"] == 0
        ),
        "refusals the clients saw = the daemon's requests_refused_busy": (
            q["refused_busy"] == q["daemon_refused_busy"]
        ),
        "queue full under load (busy refusals seen)": not bounded or q["refused_busy"] > 0,
        "clean shutdown (exit 0), no child left": (
            r["daemon"]["exit"]["code"] == 0 and not r["children_left"]
        ),
    }


def table(r: dict[str, Any]) -> str:
    s, idle, load, q = r["settings"], r["status_s"]["idle"], r["status_s"]["load"], r["requests"]
    mach = r["machine"]
    bound = f"max_queue = {s['max_queue']}" if s["max_queue"] is not None else "no max_queue"
    quick = " (--quick: a smoke run)" if s["quick"] else ""
    title = (
        f"mlx-supervisor status under a full queue{quick}, {mach['date']}\n"
        f"{mach['platform']}, {mach['cpu_count']} CPUs ({mach['cpu']}), python {mach['python']}, "
        f"mlx {mach['mlx']} on {mach['mlx_device']}\n"
        f"{MODEL}, {bound}, {s['clients']} clients x {s['max_tokens']} tokens, "
        f"busy pause {s['busy_pause_s'] * 1000:.0f} ms"
        f"{' +-50%' if s['busy_jitter'] else ' (no jitter)'}; {s['rounds']} load phase(s), "
        f"{s['samples']} status round trips per phase, {s['interval_s'] * 1000:.0f} ms apart"
    )
    status_rows = [
        ("status p50", ms(idle["p50"], ".2f"), ms(load["p50"], ".2f"),
         ratio(load["p50"], idle["p50"]), ""),
        ("status p99", ms(idle["p99"], ".2f"), ms(load["p99"], ".2f"),
         ratio(load["p99"], idle["p99"]), "< 10 ms under load"),
        ("status max", ms(idle["max"], ".2f"), ms(load["max"], ".2f"),
         ratio(load["max"], idle["max"]), ""),
        ("samples", str(idle["n"]), str(load["n"]), "", ""),
    ]  # fmt: skip
    share = r["queue_full_share"]
    depth = f"median {r['queue_depth_median']}" + (
        "" if share is None else f", at {s['max_queue'] or s['clients'] - 1} in {share:.0%}"
    )
    request_rows = [
        ("requests started", str(q["started"]), ""),
        ("completed (expected tokens)",
         f"{q['completed']} ({q['completed_after_waiting']} after waiting in the queue)",
         f"call -> done p50 {ms(q['completed_s']['p50'], '.2f')}, "
         f"p99 {ms(q['completed_s']['p99'], '.2f')}"),
        ("refused busy", f"{q['refused_busy']} ({q['refused_busy_per_s'] or 0:.0f}/s)",
         f"call -> error p50 {ms(q['refused_s']['p50'], '.2f')}, "
         f"p99 {ms(q['refused_s']['p99'], '.2f')}; "
         f"daemon counted {q['daemon_refused_busy']}"),
        ("failed with a cause", str(q["failed_with_cause"]),
         ", ".join(f"{k} {v}" for k, v in sorted(q["failed_by_code"].items()))),
        ("hung (client timeout) / threads stuck", f"{q['hung']} / {q['threads_stuck']}", ""),
        ("wrong token count / crashed", f"{q['wrong_tokens']} / {q['crashed']}", ""),
        ("lost (started - every outcome)", str(q["lost"]), ""),
        ("queue depth seen by status under load", depth, ""),
        ("daemon log lines/s under load", f"{r['daemon_log_lines_per_s']:.0f}", ""),
        ("CPU cores busy under load", " ".join(
            f"{k} {v:.2f}" for k, v in r["cpu_cores_busy_under_load"].items()),
         f"of {mach['cpu_count']} CPUs; load average {mach['loadavg_start'][0]:.2f} at start"),
    ]  # fmt: skip
    check_rows = [(name, verdict(ok)) for name, ok in checks(r).items()]
    footer = (
        f"ran {r['duration_s']:.0f} s; load average {mach['loadavg_start'][0]:.2f} at start, "
        f"{mach['loadavg_end'][0]:.2f} at end"
    )
    return "\n\n".join([
        title,
        render_table(("figure", "idle (anchor)", "under load", "load / idle", "target"),
                     status_rows),
        render_table(("requests under load", "count", "detail"), request_rows),
        render_table(("check", "result"), check_rows),
        footer,
    ])  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="one load phase, few samples (~30 s)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    parser.add_argument(
        "--no-queue-bound", action="store_true",
        help="leave max_queue out of the config (for daemons without the key)",
    )  # fmt: skip
    parser.add_argument("--clients", type=int, help="streaming client threads (64)")
    parser.add_argument("--max-tokens", type=int, help="tokens per request (32)")
    parser.add_argument("--samples", type=int, help="status round trips per phase")
    parser.add_argument("--rounds", type=int, help="load phases")
    parser.add_argument("--busy-pause-ms", type=float, help="a refused client's mean pause (50)")
    parser.add_argument(
        "--no-jitter", action="store_true",
        help="every refused client pauses exactly --busy-pause-ms (they retry in step)",
    )  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(settings_from_args(args))
    write_json(results, args.out)
    print(table(results))
    print(f"\nresults: {args.out}")
    integrity = [ok for name, ok in checks(results).items() if not name.startswith("status p99")]
    return 0 if all(integrity) else 1


if __name__ == "__main__":
    sys.exit(main())

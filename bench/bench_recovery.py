"""How fast the supervisor notices a death, recovers, and kills a hung runner.

Usage::

    python bench/bench_recovery.py [--model builtin:small] [--rounds 20] [--quick]
                                   [--out bench/results/recovery.json]

Figures, each measured side by side in this one run:

1. Death detection latency: SIGKILL a ready runner, time until the daemon logs
   ``runner_exited`` (and, separately, until a client streaming from it gets
   its error). p50 / p99. Target p99 < 50 ms (exo polls every 5 s).
2. Kill -> ready again (the daemon's ``model_ready``) / a plain load of the
   same model through the daemon, with the hot spare and without it.
   Targets: <= 1.1 without the spare; below 1 with it.
3. Load through the hot spare / load without it (interleaved daemons).
4. Hang -> killed, and hang -> restarted and ready: time beyond the configured
   stall timeout, for a busy-loop hang (SIGTERM works) and a hang in a C call
   with SIGTERM masked (needs SIGKILL after the grace). Target < 1 s.

Timestamps on the daemon side come from its own JSON log (UTC, microseconds),
compared with the wall clock at the moment of the kill.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS_DIR,
    Daemon,
    first_record,
    log_records,
    machine_info,
    runner_info,
    write_json,
)
from supervisor.daemon.logs import log_time
from supervisor.daemon.process import DaemonProcess
from supervisor.figures import median, percentiles, render_table

DEFAULT_OUT = RESULTS_DIR / "recovery.json"
STALL_S = 2.0


BARE_PROCESS = (
    "import sys\n"
    "block = bytearray(int(sys.argv[1]))\n"
    "block[::4096] = b'x' * len(block[::4096])  # touch every page\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n"
)


def bare_teardown_ms(rss_bytes: int) -> float:
    """SIGKILL -> reaped for a plain python process holding ``rss_bytes``: the
    kernel's own cost of tearing down that much memory, with no supervisor."""
    size = max(0, rss_bytes - 10 * 2**20)  # python itself is ~10 MB
    proc = subprocess.Popen(
        [sys.executable, "-c", BARE_PROCESS, str(size)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    proc.stdout.readline()
    started = time.perf_counter()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    elapsed = (time.perf_counter() - started) * 1000
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()
    return elapsed


def wait_event(daemon: DaemonProcess, event: str, after: float, **match: Any) -> float:
    """The log time of the first ``event`` (matching) logged after wall time ``after``."""
    return log_time(first_record(daemon, event, after=after, timeout_s=120, **match))


class Bench:
    def __init__(self, model: str, rounds: int, workdir: Path, stack: ExitStack) -> None:
        self.model = model
        self.rounds = rounds
        self.workdir = workdir
        self.stack = stack
        self.count = 0

    def daemon(self, config: str) -> Daemon:
        """A private daemon (see ``Daemon.start``); its client waits up to 300 s."""
        self.count += 1
        return Daemon.start(
            self.stack, self.workdir, f"d{self.count}", config, client_timeout_s=300
        )

    def detection(self) -> dict[str, Any]:
        """Figure 1 and 2: SIGKILL a runner; noticed when; ready again when."""
        results: dict[str, Any] = {}
        plain: dict[str, list[float]] = {"spare": [], "no_spare": []}
        for label, spare in (("spare", "true"), ("no_spare", "false")):
            d = self.daemon(f"hot_spare = {spare}\n")
            daemon, client = d.process, d.client
            detect_log, detect_client, recover, bare = [], [], [], []
            for i in range(self.rounds):
                if spare == "true":
                    d.settle()
                started = time.perf_counter()
                client.load(self.model, f"r{i}")
                plain[label].append(time.perf_counter() - started)
                if spare == "true":
                    d.settle()
                with client.generate(f"r{i}", "Hello", max_tokens=100_000) as gen:
                    next(gen)
                    info = runner_info(client, f"r{i}")
                    pid = info.pid
                    assert pid is not None and info.rss_bytes is not None
                    rss = info.rss_bytes
                    killed_at = time.time()
                    os.kill(pid, signal.SIGKILL)
                    try:
                        list(gen)
                    except Exception:
                        detect_client.append((time.time() - killed_at) * 1000)
                noticed = wait_event(daemon, "runner_exited", killed_at, runner_pid=pid)
                detect_log.append((noticed - killed_at) * 1000)
                ready = wait_event(daemon, "model_ready", killed_at, model=f"r{i}")
                recover.append(ready - killed_at)
                client.unload(f"r{i}")
                bare.append(bare_teardown_ms(rss))
            results[label] = {
                "bare_teardown_ms": bare,
                "detect_log_ms": detect_log,
                "detect_client_ms": detect_client,
                "kill_to_ready_s": recover,
                "plain_load_s": plain[label],
            }
            daemon.terminate()
        return results

    def hang(self) -> dict[str, Any]:
        """Figure 4: a decode hang, killed by the stall watchdog and restarted."""
        out: dict[str, Any] = {}
        for how in ("busy", "c"):
            fault = "hang_at_token=3" + (":c" if how == "c" else "")
            d = self.daemon(f"decode_stall_s = {STALL_S}\n")
            daemon, client = d.process, d.client
            killed_beyond, ready_beyond = [], []
            for i in range(max(3, self.rounds // 4)):
                once = self.workdir / f"once-{how}-{i}"
                name = f"h{i}"
                d.settle()
                client.load(self.model, name, env={"MLX_SUPERVISOR_FAULTS": f"{fault},once={once}"})
                started = time.time()
                with suppress(Exception):
                    client.generate_text(name, "Hello", max_tokens=50)
                (stall,) = log_records(daemon, "runner_stalled", model=name)
                last_progress = log_time(stall) - float(stall["since_progress_s"])
                exited = wait_event(daemon, "runner_exited", started, model=name)
                ready = wait_event(daemon, "model_ready", exited, model=name)
                killed_beyond.append(exited - last_progress - STALL_S)
                ready_beyond.append(ready - last_progress - STALL_S)
                client.unload(name)
            out[how] = {"killed_beyond_s": killed_beyond, "ready_beyond_s": ready_beyond}
            daemon.terminate()
        return out


def summary(values: list[float]) -> dict[str, float]:
    return {**percentiles(values, (50, 99)), "median": median(values), "n": len(values)}


def run(model: str, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="mlx-supervisor-bench-") as tmp, ExitStack() as stack:
        bench = Bench(model, rounds, Path(tmp), stack)
        detection = bench.detection()
        hang = bench.hang()
    spare, no_spare = detection["spare"], detection["no_spare"]
    plain_no_spare = median(no_spare["plain_load_s"])
    plain_spare = median(spare["plain_load_s"])
    return {
        "machine": machine_info("n/a (runners only)"),
        "model": model,
        "rounds": rounds,
        "stall_timeout_s": STALL_S,
        "detection_ms": summary(spare["detect_log_ms"] + no_spare["detect_log_ms"]),
        "detection_client_ms": summary(spare["detect_client_ms"] + no_spare["detect_client_ms"]),
        "bare_teardown_ms": summary(spare["bare_teardown_ms"] + no_spare["bare_teardown_ms"]),
        "detection_beyond_teardown_ms": summary(
            [
                d - b
                for side in (spare, no_spare)
                for d, b in zip(side["detect_log_ms"], side["bare_teardown_ms"], strict=True)
            ]
        ),
        "kill_to_ready_no_spare_ratio": median(no_spare["kill_to_ready_s"]) / plain_no_spare,
        "kill_to_ready_spare_ratio": median(spare["kill_to_ready_s"]) / plain_no_spare,
        "kill_to_ready_spare_vs_spare_load_ratio": median(spare["kill_to_ready_s"]) / plain_spare,
        "load_spare_ratio": plain_spare / plain_no_spare,
        "medians_s": {
            "plain_load_no_spare": plain_no_spare,
            "plain_load_spare": plain_spare,
            "kill_to_ready_no_spare": median(no_spare["kill_to_ready_s"]),
            "kill_to_ready_spare": median(spare["kill_to_ready_s"]),
        },
        "hang": {how: {k: summary(v) for k, v in d.items()} for how, d in hang.items()},
        "raw": {"detection": detection, "hang": hang},
    }


def table(r: dict[str, Any]) -> str:
    m = r["medians_s"]
    rows = [
        ("death detection, kill -> daemon notices (p50 / p99)",
         f"{r['detection_ms']['p50']:.1f} / {r['detection_ms']['p99']:.1f} ms", "p99 < 50 ms"),
        ("  the kernel alone: kill -> reaped, bare process of that RSS",
         f"{r['bare_teardown_ms']['p50']:.1f} / {r['bare_teardown_ms']['p99']:.1f} ms", ""),
        ("  the supervisor's part: detection - bare teardown (paired)",
         f"{r['detection_beyond_teardown_ms']['p50']:.1f} / "
         f"{r['detection_beyond_teardown_ms']['p99']:.1f} ms", ""),
        ("death detection, kill -> client gets the error (p50 / p99)",
         f"{r['detection_client_ms']['p50']:.1f} / {r['detection_client_ms']['p99']:.1f} ms", ""),
        ("kill -> ready / plain load (no spare)",
         f"{r['kill_to_ready_no_spare_ratio']:.2f} ({m['kill_to_ready_no_spare']:.2f}s / "
         f"{m['plain_load_no_spare']:.2f}s)", "<= 1.1"),
        ("kill -> ready with spare / plain load without",
         f"{r['kill_to_ready_spare_ratio']:.2f} ({m['kill_to_ready_spare']:.2f}s)", "< 1"),
        ("load through the hot spare / load without",
         f"{r['load_spare_ratio']:.2f} ({m['plain_load_spare']:.2f}s / "
         f"{m['plain_load_no_spare']:.2f}s)", ""),
    ]  # fmt: skip
    for how, label in (("busy", "busy loop"), ("c", "C call, SIGTERM masked")):
        h = r["hang"][how]
        rows.append((f"hang ({label}) -> killed, beyond the stall timeout (median)",
                     f"{h['killed_beyond_s']['median']:.2f} s", "< 1 s"))  # fmt: skip
        rows.append((f"hang ({label}) -> ready again, beyond the stall timeout (median)",
                     f"{h['ready_beyond_s']['median']:.2f} s", "< 1 s"))  # fmt: skip
    title = f"model {r['model']}, {r['rounds']} rounds, stall timeout {r['stall_timeout_s']} s"
    return f"{title}\n{render_table(None, rows)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="builtin:tiny, 5 rounds")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    model, rounds = ("builtin:tiny", 5) if args.quick else (args.model, args.rounds)
    results = run(model, rounds)
    print(table(results))
    write_json(results, args.out)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Crash-recovery soak: runners killed at random under load; nothing may hang,
leak or get lost.

Run it as a test (``tests/soak/test_soak.py``, 15 s of chaos, about 40 s in all) or alone:
``python tests/soak/soak_run.py --duration 600 [--out soak.json]``.

A private daemon serves several ``builtin:tiny`` models. Client threads stream
generations (some cancelled, some abandoned midway), a churn thread loads and
unloads a model, a chaos thread kills runners with random signals at random
moments (while loading, prefilling, decoding or idle) or freezes them with
SIGSTOP (left stopped: the daemon must notice the silence, kill and reap the
runner and restart its model), and one model hangs at random (a blocking C
call with SIGTERM masked) for the stall watchdog to find. Every client request
is timed: none may wait more than 30 s beyond its own generation time. At the
end the invariants are checked and printed as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from supervisor.client import Client, ClientError
from supervisor.daemon.logs import log_time
from supervisor.daemon.process import DaemonProcess
from supervisor.figures import percentile, render_table
from supervisor.system import process_rss

MODELS = ["m0", "m1", "m2"]
HANGY = "hangy"
CHURN = "churn"
CLIENTS = 4
REQUEST_TIMEOUT_S = 60.0
FREEZE = "SIGSTOP"  # the runner is left stopped: only the daemon's liveness pings find it
SIGNALS = ["SIGKILL", "SIGSEGV", "SIGABRT", "SIGTERM", "SIGBUS", FREEZE]
# Signals that end a process on delivery: kill -> noticed is the detection latency.
# (SIGTERM waits for the runner's handler, which a busy C call delays.)
IMMEDIATE = {"SIGKILL", "SIGSEGV", "SIGABRT", "SIGBUS"}
# Errors that name a cause: anything else (timeouts, protocol errors) is a failure.
CAUSED_ERRORS = {"runner_died", "not_ready", "unknown_model", "already_loaded", "load_failed"}
# A request may wait (queue, load, restart, a frozen runner found and killed) this
# long in all, besides the time its tokens took to stream.
WAIT_BOUND_S = 30.0
# The monitor samples the daemon's fds, RSS and zombie children this often: enough
# samples for the RSS check in a short run too (the test's, 15 s: 30 samples).
SAMPLE_S = 0.5
RSS_WINDOW_S = 5.0  # the stretch of samples whose median RSS is compared
ZOMBIE_BOUND_S = 1.0  # a child dead and unreaped this long was never reaped

CONFIG = """
restart_backoff_s = 0.2
restart_backoff_cap_s = 2.0
max_restarts = 20
restart_window_s = 60.0
decode_stall_s = 2.0
prefill_stall_s = 5.0
ping_timeout_s = 3.0
stall_kill_grace_s = 0.5
queue_timeout_s = 30.0
shutdown_grace_s = 2.0
term_grace_s = 1.0
"""


@dataclass
class Kill:
    at: float  # wall clock, to compare with the daemon's log timestamps
    pid: int
    model: str
    state: str
    signal: str


@dataclass
class RequestTiming:
    """One client request, timed on the client's monotonic clock.

    ``kind`` is ``generate``, ``load`` or ``unload``; ``outcome`` is
    ``completed``, ``cancelled``, ``abandoned`` or the error code.
    """

    kind: str
    model: str
    started: float
    first_token: float | None = None
    last_token: float | None = None
    ended: float | None = None
    tokens: int = 0
    outcome: str = ""

    def token(self, tokens: int) -> None:
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
        self.last_token = now
        self.tokens = tokens

    @property
    def generation_s(self) -> float:
        """First token to the end; for a request that did not complete, to the
        last token it streamed (what came after that was waiting)."""
        if self.first_token is None or self.last_token is None:
            return 0.0
        end = self.ended if self.outcome == "completed" and self.ended else self.last_token
        return end - self.first_token

    def waited_s(self, now: float | None = None) -> float:
        """Time not spent generating: all of it minus ``generation_s``."""
        end = self.ended if self.ended is not None else (now or time.monotonic())
        return end - self.started - self.generation_s

    def describe(self, since: float) -> str:
        ttft = "-" if self.first_token is None else f"{self.first_token - self.started:.1f} s"
        ended = "still waiting" if self.ended is None else self.outcome
        return (
            f"{self.kind} {self.model} at {self.started - since:.1f} s: {ended}, "
            f"waited {self.waited_s():.1f} s (ttft {ttft}, {self.tokens} tokens "
            f"in {self.generation_s:.1f} s)"
        )


@dataclass
class SoakResult:
    duration_s: float
    requests: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    bad_errors: list[str] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    detection_ms: list[float] = field(default_factory=list)
    recovery_ms: list[float] = field(default_factory=list)
    freeze_killed_ms: list[float] = field(default_factory=list)  # SIGSTOP -> runner_exited
    freeze_ready_ms: list[float] = field(default_factory=list)  # SIGSTOP -> model_ready
    timings: list[RequestTiming] = field(default_factory=list)
    invariants: dict[str, tuple[bool, str]] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # t, fds, rss
    lingering_zombies: set[int] = field(default_factory=set)  # unreaped for ZOMBIE_BOUND_S

    @property
    def passed(self) -> bool:
        return all(ok for ok, _ in self.invariants.values())


class Soak:
    def __init__(self, duration_s: float, seed: int, workdir: Path) -> None:
        self.duration_s = duration_s
        self.random = random.Random(seed)
        self.workdir = workdir
        self.result = SoakResult(duration_s)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.seen_pids: set[int] = set()
        self.daemon: DaemonProcess | None = None
        self.client: Client | None = None
        self.started = time.monotonic()
        self.in_flight: dict[int, RequestTiming] = {}  # by thread id

    # --- request timing --------------------------------------------------------

    def begin(self, kind: str, model: str) -> RequestTiming:
        timing = RequestTiming(kind, model, time.monotonic())
        with self.lock:
            self.in_flight[threading.get_ident()] = timing
        return timing

    def finish(self, timing: RequestTiming, outcome: str) -> None:
        timing.ended = time.monotonic()
        timing.outcome = outcome
        with self.lock:
            self.in_flight.pop(threading.get_ident(), None)
            self.result.timings.append(timing)

    def timed(self, kind: str, model: str, call: Callable[[RequestTiming], object]) -> None:
        """Make one request, timed; a ClientError is its outcome, and is re-raised."""
        timing = self.begin(kind, model)
        try:
            call(timing)
        except ClientError as exc:
            self.finish(timing, exc.code)
            raise
        self.finish(timing, "completed")

    # --- workers ---------------------------------------------------------------

    def client_loop(self, index: int) -> None:
        assert self.client is not None
        rng = random.Random(self.random.random())
        while not self.stop.is_set():
            name = rng.choice([*MODELS, HANGY, CHURN])
            mode = rng.choices(["full", "cancel", "abandon"], weights=[6, 2, 1])[0]
            timing = self.begin("generate", name)
            try:
                with self.client.generate(
                    name, f"client {index} says", max_tokens=rng.randint(5, 60)
                ) as gen:
                    for n, _ in enumerate(gen):
                        timing.token(gen.tokens)
                        if mode == "cancel" and n == 3:
                            gen.cancel()
                        if mode == "abandon" and n == 3:
                            break
                outcome = "abandoned" if mode == "abandon" and gen.done is None else "completed"
                if gen.done is not None and gen.done.finish_reason == "cancelled":
                    outcome = "cancelled"
                if gen.done is not None:
                    timing.tokens = gen.done.generation_tokens
                self.count_request(outcome)
            except ClientError as exc:
                outcome = exc.code
                self.count_error(exc)
            self.finish(timing, outcome)

    def churn_loop(self) -> None:
        assert self.client is not None
        client = self.client

        def stream(timing: RequestTiming) -> None:
            with client.generate(CHURN, "churn", max_tokens=10) as gen:
                for _ in gen:
                    timing.token(gen.tokens)

        while not self.stop.is_set():
            try:
                self.timed("load", CHURN, lambda _: client.load("builtin:tiny", CHURN))
                self.timed("generate", CHURN, stream)
                self.timed("unload", CHURN, lambda _: client.unload(CHURN))
                self.count_request("churn_cycle")
            except ClientError as exc:
                self.count_error(exc)
                if exc.code in ("already_loaded", "runner_died"):
                    try:
                        self.timed("unload", CHURN, lambda _: client.unload(CHURN))
                    except ClientError as again:
                        self.count_error(again)

    def chaos_loop(self) -> None:
        assert self.client is not None
        # A stopped process gets no signal but SIGKILL until it is killed: spare the
        # frozen ones, or their freeze would be measured as a slow kill -> noticed.
        frozen: set[int] = set()
        while not self.stop.wait(self.random.uniform(1.0, 2.5)):  # the chaos cadence
            try:
                status = self.client.status()
            except ClientError as exc:
                self.count_error(exc)
                continue
            targets: list[tuple[int, str, str]] = [
                (r.pid, r.name, r.state) for r in status.runners if r.pid
            ]
            if status.spare is not None and status.spare.pid:  # none while it restarts
                targets.append((status.spare.pid, "(spare)", "spare"))
            targets = [t for t in targets if t[0] not in frozen]
            if not targets:
                continue
            pid, name, state = self.random.choice(targets)
            signame = self.random.choice(SIGNALS)
            kill = Kill(time.time(), pid, name, state, signame)
            try:
                os.kill(pid, signal.Signals[signame])
            except ProcessLookupError:
                continue
            if signame == FREEZE:
                frozen.add(pid)
            with self.lock:
                self.result.kills.append(kill)

    def monitor_loop(self) -> None:
        assert self.daemon is not None and self.client is not None
        daemon = psutil.Process(self.daemon.pid)
        started = time.monotonic()
        zombie_since: dict[int, float] = {}  # pid -> first seen a zombie
        while not self.stop.wait(SAMPLE_S):
            try:
                children = daemon.children()
                zombies = set()
                for child in children:
                    try:
                        if child.status() == psutil.STATUS_ZOMBIE:
                            zombies.add(child.pid)
                    except psutil.NoSuchProcess:
                        pass
                rss = process_rss(daemon.pid)
                if rss is None:  # the daemon is gone
                    return
                now = time.monotonic()
                zombie_since = {pid: zombie_since.get(pid, now) for pid in zombies}
                with self.lock:
                    self.seen_pids.update(c.pid for c in children)
                    # A zombie for an instant is a death not yet reaped; one that is
                    # still there ZOMBIE_BOUND_S later was never reaped.
                    self.result.lingering_zombies |= {
                        pid for pid, since in zombie_since.items() if now - since >= ZOMBIE_BOUND_S
                    }
                    self.result.samples.append((now - started, daemon.num_fds(), rss))
            except psutil.NoSuchProcess:
                return

    def count_request(self, outcome: str) -> None:
        with self.lock:
            self.result.requests[outcome] += 1

    def count_error(self, exc: ClientError) -> None:
        with self.lock:
            self.result.errors[exc.code] += 1
            if exc.code not in CAUSED_ERRORS or not exc.message:
                self.result.bad_errors.append(f"{exc.code}: {exc.message}")

    # --- the run -----------------------------------------------------------------

    def run(self) -> SoakResult:
        config = self.workdir / "soak.toml"
        config.write_text(CONFIG)
        env = {"XDG_STATE_HOME": str(self.workdir / "state"), "MLX_SUPERVISOR_HTTP": "off"}
        # The whole log goes to a file: log_lines keeps only the last lines.
        self.log_path = self.workdir / "daemon.log"
        daemon = DaemonProcess(
            self.workdir / "soak.sock", config, env=env, log_file=self.log_path
        ).start()
        self.daemon = daemon
        self.client = Client(daemon.socket_path, timeout_s=REQUEST_TIMEOUT_S)
        inv = self.result.invariants
        try:
            for name in MODELS:
                self.client.load("builtin:tiny", name)
            self.client.load(
                "builtin:tiny", HANGY, env={"MLX_SUPERVISOR_FAULTS": "hang_random=0.003:c"}
            )
            self.quiet_fds_before = self.quiet_fds()
            workers = [threading.Thread(target=self.client_loop, args=(i,)) for i in range(CLIENTS)]
            workers += [
                threading.Thread(target=self.churn_loop),
                threading.Thread(target=self.chaos_loop),
                threading.Thread(target=self.monitor_loop),
            ]
            self.started = time.monotonic()
            for worker in workers:
                worker.start()
            self.stop.wait(self.duration_s)  # the soak's length
            self.stop.set()
            deadline = time.monotonic() + REQUEST_TIMEOUT_S + 10
            for worker in workers:
                worker.join(max(0.1, deadline - time.monotonic()))
            hung = [w.name for w in workers if w.is_alive()]
            inv["every request ended"] = (
                not hung,
                f"threads still waiting: {hung}" if hung else "",
            )
            self.check_wait_bound(inv)
            inv["errors all name a cause"] = (
                not self.result.bad_errors,
                "; ".join(self.result.bad_errors[:3]),
            )
            inv["supervisor alive throughout"] = (daemon.process.poll() is None, "")  # type: ignore[union-attr]
            self.check_recovered(inv)
            self.result.counters = self.client.status().counters
            self.measure_latencies(inv)
            self.check_growth(inv)
            lingering = sorted(self.result.lingering_zombies)
            inv[f"zero zombies (none left unreaped for {ZOMBIE_BOUND_S:g} s)"] = (
                not lingering,
                f"pids: {lingering}" if lingering else "",
            )
        finally:
            ack_ok = False
            try:
                self.client.shutdown()
                ack_ok = daemon.wait(60) == 0
            except (ClientError, Exception):
                daemon.kill()
            inv["clean shutdown (exit 0)"] = (ack_ok, "")
            alive = [pid for pid in self.seen_pids if psutil.pid_exists(pid)
                     and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]  # fmt: skip
            inv["zero processes left after shutdown"] = (
                not alive,
                f"alive: {alive}" if alive else "",
            )
        return self.result

    def check_recovered(self, inv: dict[str, tuple[bool, str]]) -> None:
        """After the chaos stops, every model gets back to ready (or is failed
        with its restart budget truly spent)."""
        assert self.client is not None and self.daemon is not None
        client = self.client

        def settled() -> bool:
            runners = client.status().runners
            return all(r.state == "ready" or (r.state == "failed" and r.failure) for r in runners
                       if r.name != CHURN)  # fmt: skip

        try:
            self.daemon.wait_until(settled, timeout_s=60)
            ok, detail = True, ""
        except TimeoutError:
            ok, detail = False, "not settled within 60 s"
        states = {r.name: r.state for r in client.status().runners}
        failed = [n for n, s in states.items() if s == "failed"]
        inv["every runner back to ready (or failed: budget spent)"] = (
            ok,
            detail or (f"failed: {failed}" if failed else "all ready"),
        )

    def check_wait_bound(self, inv: dict[str, tuple[bool, str]]) -> None:
        """Every request ended within WAIT_BOUND_S plus its own generation time
        (a request still in flight counts with the time it has waited so far)."""
        now = time.monotonic()
        with self.lock:
            timings = [*self.result.timings, *self.in_flight.values()]
        late = sorted(
            (t for t in timings if t.waited_s(now) > WAIT_BOUND_S), key=lambda t: -t.waited_s(now)
        )
        waits = [t.waited_s(now) for t in timings]
        detail = (
            f"{len(timings)} requests, waited p50 {percentile(waits, 50):.2f} s, "
            f"p99 {percentile(waits, 99):.2f} s, max {max(waits, default=0):.1f} s"
        )
        if late:
            shown = "; ".join(t.describe(self.started) for t in late[:3])
            detail += f"; {len(late)} over {WAIT_BOUND_S:g} s: {shown}"
        inv[f"every request ended within {WAIT_BOUND_S:g} s + its generation time"] = (
            not late,
            detail,
        )

    def measure_latencies(self, inv: dict[str, tuple[bool, str]]) -> None:
        """Kill -> noticed (the daemon's runner_exited) and kill -> ready again;
        for a frozen runner, freeze -> killed and freeze -> ready, and whether
        every frozen runner was killed at all."""
        assert self.daemon is not None
        exited: dict[object, float] = {}
        ready: dict[str, list[float]] = {}
        for line in self.log_path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == "runner_exited":
                exited.setdefault(record.get("runner_pid"), log_time(record))
            elif record.get("event") == "model_ready":
                ready.setdefault(str(record.get("model")), []).append(log_time(record))
        never_killed = []
        for kill in self.result.kills:
            noticed = exited.get(kill.pid)
            if kill.signal in IMMEDIATE and noticed is not None and noticed >= kill.at - 0.01:
                self.result.detection_ms.append(max(0.0, (noticed - kill.at) * 1000))
            if kill.signal == FREEZE:
                if noticed is None:
                    never_killed.append(kill.pid)
                elif noticed >= kill.at - 0.01:
                    self.result.freeze_killed_ms.append(max(0.0, (noticed - kill.at) * 1000))
            if kill.model in MODELS or kill.model == HANGY:
                after = [t for t in ready.get(kill.model, []) if t > kill.at]
                if after:
                    res = self.result
                    figure = res.freeze_ready_ms if kill.signal == FREEZE else res.recovery_ms
                    figure.append((after[0] - kill.at) * 1000)
        frozen = sum(1 for k in self.result.kills if k.signal == FREEZE)
        killed = self.result.freeze_killed_ms
        inv["every frozen runner (SIGSTOP) killed and reaped"] = (
            not never_killed,
            f"pids never exited: {never_killed}"
            if never_killed
            else f"{frozen} frozen, freeze->killed max {max(killed, default=0) / 1000:.1f} s",
        )

    def quiet_fds(self) -> int:
        """The daemon's open fds in a quiet state: the soak's models ready, the
        churn model unloaded, a warm spare, no client connected. Each runner
        holds 4 fds and each connection 1, so only quiet states compare."""
        assert self.client is not None and self.daemon is not None
        client = self.client
        if any(r.name == CHURN for r in client.status().runners):
            client.unload(CHURN)

        def quiet() -> bool:
            status = client.status()
            return (status.spare is not None and status.spare.warm
                    and all(r.state in ("ready", "failed") for r in status.runners))  # fmt: skip

        self.daemon.wait_until(quiet, timeout_s=60)
        # The last status connection may still be closing on the daemon's side
        # (seen: one socket fd, gone 50 ms later): the least of a few reads.
        daemon = psutil.Process(self.daemon.pid)
        counts = []
        for _ in range(10):
            counts.append(int(daemon.num_fds()))
            time.sleep(0.05)
        return min(counts)

    def check_growth(self, inv: dict[str, tuple[bool, str]]) -> None:
        """fds: quiet state before the chaos == quiet state after. RSS: the
        median of the last samples within 5% of the samples after warm-up."""
        fds_before, fds_after = self.quiet_fds_before, self.quiet_fds()
        samples = self.result.samples
        if len(samples) < 6:
            inv["fd count and RSS flat after warm-up"] = (fds_after <= fds_before, "short run")
            return
        # Windows of about RSS_WINDOW_S each (at least 5 samples; a quarter of a short run).
        window = max(5, min(round(RSS_WINDOW_S / SAMPLE_S), len(samples) // 4))
        warm = samples[len(samples) // 4 : len(samples) // 4 + window]
        rss_before = statistics.median(s[2] for s in warm)
        rss_after = statistics.median(s[2] for s in samples[-window:])
        ok = fds_after <= fds_before and rss_after <= rss_before * 1.05
        detail = (f"quiet fds {fds_before} -> {fds_after}, "
                  f"rss {rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB")  # fmt: skip
        inv["fd count and RSS flat after warm-up"] = (ok, detail)


def tally(counts: Counter[str] | dict[str, int]) -> str:
    return ", ".join(f"{key} {value}" for key, value in sorted(counts.items()))


def report(result: SoakResult) -> str:
    """The invariants and figures as markdown tables (p50, p99: ``percentile``, linear)."""
    invariants = [
        (name, "PASS" if ok else "FAIL", detail) for name, (ok, detail) in result.invariants.items()
    ]
    det, rec = result.detection_ms, result.recovery_ms
    fk, fr = result.freeze_killed_ms, result.freeze_ready_ms
    waits = [t.waited_s() for t in result.timings]
    counters = result.counters
    counts = [
        ("kills", f"{len(result.kills)} ({tally(Counter(k.signal for k in result.kills))})"),
        ("kills by runner state", tally(Counter(k.state for k in result.kills))),
        ("restarts", f"{counters.get('restarts', 0)}"),
        ("retried requests", f"{counters.get('requests_retried', 0)}"),
        ("models failed (budget spent)", f"{counters.get('failed', 0)}"),
        ("requests", tally(result.requests)),
        ("errors (all naming a cause)", tally(result.errors)),
        (f"detection kill->noticed ({'/'.join(sorted(IMMEDIATE))})",
         f"p50 {percentile(det, 50):.1f} ms, p99 {percentile(det, 99):.1f} ms (n={len(det)})"),
        (f"recovery kill->ready (all but {FREEZE})",
         f"p50 {percentile(rec, 50):.0f} ms, p99 {percentile(rec, 99):.0f} ms (n={len(rec)})"),
        (f"freeze ({FREEZE}) -> killed",
         f"p50 {percentile(fk, 50):.0f} ms, p99 {percentile(fk, 99):.0f} ms (n={len(fk)})"),
        (f"freeze ({FREEZE}) -> ready",
         f"p50 {percentile(fr, 50):.0f} ms, p99 {percentile(fr, 99):.0f} ms (n={len(fr)})"),
        ("request wait (all minus generation time)",
         f"p50 {percentile(waits, 50) * 1000:.0f} ms, p99 {percentile(waits, 99) * 1000:.0f} ms, "
         f"max {max(waits, default=0) * 1000:.0f} ms (n={len(waits)}, bound {WAIT_BOUND_S:g} s)"),
    ]  # fmt: skip
    return "\n".join([
        f"soak: {result.duration_s:.0f} s",
        "",
        render_table(("invariant", "result", "detail"), invariants, markdown=True),
        "",
        render_table(("count", "value"), counts, markdown=True),
    ])  # fmt: skip


def to_json(result: SoakResult) -> dict[str, Any]:
    waits = [t.waited_s() for t in result.timings]
    return {
        "duration_s": result.duration_s,
        "passed": result.passed,
        "invariants": {k: {"ok": ok, "detail": d} for k, (ok, d) in result.invariants.items()},
        "kills": len(result.kills),
        "kills_by_signal": dict(Counter(k.signal for k in result.kills)),
        "kills_by_state": dict(Counter(k.state for k in result.kills)),
        "counters": result.counters,
        "requests": dict(result.requests),
        "errors": dict(result.errors),
        "detection_ms": summary(result.detection_ms),
        "recovery_ms": summary(result.recovery_ms),
        "freeze_killed_ms": summary(result.freeze_killed_ms),
        "freeze_ready_ms": summary(result.freeze_ready_ms),
        "request_wait_s": {**summary(waits), "max": max(waits, default=0.0)},
        "requests_over_wait_bound": [
            asdict(t) | {"waited_s": t.waited_s(), "generation_s": t.generation_s}
            for t in result.timings
            if t.waited_s() > WAIT_BOUND_S
        ],
    }


def summary(values: list[float]) -> dict[str, float | int]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "n": len(values)}


def run_soak(duration_s: float, seed: int = 0) -> SoakResult:
    with tempfile.TemporaryDirectory(prefix="mlx-supervisor-soak-") as tmp:
        return Soak(duration_s, seed, Path(tmp)).run()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of chaos")
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    print(f"soak for {args.duration:.0f} s (seed {args.seed}) ...", flush=True)
    result = run_soak(args.duration, args.seed)
    print(report(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(to_json(result), indent=2))
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())

"""What the bench scripts share: a private daemon and its log, mlx_lm.server beside it,
the order of two sides, number formats, machine info and the results file.

Each ``bench_*.py`` is one family of figures; a helper two of them need lives here.
What the soak and fuzz runners print too lives in the package: percentiles and tables
in ``supervisor.figures``, a log line's time in ``supervisor.daemon.logs.log_time``,
RSS readers in ``supervisor.system``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import psutil

import supervisor
from ipc.messages import RunnerInfo
from supervisor.client import Client
from supervisor.config import SupervisorConfig
from supervisor.daemon.logs import log_time
from supervisor.daemon.process import DaemonProcess
from supervisor.runners.blas import AUTO, runner_blas_env
from supervisor.system import stop_process

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"

A = TypeVar("A")
B = TypeVar("B")
T = TypeVar("T")


def note(message: str) -> None:
    """Progress, on stderr (stdout is for the table)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- two sides, in turn ----------------------------------------------------------


def alternate(index: int, first: T, second: T) -> tuple[T, T]:
    """``(first, second)`` in even rounds, ``(second, first)`` in odd ones, so that neither
    side always goes first, or always follows the other (or a drift of the machine)."""
    return (first, second) if index % 2 == 0 else (second, first)


def run_alternating(index: int, run_a: Callable[[], A], run_b: Callable[[], B]) -> tuple[A, B]:
    """Run both sides one after the other, in the order ``alternate`` gives (``run_a``
    first in even rounds); the results always as ``(a, b)``."""
    if index % 2 == 0:
        a = run_a()
        return a, run_b()
    b = run_b()
    return run_a(), b


# --- a private daemon ------------------------------------------------------------


def spare_supported() -> bool:
    """Whether this daemon keeps a hot spare (a pre-started runner) by default."""
    return bool(getattr(SupervisorConfig(), "hot_spare", False))


@dataclass
class Daemon:
    """A private daemon started for this run, and what to wait for before measuring."""

    process: DaemonProcess
    client: Client
    keeps_spare: bool

    @classmethod
    def start(
        cls,
        stack: contextlib.ExitStack,
        tmp: Path,
        label: str,
        config: str,
        client_timeout_s: float | None = None,
        http: str = "off",
    ) -> Daemon:
        """Start ``mlx-supervisor serve`` with ``config`` (TOML text) on ``tmp/LABEL.sock``.

        An explicit config file, even an empty one, keeps a user's own config out, and
        the daemon's state, runtime and config dirs are its own (under ``tmp/LABEL``), so
        it neither reads a user's state nor leaves any behind; so is the prefix cache's
        disk tier (no run finds another's KV blocks). The builtin model cache stays
        shared. When ``stack`` closes: SIGTERM (graceful), else SIGKILL; if the run
        failed, the daemon's last log lines go to stderr.

        ``http`` is the HTTP front's address (``$MLX_SUPERVISOR_HTTP``): ``"off"`` by
        default (many daemons at once: no shared port), ``"127.0.0.1:0"`` for a free
        port, whose base URL ``client.status().supervisor.http`` then gives.

        Raises:
            DaemonStartError: the daemon exited or did not start.
        """
        config_path = tmp / f"{label}.toml"
        config_path.write_text(config, encoding="utf-8")
        home = tmp / label
        home.mkdir(mode=0o700)
        env = {"MLX_SUPERVISOR_HTTP": http}
        for variable, name in [("XDG_STATE_HOME", "state"), ("XDG_RUNTIME_DIR", "run"),
                               ("XDG_CONFIG_HOME", "config"),
                               ("MLX_SUPERVISOR_KV_CACHE_DIR", "kv")]:  # fmt: skip
            (home / name).mkdir(mode=0o700)
            env[variable] = str(home / name)
        # No log file: its writes would be one more thing running in this (client) process.
        process = DaemonProcess(tmp / f"{label}.sock", config_path, env=env)
        stack.enter_context(process)

        def show_log_on_error(exc_type: type[BaseException] | None, *_: object) -> bool:
            if exc_type is not None:
                tail = "\n".join(list(process.log_lines)[-20:])
                note(f"the {label} daemon's last log lines:\n{tail}")
            return False

        stack.push(show_log_on_error)
        keeps_spare = spare_supported() and "hot_spare = false" not in config
        client = Client(process.socket_path, timeout_s=client_timeout_s)
        return cls(process, client, keeps_spare)

    def settle(self, timeout_s: float = 120.0) -> float:
        """Wait until no runner is starting or loading and the hot spare (if the daemon
        keeps one) has finished importing mlx, so that nothing of the daemon's runs
        during the next measurement. Returns how long it took.

        The client has no event to wait on, so this reads ``status`` every 20 ms.

        Raises:
            RuntimeError: not settled within ``timeout_s``.
        """
        started = time.perf_counter()
        while True:
            status = self.client.status()
            spare = getattr(status, "spare", None)
            spare_ok = not self.keeps_spare or (spare is not None and spare.warm)
            if spare_ok and all(r.state == "ready" for r in status.runners):
                return time.perf_counter() - started
            if time.perf_counter() - started > timeout_s:
                raise RuntimeError(f"daemon not settled after {timeout_s} s: {status}")
            time.sleep(0.02)

    def shutdown(self) -> dict[str, Any]:
        """Ask the daemon to shut down; its exit code and the runners it stopped."""
        ack = self.client.shutdown()
        return {"code": self.process.wait(), "runners_at_shutdown": ack.runners}


def runner_info(client: Client, name: str) -> RunnerInfo:
    """``status`` of the runner serving ``name``.

    Raises:
        StopIteration: no runner serves ``name``.
    """
    return next(r for r in client.status().runners if r.name == name)


# --- mlx_lm.server, the reference server ----------------------------------------

SERVER_START_TIMEOUT_S = 300.0


def free_port() -> int:
    """A TCP port on loopback that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def mlx_lm_server(
    model_dir: Path,
    log_path: Path,
    env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
) -> Iterator[int]:
    """``python -m mlx_lm.server --model DIR`` on a free loopback port, with its
    defaults but ``args`` (``env`` added to its environment); yields the port once
    ``/health`` answers; SIGTERM (then SIGKILL) at exit."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "mlx_lm.server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        )
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"mlx_lm.server exited with {process.returncode}:\n{tail}")
            with contextlib.suppress(OSError):
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                try:
                    connection.request("GET", "/health")
                    if connection.getresponse().status == 200:
                        break
                finally:
                    connection.close()
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlx_lm.server not up after {SERVER_START_TIMEOUT_S} s")
            time.sleep(0.1)
        yield port
    finally:
        stop_process(process, term_wait_s=15)


# --- the daemon's log (a record's time: supervisor.daemon.logs.log_time) ----------


def log_records(daemon: DaemonProcess, event: str, **match: Any) -> list[dict[str, Any]]:
    """The daemon's ``event`` records so far whose fields equal ``match``, oldest first."""
    return [dict(r) for r in daemon.events(event) if all(r.get(k) == v for k, v in match.items())]


def first_record(
    daemon: DaemonProcess,
    event: str,
    *,
    after: float | None = None,
    timeout_s: float = 60.0,
    **match: Any,
) -> dict[str, Any]:
    """The first ``event`` record matching ``match`` (and logged at or after wall time
    ``after``), waiting for it to be logged.

    Raises:
        TimeoutError: none within ``timeout_s``.
    """
    found: list[dict[str, Any]] = []

    def seen() -> bool:
        found[:] = [
            r for r in log_records(daemon, event, **match) if after is None or log_time(r) >= after
        ]
        return bool(found)

    daemon.wait_until(seen, timeout_s=timeout_s)
    return found[0]


# --- processes -------------------------------------------------------------------


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def cpu_s_each(pids: dict[str, int | None]) -> dict[str, float]:
    """``cpu_s`` of each named process; one that is None or gone is left out."""
    seconds = {}
    for label, pid in pids.items():
        if pid is not None:
            with contextlib.suppress(psutil.Error):
                seconds[label] = cpu_s(pid)
    return seconds


def children_left() -> list[int]:
    """Our child processes still alive, but multiprocessing's resource tracker
    (it lives as long as this process)."""
    left = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "resource_tracker" not in " ".join(child.cmdline()):
                left.append(child.pid)
    return left


# --- numbers (tables: supervisor.figures.render_table) ----------------------------


def fmt(value: float | None, spec: str, scale: float = 1.0, unit: str = "") -> str:
    """``value * scale`` formatted with ``spec``, then ``unit``; ``-`` for None."""
    return "-" if value is None else f"{value * scale:{spec}}{unit}"


def ms(value: float | None, spec: str = ".3f") -> str:
    """Seconds shown in milliseconds."""
    return fmt(value, spec, 1000, " ms")


def signed_ms(value: float | None) -> str:
    """A difference in seconds, shown in milliseconds with its sign."""
    return ms(value, "+.3f")


def cpu_time(value: float | None) -> str:
    """CPU seconds: in microseconds, or milliseconds from 10 ms up."""
    if value is not None and value >= 0.01:
        return fmt(value, ".1f", 1e3, " ms")
    return fmt(value, ".0f", 1e6, " us")


def mib(value: float | None) -> str:
    """Bytes shown in MiB."""
    return fmt(value, ".0f", 1 / 2**20, " MiB")


def quotient(a: float | None, b: float | None) -> float | None:
    """``a / b``; None when either is missing (or ``b`` is zero)."""
    return None if a is None or not b else a / b


def ratio(measured: float | None, anchor: float | None) -> str:
    """``measured / anchor`` as ``1.23x``; ``-`` when either is missing (or zero)."""
    return "-" if measured is None or not anchor else f"{measured / anchor:.2f}x"


def verdict(ok: bool | None) -> str:
    """The target column: PASS, FAIL, or ``-`` where nothing was checked."""
    return "-" if ok is None else ("PASS" if ok else "FAIL")


# --- machine info and the results file -------------------------------------------


def mlx_device() -> str:
    """``mx.default_device()`` as a fresh python process sees it (the runners' device),
    without importing mlx into the bench process itself."""
    done = subprocess.run(
        [sys.executable, "-c", "import mlx.core as mx; print(mx.default_device())"],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    return done.stdout.strip() or f"unknown (exit {done.returncode})"


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def git_state() -> dict[str, Any]:
    """This tree's commit, how many files under src/ differ from it, and where the
    ``supervisor`` package was imported from (PYTHONPATH can point elsewhere)."""

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=BENCH_DIR.parent, capture_output=True, text=True, check=False
        )
        return done.stdout.strip()

    dirty = git("status", "--porcelain", "--", "src")
    return {
        "commit": git("rev-parse", "HEAD"),
        "src_dirty_files": len(dirty.splitlines()),
        "supervisor_package": str(Path(supervisor.__file__).parent),
    }


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return list(os.getloadavg())


def machine_info(device: str) -> dict[str, Any]:
    """Platform, CPU, memory, python, mlx and mlx-lm versions, the mlx ``device``, the
    date and load average (now) and the git state. Results add ``loadavg_end``."""
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_total_bytes": int(psutil.virtual_memory().total),
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "mlx": metadata.version("mlx"),
        "mlx_lm": metadata.version("mlx-lm"),
        "mlx_device": device,
        # What a runner under the default cpu_blas = "auto" preloads (None: mlx's own).
        "runner_ld_preload": runner_blas_env(AUTO).get("LD_PRELOAD"),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "loadavg_start": load_average(),
        "git": git_state(),
    }


def write_json(results: dict[str, Any], out: Path) -> None:
    """Write ``results`` to ``out`` (indented), atomically: a temp file, then a rename."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
    os.replace(tmp, out)


# --- plain mlx-lm in a process of its own (bench/inproc_worker.py) ------------

WORKER_SCRIPT = BENCH_DIR / "inproc_worker.py"


class Worker:
    """A ``bench/inproc_worker.py`` child; one JSON request/reply per line."""

    def __init__(self, log_path: Path, cpu_blas: str = AUTO) -> None:
        self._log = log_path.open("a", encoding="utf-8")
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            encoding="utf-8",
            # The BLAS a daemon's runner computes with under the same cpu_blas (the
            # benches' daemons keep the default): both sides multiply alike.
            env={**os.environ, **runner_blas_env(cpu_blas)},
        )
        self.log_path = log_path
        self.hello = self._read()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            tail = self.log_path.read_text(encoding="utf-8", errors="replace")[-2000:]
            raise RuntimeError(f"in-process worker exited with {code}:\n{tail}")
        message: dict[str, Any] = json.loads(line)
        if not message.get("ok"):
            raise RuntimeError(f"in-process worker: {message.get('error')}")
        return message

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        """Ask it to exit and reap it (SIGKILL if it does not go within 10 s)."""
        try:
            if self.process.poll() is None:
                with contextlib.suppress(OSError, RuntimeError, ValueError):
                    self.request("exit")
            stop_process(self.process, join_s=10, term_wait_s=None)
        finally:
            for stream in (self.process.stdin, self.process.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
            self._log.close()


@contextlib.contextmanager
def worker(log_path: Path) -> Iterator[Worker]:
    w = Worker(log_path)
    try:
        yield w
    finally:
        w.close()


# --- one generation on each side ---------------------------------------------


def inproc_generate(w: Worker, key: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    r = w.request("generate", key=key, prompt=prompt, max_tokens=max_tokens)
    return {
        "ttft_s": r["first_s"],
        "stream_s": r["end_s"] - r["first_s"],
        "frames": r["frames"],
        "generation_tokens": r["generation_tokens"],
        "reported_tps": r["generation_tps"],
        "finish_reason": r["finish_reason"],
        "text": r["text"],
        "sync_s": r["sync_s"],
    }


def daemon_generate(client: Client, name: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """Stream one greedy generation through the daemon, timed by the client.

    ``ttft_s`` is Generation.ttft_s (request sent -> first TextChunk);
    ``e2e_ttft_s`` also counts the connect and handshake inside Client.generate.
    """
    pieces: list[str] = []
    first: float | None = None
    started = time.perf_counter()
    with client.generate(name, prompt, max_tokens=max_tokens, temperature=0.0, top_p=1.0) as gen:
        for text in gen:
            if first is None:
                first = time.perf_counter()
            pieces.append(text)
    end = time.perf_counter()
    done = gen.done
    if done is None or first is None or gen.ttft_s is None:
        raise RuntimeError("the daemon's generation ended without text or stats")
    return {
        "ttft_s": gen.ttft_s,
        "e2e_ttft_s": first - started,
        "runner_ttft_s": done.ttft_s,
        "stream_s": end - first,
        "frames": len(pieces),
        "generation_tokens": done.generation_tokens,
        "reported_tps": done.generation_tps,
        "finish_reason": done.finish_reason,
        "text": "".join(pieces),
    }


def mapped_blas(pid: int) -> str | None:
    """The BLAS a process computes with (an OpenBLAS preloaded over mlx-cpu's
    bundled reference BLAS wins), from its memory map; None if none is mapped."""
    try:
        paths = {m.path for m in psutil.Process(pid).memory_maps()}
    except (psutil.Error, OSError):
        return None
    names = [p for p in paths if os.path.basename(p).startswith(("libblas", "libopenblas"))]
    return min(names, key=lambda path: "openblas" not in path, default=None)

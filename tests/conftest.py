"""Fixtures: private daemons on temp sockets, and checks that nothing leaks."""

from __future__ import annotations

import contextlib
import os
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from ipc.messages import FAULTS_ENV, RunnerInfo
from modelfiles.builtin import builtin_cache_dir
from runner.builtin import ensure_builtin_model
from supervisor.client import Client
from supervisor.config import HTTP_ENV, KV_CACHE_DIR_ENV
from supervisor.daemon.process import DaemonProcess
from supervisor.runners.blas import BUNDLED, CPU_BLAS_ENV
from supervisor.system import stop_process

REAP_TIMEOUT_S = 5.0
# Read at import, before the fixtures point XDG_CACHE_HOME at the session's temporary cache:
# builtin:smollm2 is fetched (93 MB) and converted once per machine, not once per test run.
USER_BUILTIN_CACHE = builtin_cache_dir()


@pytest.fixture(scope="session")
def builtin_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One XDG cache for the session, so builtin models are made once."""
    return tmp_path_factory.mktemp("xdg-cache")


@pytest.fixture(scope="session")
def smollm2_dir(builtin_cache: Path) -> Path:
    """builtin:smollm2 made in the user's real cache (fetched on the first run)
    and linked into the session's cache, where the tests' runners look."""
    real = ensure_builtin_model("builtin:smollm2", USER_BUILTIN_CACHE)
    link = builtin_cache / "mlx-supervisor" / "builtin" / real.name
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        with contextlib.suppress(FileExistsError):  # another worker linked it first
            link.symlink_to(real, target_is_directory=True)
    return real


@pytest.fixture(autouse=True)
def isolated_xdg(
    tmp_path_factory: pytest.TempPathFactory,
    builtin_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[None]:
    """Every test gets its own runtime/state/config/KV-block dirs; no socket env leaks in."""
    xdg = tmp_path_factory.mktemp("xdg")
    for var, sub in (
        ("XDG_RUNTIME_DIR", "run"),
        ("XDG_STATE_HOME", "state"),
        ("XDG_CONFIG_HOME", "config"),
    ):
        path = xdg / sub
        path.mkdir(parents=True)
        monkeypatch.setenv(var, str(path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(builtin_cache))
    # The XDG cache is the session's (builtin models are made once): KV blocks
    # on disk go elsewhere, so no test reads another's.
    monkeypatch.setenv(KV_CACHE_DIR_ENV, str(xdg / "kv"))
    monkeypatch.delenv("MLX_SUPERVISOR_SOCKET", raising=False)
    # Runners compute with mlx's own BLAS, as the in-process mlx-lm runs their
    # greedy tokens are compared with (test_cpu_blas.py lifts this).
    monkeypatch.setenv(CPU_BLAS_ENV, BUNDLED)
    # No fixed HTTP port shared by daemons in parallel: tests that want HTTP ask for port 0.
    monkeypatch.setenv(HTTP_ENV, "off")
    yield


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    """Fail a test that leaves a child process (runner or daemon) behind."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    leftovers = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    deadline = time.monotonic() + REAP_TIMEOUT_S  # for all of them: they end in parallel
    alive = [
        proc.pid
        for proc in leftovers
        if stop_process(proc, join_s=max(0.0, deadline - time.monotonic()), term_wait_s=None)
        != "exited"
    ]
    assert not alive, f"processes left behind: {alive}"


@contextlib.contextmanager
def module_daemon(root: Path, builtin_cache: Path, config: str) -> Iterator[DaemonProcess]:
    """A daemon a test module shares (HTTP on a free port, the session's builtin cache, its
    own XDG dirs under ``root``, mlx's bundled BLAS as this process computes with), stopped
    at the end with every runner it started reaped."""
    env = {"XDG_CACHE_HOME": str(builtin_cache), KV_CACHE_DIR_ENV: str(root / "kv"),
           CPU_BLAS_ENV: BUNDLED, HTTP_ENV: "127.0.0.1:0"}  # fmt: skip
    for var in ("XDG_RUNTIME_DIR", "XDG_STATE_HOME", "XDG_CONFIG_HOME"):
        (root / var).mkdir()
        env[var] = str(root / var)
    daemon = DaemonProcess(root / "d.sock", write_config(root / "d.toml", config), env=env).start()
    try:
        yield daemon
    finally:
        runners = psutil.Process(daemon.pid).children(recursive=True)
        assert daemon.terminate(timeout_s=30) == 0
        psutil.wait_procs(runners, timeout=5)


def faults(spec: str) -> dict[str, str]:
    """A load's ``env`` that makes its runner misbehave as ``spec`` says (runner.faults)."""
    return {FAULTS_ENV: spec}


def runner(client: Client, name: str) -> RunnerInfo:
    """Model ``name``'s entry in the daemon's status; fails the test if it has none
    (a test that expects a model gone checks the status's names itself)."""
    runners = client.status().runners
    found = next((r for r in runners if r.name == name), None)
    assert found is not None, f"no model {name!r} in status: {[r.name for r in runners]}"
    return found


def write_config(path: Path, text: str) -> Path:
    tomllib.loads(text)  # fail here, not in the daemon, on a typo in a test
    path.write_text(text)
    return path


DaemonFactory = Callable[..., DaemonProcess]


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[DaemonFactory]:
    """Factory: start a daemon on a temp socket; at teardown stop it and check
    that it exited 0, removed its socket and left no runner alive."""
    started: list[tuple[DaemonProcess, set[int]]] = []

    def start(config: str | None = None, **kwargs: Any) -> DaemonProcess:
        index = len(started)
        socket_path = tmp_path / f"d{index}.sock"
        config_path = None
        if config is not None:
            config_path = write_config(tmp_path / f"d{index}.toml", config)
        daemon = DaemonProcess(socket_path, config_path, **kwargs).start()
        started.append((daemon, set()))
        return daemon

    yield start
    for daemon, _ in started:
        if daemon.process is None or daemon.process.poll() is not None:
            continue
        runners = psutil.Process(daemon.pid).children(recursive=True)
        code = daemon.terminate(timeout_s=30)
        assert code == 0, f"daemon exited with {code}"
        _, alive = psutil.wait_procs(runners, timeout=REAP_TIMEOUT_S)
        assert not alive, f"runners outlived their daemon: {[p.pid for p in alive]}"
        assert not daemon.socket_path.exists(), "daemon left its socket behind"


@pytest.fixture
def daemon(start_daemon: DaemonFactory) -> DaemonProcess:
    """A running daemon with the default config."""
    return start_daemon()


@pytest.fixture
def client(daemon: DaemonProcess) -> Client:
    return Client(daemon.socket_path)


def assert_reaped(pid: int) -> None:
    """``pid`` is gone: not running and not a zombie."""
    try:
        proc = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    status = proc.status()
    raise AssertionError(f"pid {pid} still exists with status {status}")


def wait_exited(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until every pid has exited (a zombie has exited: its memory is gone,
    only its parent's reaping is left). Returns the pids still running.

    On Linux a pidfd becomes readable when the process exits, child or not.
    """
    import select

    deadline = time.monotonic() + timeout_s
    fds: dict[int, int] = {}
    try:
        for pid in pids:
            try:
                fds[os.pidfd_open(pid)] = pid
            except ProcessLookupError:
                continue
        pending = set(fds)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready, _, _ = select.select(list(pending), [], [], remaining)
            pending -= set(ready)
        return sorted(fds[fd] for fd in pending)
    finally:
        for fd in fds:
            os.close(fd)

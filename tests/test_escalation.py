"""Unload and shutdown escalate: Shutdown, join, SIGTERM, join, SIGKILL, reap."""

from __future__ import annotations

import time

import pytest

from conftest import DaemonFactory, assert_reaped
from supervisor.client import Client

GRACES = "shutdown_grace_s = 0.5\nterm_grace_s = 0.5\n"
IGNORE_SHUTDOWN = {"MLX_SUPERVISOR_FAULTS": "ignore_shutdown"}
IGNORE_BOTH = {"MLX_SUPERVISOR_FAULTS": "ignore_shutdown,ignore_sigterm"}


@pytest.fixture
def graced(start_daemon: DaemonFactory) -> Client:
    return Client(start_daemon(GRACES).socket_path)


def test_runner_ignoring_shutdown_is_stopped_by_sigterm(graced: Client) -> None:
    loaded = graced.load("builtin:tiny", env=IGNORE_SHUTDOWN)
    started = time.monotonic()
    unloaded = graced.unload("tiny")
    elapsed = time.monotonic() - started
    assert unloaded.steps == ["shutdown", "sigterm"]
    assert unloaded.exit.cause == "SIGTERM"  # its exit audit names the signal
    assert 0.5 <= elapsed < 0.5 + 0.5 + 2.0
    assert_reaped(loaded.pid)


def test_runner_ignoring_sigterm_is_stopped_by_sigkill(
    start_daemon: DaemonFactory,
) -> None:
    daemon = start_daemon(GRACES)
    client = Client(daemon.socket_path)
    loaded = client.load("builtin:tiny", env=IGNORE_BOTH)
    started = time.monotonic()
    unloaded = client.unload("tiny")
    elapsed = time.monotonic() - started
    assert unloaded.steps == ["shutdown", "sigterm", "sigkill"]
    assert unloaded.exit.signal == "SIGKILL"
    assert 1.0 <= elapsed < 1.0 + 2.0
    assert_reaped(loaded.pid)
    # Each step was logged with the model, the pid and the elapsed time.
    (sigterm,) = daemon.events("escalate_sigterm")
    (sigkill,) = daemon.events("escalate_sigkill")
    for record in (sigterm, sigkill):
        assert record["model"] == "tiny" and record["runner_pid"] == loaded.pid
    assert 0.5 <= float(sigterm["elapsed_s"]) < float(sigkill["elapsed_s"])  # type: ignore[arg-type]


def test_daemon_shutdown_escalates_runners_in_parallel(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(GRACES)
    client = Client(daemon.socket_path)
    pids = [client.load("builtin:tiny", name, env=IGNORE_BOTH).pid for name in ("a", "b")]
    ack = client.shutdown()
    assert ack.runners == 2
    assert daemon.wait() == 0
    for pid in pids:
        assert_reaped(pid)
    # Both runners were SIGKILLed before either was reaped: the escalations overlapped.
    kinds = [
        r["event"]
        for r in daemon.records()
        if r.get("event") in ("escalate_sigkill", "runner_reaped") and r.get("model") in ("a", "b")
    ]
    assert kinds[:2] == ["escalate_sigkill", "escalate_sigkill"], kinds


def test_unload_during_generation_ends_the_request_as_cancelled(graced: Client) -> None:
    graced.load("builtin:tiny")
    with graced.generate("tiny", "Hello", max_tokens=100_000) as gen:
        next(gen)
        unloaded = graced.unload("tiny")
        list(gen)
    assert unloaded.steps == ["shutdown"]
    assert gen.done is not None and gen.done.finish_reason == "cancelled"

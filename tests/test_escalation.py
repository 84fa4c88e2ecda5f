"""Unload and shutdown escalate: Shutdown, join, SIGTERM, join, SIGKILL, reap."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from conftest import DaemonFactory, assert_reaped
from supervisor.cli.main import status_table
from supervisor.client import Client, ClientError

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


# --- a runner that SIGKILL cannot end ---------------------------------------------------


@pytest.fixture
def frozen_fs(tmp_path: Path) -> Iterator[tuple[Path, Callable[[], None]]]:
    """A small ext4 filesystem on a loop device, mounted and frozen
    (``fsfreeze``): a process writing to it sleeps uninterruptibly (state D),
    and SIGKILL ends it only once the filesystem is thawed. Yields the mount
    point and the thaw; unmounts at teardown. Needs root and loop devices."""
    if os.geteuid() != 0 or not all(map(shutil.which, ("mkfs.ext4", "fsfreeze", "mount"))):
        pytest.skip("needs root, mkfs.ext4, mount and fsfreeze")
    image, mount_point = tmp_path / "fs.img", tmp_path / "mnt"
    mount_point.mkdir()
    with image.open("wb") as file:
        file.truncate(16 << 20)
    made = subprocess.run(["mkfs.ext4", "-q", str(image)], capture_output=True)
    mounted = made.returncode == 0 and subprocess.run(
        ["mount", "-o", "loop", str(image), str(mount_point)], capture_output=True
    ).returncode == 0  # fmt: skip
    if not mounted:
        pytest.skip("cannot mount a loop device here")
    frozen = [False]

    def thaw() -> None:
        if frozen[0]:
            subprocess.run(["fsfreeze", "-u", str(mount_point)], check=True)
            frozen[0] = False

    try:
        subprocess.run(["fsfreeze", "-f", str(mount_point)], check=True)
        frozen[0] = True
        yield mount_point, thaw
    finally:
        thaw()
        # Lazily: a runner killed in it may still be on its way out.
        subprocess.run(["umount", "--lazy", str(mount_point)], check=False)


def test_a_runner_sigkill_cannot_end_is_reported_unkillable_and_loads_go_on(
    start_daemon: DaemonFactory, frozen_fs: tuple[Path, Callable[[], None]]
) -> None:
    mount_point, thaw = frozen_fs
    daemon = start_daemon(GRACES + "sigkill_wait_s = 1.0\nrestart = 'never'\n")
    client = Client(daemon.socket_path)
    fired = mount_point.parent / "fired"  # made just before the write (not on the frozen fs)
    faults = {"MLX_SUPERVISOR_FAULTS": f"write_at_token=2:{mount_point}/f,once={fired}"}
    stuck = client.load("builtin:tiny", "stuck", env=faults)
    outcome: list[object] = []

    def generate() -> None:
        try:
            outcome.append(Client(daemon.socket_path).generate_text("stuck", "Hi", max_tokens=50))
        except ClientError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=generate)
    thread.start()
    process = psutil.Process(stuck.pid)
    # The write's sleep, not a passing one (a page read under load is a D state too).
    daemon.wait_until(lambda: fired.exists() and process.status() == psutil.STATUS_DISK_SLEEP)

    unloaded = client.unload("stuck")  # returns: nothing waits on the process for good
    assert unloaded.steps == ["shutdown", "sigterm", "sigkill", "unkillable"]
    assert "unkillable" in unloaded.exit.cause
    thread.join(timeout=30)  # its request has ended too
    assert outcome and isinstance(outcome[0], ClientError), outcome
    assert process.status() == psutil.STATUS_DISK_SLEEP  # still there, still counted
    status = client.status()
    assert [(u.name, u.pid) for u in status.supervisor.unkillable] == [("stuck", stuck.pid)]
    assert status.counters["unkillable"] == 1
    assert f"unkillable: pid {stuck.pid} (was stuck)" in status_table(status)
    (record,) = daemon.events("runner_unkillable")
    assert record["runner_pid"] == stuck.pid and record["model"] == "stuck"
    other = client.load("builtin:tiny", "other")  # admission is not held up by it
    assert other.pid != stuck.pid

    thaw()  # the write ends, SIGKILL takes effect, and the daemon reaps it
    daemon.wait_until(lambda: not client.status().supervisor.unkillable)
    assert_reaped(stuck.pid)

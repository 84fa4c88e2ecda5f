"""The synchronous kill ladder (supervisor.system.stop_process) on real
processes: each rung ends what it should, and a child is always reaped."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil

from supervisor.system import stop_process

SLEEPER = "import time; print('up', flush=True); time.sleep(600)"
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('up', flush=True); time.sleep(600)"
)


def spawn(code: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert process.stdout is not None
    assert process.stdout.readline() == b"up\n"  # its handler is in place
    process.stdout.close()
    return process


def test_a_process_that_heeds_sigterm_ends_on_that_rung_and_is_reaped() -> None:
    process = spawn(SLEEPER)
    assert stop_process(process, term_wait_s=10) == "sigterm"
    assert process.returncode == -signal.SIGTERM


def test_a_process_that_ignores_sigterm_is_killed_and_reaped() -> None:
    process = spawn(STUBBORN)
    assert stop_process(process, term_wait_s=0.2) == "sigkill"
    assert process.returncode == -signal.SIGKILL


def test_a_process_that_ends_on_its_own_is_left_to_end_and_reaped() -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    assert stop_process(process, join_s=30) == "exited"
    assert process.returncode == 0


def test_a_process_named_by_pid_goes_down_the_same_ladder() -> None:
    process = spawn(STUBBORN)
    assert stop_process(process.pid, term_wait_s=None) == "sigkill"  # psutil reaps our child
    assert not psutil.pid_exists(process.pid) or psutil.Process(process.pid).status() != "zombie"
    assert stop_process(process.pid) == "exited"  # gone: nothing to do
    process.wait()  # already reaped: Popen learns it (ECHILD)

"""The runner process on its own, driven over its pipes like the supervisor does."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from ipc import BlockingChannel, Codec
from ipc.messages import ExitAudit, RunnerEvent, Shutdown, Started


def spawn_runner() -> tuple[subprocess.Popen[bytes], BlockingChannel[RunnerEvent]]:
    command_r, command_w = os.pipe()
    event_r, event_w = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", "--read-fd", str(command_r),
         "--write-fd", str(event_w), "--parent-pid", str(os.getpid())],
        pass_fds=(command_r, event_w), stderr=subprocess.DEVNULL,
    )  # fmt: skip
    os.close(command_r)
    os.close(event_w)
    channel: BlockingChannel[RunnerEvent] = BlockingChannel(event_r, command_w, Codec(RunnerEvent))
    hello = channel.handshake("supervisor", "runner")
    assert hello.pid == proc.pid
    return proc, channel


def test_runner_exits_within_a_second_of_its_pipe_closing() -> None:
    # Its parent (this test) stays alive: only the pipe-EOF watcher can end it.
    proc, channel = spawn_runner()
    try:
        assert isinstance(channel.recv(), Started)
        closed_at = time.monotonic()
        channel.close()
        code = proc.wait(timeout=5)
        assert time.monotonic() - closed_at < 1.0
        assert code == 70  # EXIT_ORPHANED
    finally:
        proc.kill()
        proc.wait()


def test_shutdown_message_gives_an_exit_audit_and_exit_zero() -> None:
    proc, channel = spawn_runner()
    try:
        assert isinstance(channel.recv(), Started)
        channel.send(Shutdown("test"))
        audit = channel.recv()
        assert isinstance(audit, ExitAudit)
        assert audit.cause == "shutdown: test"
        assert proc.wait(timeout=10) == 0
    finally:
        channel.close()
        proc.kill()
        proc.wait()

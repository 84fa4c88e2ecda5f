"""Starting a runner process: its command line, its pipes, its environment,
and ssh for a rank on another machine.

The runner reads commands on one pipe and writes events on another (fds
passed to it); over ssh both are the session's stdin and stdout. No fd
outlives a failed start.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass

import anyio
from anyio.abc import Process

from supervisor.config import ModelConfig, SupervisorConfig
from supervisor.runners.blas import runner_blas_env

__all__ = ["Spawned", "spawn_runner", "ssh_argv"]


@dataclass(frozen=True)
class Spawned:
    """A runner process just started, and our ends of its pipes."""

    process: Process
    argv: list[str]
    event_fd: int  # its events come in here
    command_fd: int  # our commands go out here


def ssh_argv(ssh_command: list[str], host: str, max_frame_bytes: int) -> list[str]:
    """``ssh HOST COMMAND`` for a rank on another machine, as ``mlx.launch``
    runs one: the same python and working directory as here (install
    mlx-supervisor alike on every machine). Frames travel on the session's
    stdin and stdout (the runner's fd 3); its own stdout goes to stderr.
    The model's environment goes as the first frame, not in this command
    line, which every user of either machine can read."""
    runner = [
        "env", "PYTHONUNBUFFERED=1", sys.executable, "-m", "runner",
        "--read-fd", "0", "--write-fd", "3", "--parent-pid", "0", "--env-first",
        "--max-frame-bytes", str(max_frame_bytes),
    ]  # fmt: skip
    command = f"cd {shlex.quote(os.getcwd())} && exec {shlex.join(runner)} 3>&1 1>&2"
    return [*ssh_command, "--", host, command]


async def spawn_runner(spec: ModelConfig, config: SupervisorConfig, host: str | None) -> Spawned:
    """Start a runner for ``spec``, here or (``host``) through ssh.

    Raises:
        OSError, ValueError, subprocess.SubprocessError: it could not be
            started (every pipe is closed again).
    """
    env = {**os.environ, **runner_blas_env(config.cpu_blas), **spec.env, "PYTHONUNBUFFERED": "1"}
    command_r, command_w = os.pipe()
    try:
        event_r, event_w = os.pipe()
    except OSError:
        os.close(command_r)
        os.close(command_w)
        raise
    argv = [
        sys.executable, "-m", "runner",
        "--read-fd", str(command_r),
        "--write-fd", str(event_w),
        "--parent-pid", str(os.getpid()),
        "--max-frame-bytes", str(config.max_frame_bytes),
    ]  # fmt: skip
    # A remote rank's pipes are its ssh session's stdin and stdout.
    remote = host is not None
    if host is not None:
        argv = ssh_argv(config.ssh_command, host, config.max_frame_bytes)
    try:
        process = await anyio.open_process(
            argv,
            stdin=command_r if remote else subprocess.DEVNULL,
            stdout=event_w if remote else subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=() if remote else (command_r, event_w),
            env=os.environ if remote else env,
            # Its own session: a terminal's SIGHUP or Ctrl-C to the daemon's
            # process group never reaches runners; the daemon decides.
            start_new_session=True,
        )
    except BaseException:  # cancelled too: no fd may outlive a failed start
        for fd in (command_r, command_w, event_r, event_w):
            os.close(fd)
        raise
    os.close(command_r)  # the child's ends
    os.close(event_w)
    return Spawned(process, argv, event_r, command_w)

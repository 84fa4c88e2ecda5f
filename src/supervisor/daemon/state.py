"""What a daemon must remember across its own death: its runners and its models.

One JSON file per socket path in the XDG state dir, rewritten atomically
(temp file, rename) on every change. On start, a daemon kills the
runners a dead predecessor left behind (matching pid *and* start time, so a
reused pid is never hit) and loads the predecessor's models again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
from pathlib import Path
from typing import TypeVar

import msgspec
import psutil
import structlog

from supervisor.config import ModelConfig
from supervisor.daemon.paths import state_dir
from supervisor.system import process_create_time

log = structlog.get_logger("supervisor.daemon.state")

T = TypeVar("T")

_CREATE_TIME_SLACK_S = 0.05  # psutil start times are rounded to clock ticks


class RunnerRecord(msgspec.Struct, frozen=True):
    name: str
    pid: int
    create_time: float


class DaemonState(msgspec.Struct):
    daemon_pid: int = 0
    socket: str = ""
    runners: list[RunnerRecord] = []
    models: list[ModelConfig] = []


class _LooseState(msgspec.Struct):
    """The file as read: each entry checked on its own, so one bad entry
    (from an older version, or edited by hand) costs only itself."""

    daemon_pid: int = 0
    socket: str = ""
    runners: list[msgspec.Raw] = []
    models: list[msgspec.Raw] = []


def state_path(socket_path: Path) -> Path:
    """The state file of the daemon that serves ``socket_path``."""
    digest = hashlib.sha256(str(socket_path.resolve()).encode()).hexdigest()[:16]
    return state_dir() / f"daemon-{digest}.json"




class StateFile:
    """Reads and atomically rewrites one daemon's state file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> DaemonState:
        """The saved state; an empty one if there is none or it is unreadable."""
        try:
            loose = msgspec.json.decode(self.path.read_bytes(), type=_LooseState)
        except FileNotFoundError:
            return DaemonState()
        except (OSError, msgspec.DecodeError) as exc:
            log.warning("state_file_unreadable", path=str(self.path), error=str(exc))
            return DaemonState()
        return DaemonState(
            loose.daemon_pid,
            loose.socket,
            self._entries(loose.runners, RunnerRecord),
            self._entries(loose.models, ModelConfig),
        )

    def _entries(self, raws: list[msgspec.Raw], kind: type[T]) -> list[T]:
        entries: list[T] = []
        for raw in raws:
            try:
                entries.append(msgspec.json.decode(raw, type=kind))
            except msgspec.DecodeError as exc:
                log.warning("state_entry_skipped", path=str(self.path), error=str(exc))
        return entries

    def save(self, state: DaemonState) -> None:
        """Write ``state`` so that a crash leaves either the old or the new file.

        It holds runner environments: the file is 0600 in a 0700 directory.
        """
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.path.parent, 0o700)  # one made by an older version may be 0755
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(fd, "wb") as f:
            f.write(msgspec.json.encode(state))
        # No fsync: the file must survive the daemon's death, which the page
        # cache guarantees; an fsync on the event loop can stall every client
        # for seconds while the disk is busy (seen under the fuzzer).
        os.replace(tmp, self.path)


def kill_leftover_runners(records: list[RunnerRecord]) -> list[int]:
    """SIGKILL recorded runners that still run (same pid and start time).

    Returns the pids killed. A pid now used by another process is left alone.
    """
    killed: list[int] = []
    for record in records:
        if record.pid == os.getpid():
            continue
        started = process_create_time(record.pid)
        if started is None or abs(started - record.create_time) > _CREATE_TIME_SLACK_S:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.pid, signal.SIGKILL)
            killed.append(record.pid)
            log.warning("leftover_runner_killed", model=record.name, runner_pid=record.pid)
    procs = []
    for pid in killed:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    psutil.wait_procs(procs, timeout=5)
    return killed

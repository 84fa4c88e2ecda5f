"""Start a daemon as a child process and know when it is serving.

Used by the demo, the tests and the benchmarks. Readiness is the daemon's own
``daemon_started`` log event, read from its stderr: no sleeping, no polling.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO

from supervisor.system import stop_process


class DaemonStartError(Exception):
    """The daemon exited or never said it was serving."""


SHUTDOWN_WAIT_S = 30.0
"""How long a daemon has to shut down on SIGTERM before it is killed."""
WAIT_RECHECK_S = 0.25
"""How long :meth:`DaemonProcess.wait_until` waits for a log line before it
checks its condition again anyway."""


class DaemonProcess:
    """A ``mlx-supervisor serve`` child; its stderr is kept in ``log_lines``.

    Args:
        socket_path: where it listens.
        config_path: optional TOML config.
        env: extra environment for the daemon (and so its runners).
        log_file: where to also write the daemon's log lines.
        new_session: start it in a session (and process group) of its own, as
            a terminal or launchd would, so a test can signal its group.
    """

    def __init__(
        self,
        socket_path: Path,
        config_path: Path | None = None,
        env: dict[str, str] | None = None,
        log_file: Path | None = None,
        new_session: bool = False,
    ) -> None:
        self.socket_path = socket_path
        self.config_path = config_path
        self.env = {**os.environ, **(env or {})}
        self.log_file = log_file
        self.new_session = new_session
        self.log_lines: deque[str] = deque(maxlen=5000)
        self.process: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._started = threading.Event()
        self._serving = False
        self._lines_changed = threading.Condition()
        self.line_count = 0  # lines read so far (log_lines keeps only the last ones)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, timeout_s: float = 30.0) -> DaemonProcess:
        """Spawn the daemon and return once it serves.

        Raises:
            DaemonStartError: it exited first (the message has its last lines)
                or did not start within ``timeout_s``.
        """
        argv = [sys.executable, "-m", "supervisor", "serve", "--socket", str(self.socket_path)]
        if self.config_path is not None:
            argv += ["--config", str(self.config_path)]
        self.process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env=self.env, start_new_session=self.new_session,
        )  # fmt: skip
        assert self.process.stderr is not None
        self._reader = threading.Thread(
            target=self._read_log, args=(self.process.stderr,), daemon=True
        )
        self._reader.start()
        if not self._started.wait(timeout_s):
            self.kill()
            raise DaemonStartError(f"daemon did not start in {timeout_s}s")
        if not self._serving:
            self.process.wait()
            tail = "\n".join(list(self.log_lines)[-5:])
            raise DaemonStartError(f"daemon exited with {self.process.returncode}:\n{tail}")
        return self

    def _read_log(self, stream: IO[bytes]) -> None:
        sink = self.log_file.open("a", encoding="utf-8") if self.log_file else None
        try:
            for raw in stream:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                with self._lines_changed:
                    self.log_lines.append(line)
                    self.line_count += 1
                    self._lines_changed.notify_all()
                if sink is not None:
                    sink.write(line + "\n")
                    sink.flush()
                if not self._started.is_set() and _is_event(line, "daemon_started"):
                    self._serving = True
                    self._started.set()
        finally:
            self._started.set()  # exited before serving: start() reports it
            if sink is not None:
                sink.close()

    def wait_for_lines(self, seen: int, timeout_s: float) -> bool:
        """Block until the daemon has written more than ``seen`` lines in all
        (or its log ended); False on timeout."""
        with self._lines_changed:
            return self._lines_changed.wait_for(
                lambda: self.line_count > seen or not self._reader_alive(), timeout_s
            )

    def _reader_alive(self) -> bool:
        return self._reader is not None and self._reader.is_alive()

    def wait_until(self, condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
        """Re-check ``condition`` each time the daemon logs something, until true,
        and at least every WAIT_RECHECK_S: not every change of state is logged
        (a runner's figures, a request that starts in a batch), and the line
        that announces one may come just before it shows.

        Raises:
            TimeoutError: still false after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            seen = self.line_count
            if condition():
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"condition not met within {timeout_s}s")
            self.wait_for_lines(seen, min(remaining, WAIT_RECHECK_S))

    def records(self) -> list[dict[str, object]]:
        """The daemon's JSON log records so far, oldest first."""
        return [record for line in list(self.log_lines) if (record := _parse(line)) is not None]

    def events(self, name: str) -> list[dict[str, object]]:
        """The daemon's log records with event ``name``, oldest first."""
        return [record for record in self.records() if record.get("event") == name]

    def terminate(self, timeout_s: float = SHUTDOWN_WAIT_S) -> int:
        """SIGTERM (graceful shutdown) and wait; returns the exit code."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.wait(timeout_s)

    def wait(self, timeout_s: float = 30.0) -> int:
        assert self.process is not None
        code = self.process.wait(timeout_s)
        if self._reader is not None:
            self._reader.join(timeout_s)
        return code

    def kill(self) -> None:
        """SIGKILL and reap (for teardown after a failure)."""
        if self.process is not None:
            stop_process(self.process, term_wait_s=None)

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.process is None:
            return
        stop_process(self.process, term_wait_s=SHUTDOWN_WAIT_S)  # SIGTERM: a graceful shutdown
        if self._reader is not None:
            self._reader.join(SHUTDOWN_WAIT_S)


def _parse(line: str) -> dict[str, object] | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _is_event(line: str, name: str) -> bool:
    record = _parse(line)
    return record is not None and record.get("event") == name

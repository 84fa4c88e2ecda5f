"""The runner's stdout and stderr, re-logged as the daemon's own records.

A runner logs JSON records on stderr; each comes out of the daemon's log
with the runner's model and pid bound, at the runner's level. Other lines
are logged as ``runner_output``; the last stderr lines are kept for the
runner's exit report.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any, Protocol

from anyio.abc import ByteReceiveStream

__all__ = ["MAX_LOG_LINE_BYTES", "MAX_TAIL_LINE_CHARS", "Relayed", "relay_line", "relay_output"]

_LEVELS = {"debug", "info", "warning", "error", "critical"}
# Keys a relayed runner log record may not set as they are (ours, or structlog's).
_RESERVED_KEYS = {"source", "event", "level", "timestamp", "model", "runner_pid", "exc_info",
                  "stack_info", "self"}  # fmt: skip
MAX_LOG_LINE_BYTES = 64 * 1024
MAX_TAIL_LINE_CHARS = 500


class Relayed(Protocol):
    """The runner whose output is relayed: its logger (rebound when a spare
    is adopted, so read per line) and the tail of its stderr."""

    @property
    def log(self) -> Any: ...
    @property
    def stderr_tail(self) -> deque[str]: ...


async def relay_output(runner: Relayed, stream: ByteReceiveStream, source: str) -> None:
    """Re-log the runner's stdout/stderr lines with its model name and pid.

    A line longer than ``MAX_LOG_LINE_BYTES`` is cut there: a runner
    printing without newlines cannot grow the daemon's memory.
    """
    pending = b""
    async for chunk in stream:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if len(pending) > MAX_LOG_LINE_BYTES:
            lines.append(pending[:MAX_LOG_LINE_BYTES])
            pending = b""
        for line in lines:
            relay_line(runner, line[:MAX_LOG_LINE_BYTES], source)
    if pending:
        relay_line(runner, pending, source)


def relay_line(runner: Relayed, raw: bytes, source: str) -> None:
    """Log one line of the runner's ``source`` stream (a record, or plain output)."""
    text = raw.decode("utf-8", "replace").rstrip()
    if not text:
        return
    if source == "stderr":
        runner.stderr_tail.append(text[:MAX_TAIL_LINE_CHARS])  # it travels in status replies
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if isinstance(record, dict) and isinstance(record.get("event"), str):
        event = record.pop("event")
        level = str(record.pop("level", "info"))
        for key in ("timestamp", "model", "runner_pid"):
            record.pop(key, None)
        # The runner's own keys never clash with ours: prefix any that would.
        fields = {
            (f"runner_{key}" if key in _RESERVED_KEYS else key): value
            for key, value in record.items()
        }
        log_method = getattr(runner.log, level if level in _LEVELS else "info")
        log_method(event, source="runner", **fields)
    else:
        runner.log.info("runner_output", stream=source, line=text)

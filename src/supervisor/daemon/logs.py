"""Daemon logging: structlog, JSON lines when stderr is not a terminal; ``log_time``
reads a line's time back."""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from datetime import datetime
from typing import TextIO, cast

import structlog


class NeverFailingWriter:
    """A log stream that swallows write errors: a closed terminal (EIO) or a
    vanished reader of stderr (EPIPE) must never take the daemon down. After
    the first failure, log lines go nowhere."""

    def __init__(self, stream: TextIO) -> None:
        self._stream: TextIO | None = stream

    def write(self, text: str) -> int:
        if self._stream is not None:
            try:
                self._stream.write(text)
            except (OSError, ValueError):
                self._stream = None
        return len(text)

    def flush(self) -> None:
        if self._stream is not None:
            try:
                self._stream.flush()
            except (OSError, ValueError):
                self._stream = None


def configure_logging(level: int = logging.INFO, json: bool | None = None) -> None:
    """Configure structlog for the daemon.

    Args:
        level: the lowest level emitted.
        json: force JSON (True) or console (False); default: JSON unless
            stderr is a TTY.
    """
    if json is None:
        json = not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(
            file=cast(TextIO, NeverFailingWriter(sys.stderr))
        ),
        cache_logger_on_first_use=False,
    )


def log_time(record: Mapping[str, object]) -> float:
    """A JSON log line's ``timestamp`` as seconds since the epoch.

    ``configure_logging`` stamps each line in UTC, ISO 8601 with microseconds and a
    ``Z`` (``2026-11-21T21:05:00.123456Z``).
    """
    return datetime.fromisoformat(str(record["timestamp"]).replace("Z", "+00:00")).timestamp()

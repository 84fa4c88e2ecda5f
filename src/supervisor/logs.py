"""Daemon logging: structlog, JSON lines when stderr is not a terminal."""

from __future__ import annotations

import logging
import sys

import structlog


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
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )

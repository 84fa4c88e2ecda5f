"""Sizes and durations as people write and read them: ``1.5 GiB``, ``5m``."""

from __future__ import annotations

import re

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0}


def format_bytes(n: int | None) -> str:
    """1536 -> '1.5 KiB'; None -> '-'."""
    if n is None:
        return "-"
    value = float(n)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_duration(seconds: float | None) -> str:
    """45 -> '45s', 300 -> '5m', 5400 -> '1.5h'; None -> '-'."""
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def parse_duration(text: str) -> float:
    """'90' or '90s' -> 90.0, '5m' -> 300.0, '1.5h' -> 5400.0, '0' -> 0.0.

    Raises:
        ValueError: not a number with an optional unit (ms, s, m, h, d).
    """
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"not a duration: {text!r} (write 30s, 5m, 2h or seconds)")
    return float(match.group(1)) * _SECONDS[match.group(2) or "s"]

"""Helpers shared by the bench scripts that have no home in one of them."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence


def mlx_device() -> str:
    """``mx.default_device()`` as a fresh python process sees it (the runners' device),
    without importing mlx into the bench process itself."""
    done = subprocess.run(
        [sys.executable, "-c", "import mlx.core as mx; print(mx.default_device())"],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    return done.stdout.strip() or f"unknown (exit {done.returncode})"


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, a rule under the header."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip()
        for row in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths).rstrip())
    return "\n".join(lines)

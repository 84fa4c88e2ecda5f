"""The statistics and tables that the bench scripts (``bench/``), the soak
(``tests/soak/soak_run.py``) and the fuzz runner (``tests/fuzz/fuzz_run.py``) print.

One definition each, so that a p99 in one report is the same statistic as a p99 in
another: ``percentile`` interpolates linearly between the two nearest samples (numpy's
default method, ``linear``; ``statistics.quantiles(..., method="inclusive")`` agrees).
The daemon itself uses none of this.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of ``values``, linear between order statistics
    (numpy's default, ``linear``): at rank ``(n - 1) * q / 100`` counted from 0, between
    the two samples beside it. NaN when there are no values (as ``median``)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def percentiles(values: Sequence[float], qs: Iterable[int]) -> dict[str, float]:
    """``{"p50": ..., "p99": ...}``: the ``percentile`` of ``values`` for each q in ``qs``."""
    return {f"p{q}": percentile(values, q) for q in qs}


def median(values: Iterable[float]) -> float:
    """The median, as a float; NaN when there are no values."""
    items = list(values)
    return float(statistics.median(items)) if items else math.nan


def render_table(
    header: Sequence[str] | None, rows: Sequence[Sequence[str]], *, markdown: bool = False
) -> str:
    """Rows of cells as text, a rule under the header (if there is one).

    Plain (the bench's tables): columns padded to their widest cell, two spaces apart,
    a rule of dashes. ``markdown`` (the soak's and the fuzz runner's, to paste into a
    README): cells joined by `` | ``, unpadded, the rule ``--- | ---``.
    """
    table = [*([header] if header is not None else []), *rows]
    if markdown:
        lines = [" | ".join(row) for row in table]
        rule = " | ".join("---" for _ in table[0])
    else:
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines = [
            "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in table
        ]
        rule = "  ".join("-" * w for w in widths).rstrip()
    if header is not None:
        lines.insert(1, rule)
    return "\n".join(lines)

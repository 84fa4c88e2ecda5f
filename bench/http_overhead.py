"""Family 2 of ``bench_http.py``: short requests through our HTTP front (streamed on a
new connection, streamed kept alive, whole kept alive) against our socket, end to end.
"""

from __future__ import annotations

from typing import Any

from common import (
    ms,
    note,
    ratio,
    signed_ms,
)
from http_common import (
    OVERHEAD_PATHS,
    PATH_LABELS,
    SOCKET,
    TTFT_USER,
    Sides,
    counts,
    messages_for,
)
from supervisor.figures import percentile, render_table


def overhead_family(sides: Sides, requests: int, max_tokens: int) -> dict[str, Any]:
    """``requests`` rounds; in each, one request on every path of OVERHEAD_PATHS, in an
    order that rotates every round, each path with a prompt of its own."""
    rounds = []
    for j in range(requests):
        shift = j % len(OVERHEAD_PATHS)
        order = OVERHEAD_PATHS[shift:] + OVERHEAD_PATHS[:shift]
        samples = {}
        for path in order:
            index = j * len(OVERHEAD_PATHS) + OVERHEAD_PATHS.index(path)
            samples[path] = sides.path(path, messages_for("Short", index, TTFT_USER), max_tokens)
        rounds.append({"index": j, "order": list(order),
                       **{p: s.record() for p, s in samples.items()}})  # fmt: skip
    note(f"  overhead: {requests} rounds x {len(OVERHEAD_PATHS)} paths done")
    summary = {}
    for path in OVERHEAD_PATHS:
        totals = [r[path]["total_s"] for r in rounds]
        summary[path] = {
            "p50_s": percentile(totals, 50),
            "p99_s": percentile(totals, 99),
            "completion_tokens": sorted({r[path]["completion_tokens"] for r in rounds}),
            "cached_tokens_max": max(r[path]["cached_tokens"] or 0 for r in rounds),
        }
        if path != SOCKET:
            anchor = summary[SOCKET]["p50_s"]
            summary[path]["p50_minus_socket_s"] = summary[path]["p50_s"] - anchor
            summary[path]["paired_diff_p50_s"] = percentile(
                [r[path]["total_s"] - r[SOCKET]["total_s"] for r in rounds], 50
            )
            summary[path]["p50_ratio"] = summary[path]["p50_s"] / anchor
    same_tokens = sum(len({r[p]["completion_tokens"] for p in OVERHEAD_PATHS}) == 1 for r in rounds)
    return {
        "requests_per_path": requests,
        "max_tokens": max_tokens,
        "summary": summary,
        "same_tokens": same_tokens,
        "rounds": rounds,
    }


def overhead_table(o: dict[str, Any]) -> str:
    header = [
        "path", "p50", "p99", "p50 - socket", "paired diff p50", "ratio p50", "tokens",
        "cached max",
    ]  # fmt: skip
    rows = []
    for path in OVERHEAD_PATHS:
        s = o["summary"][path]
        rows.append([
            PATH_LABELS[path], ms(s["p50_s"]), ms(s["p99_s"]),
            signed_ms(s.get("p50_minus_socket_s")), signed_ms(s.get("paired_diff_p50_s")),
            ratio(s["p50_s"], o["summary"][SOCKET]["p50_s"]) if path != SOCKET else "-",
            counts(s["completion_tokens"]), str(s["cached_tokens_max"]),
        ])  # fmt: skip
    title = (
        f"2. The HTTP layer's cost per request, builtin:tiny, {o['requests_per_path']} "
        f"requests per path, max_tokens {o['max_tokens']}, greedy, the same daemon and "
        "runner: end to end, client-side (request sent -> response read to its end; the "
        "socket's connect + hello included); paths take turns in a rotating order, each "
        "request with a prompt of its own; paired diff = p50 of (path - socket) per round; "
        f"same token count on every path in {o['same_tokens']}/{o['requests_per_path']} rounds."
    )
    return title + "\n" + render_table(header, rows)

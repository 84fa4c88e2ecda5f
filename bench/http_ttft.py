"""Family 1b of ``bench_http.py``: time to first token through HTTP, ours / mlx_lm.server,
p50 and p99 of each side and the paired difference.
"""

from __future__ import annotations

from typing import Any

from common import (
    ms,
    note,
    run_alternating,
    signed_ms,
    verdict,
)
from http_common import (
    OURS,
    SHORT_NAMES,
    THEIRS,
    TTFT_USER,
    Sides,
    agreement,
    messages_for,
    pair_record,
)
from supervisor.figures import percentile, render_table

TTFT_TARGET = 1.0  # ours / theirs, p50 and p99: at most


def ttft_family(sides: Sides, requests: int, max_tokens: int) -> dict[str, Any]:
    """``requests`` short requests per side, each with a fresh prompt (the same prompt
    for both sides of a pair), the first side alternating by pair."""
    pairs = []
    for i in range(requests):
        messages = messages_for("Request", i, TTFT_USER)
        ours, theirs = run_alternating(
            i,
            lambda m=messages: sides.ours(m, max_tokens),
            lambda m=messages: sides.theirs(m, max_tokens),
        )
        pairs.append(pair_record(i, ours, theirs))
        if i % 10 == 9 or i == requests - 1:
            note(
                f"  TTFT {sides.name}: {i + 1}/{requests} pairs, last ours "
                f"{ms(ours.ttft_s, '.1f')}, theirs {ms(theirs.ttft_s, '.1f')}"
            )
    result: dict[str, Any] = {"requests": requests, "max_tokens": max_tokens}
    for q in (50, 99):
        for side in (OURS, THEIRS):
            values = [p[side]["ttft_s"] for p in pairs if p[side]["ttft_s"] is not None]
            result[f"p{q}_{side}_s"] = percentile(values, q)
        result[f"p{q}_ratio"] = result[f"p{q}_{OURS}_s"] / result[f"p{q}_{THEIRS}_s"]
    result["paired_diff_p50_s"] = percentile(
        [p[OURS]["ttft_s"] - p[THEIRS]["ttft_s"] for p in pairs], 50
    )
    for side in (OURS, THEIRS):
        cached = [p[side]["cached_tokens"] for p in pairs]
        result[f"cached_tokens_{side}"] = None if None in cached else max(cached)
    result.update(agreement(pairs))
    result["samples"] = pairs
    return result


def ttft_table(results: dict[str, dict[str, Any]]) -> str:
    header = [
        "model", "requests", "prompt tok", "cached ours", "theirs", "TTFT p50 ours", "theirs",
        "ours/theirs", f"target<={TTFT_TARGET:g}", "p99 ours", "theirs", "ours/theirs",
        f"target<={TTFT_TARGET:g}", "paired diff p50", "same tokens", "same text",
    ]  # fmt: skip
    rows = []
    for model, t in results.items():
        rows.append([
            SHORT_NAMES[model], str(t["requests"]), f"{t['prompt_tokens_ours']:.0f}",
            str(t["cached_tokens_ours"]), str(t["cached_tokens_theirs"]),
            ms(t["p50_ours_s"], ".1f"), ms(t["p50_theirs_s"], ".1f"), f"{t['p50_ratio']:.3f}",
            verdict(t["p50_ratio"] <= TTFT_TARGET),
            ms(t["p99_ours_s"], ".1f"), ms(t["p99_theirs_s"], ".1f"), f"{t['p99_ratio']:.3f}",
            verdict(t["p99_ratio"] <= TTFT_TARGET),
            signed_ms(t["paired_diff_p50_s"]).replace(".000", ""),
            f"{t['same_tokens']}/{t['pairs']}", f"{t['same_text']}/{t['pairs']}",
        ])  # fmt: skip
    max_tokens = sorted({t["max_tokens"] for t in results.values()})
    title = (
        "1b. Time to first token through HTTP, ours vs mlx_lm.server: client-side from the "
        "request sent (new TCP connection, both sides) to the first non-empty "
        f"delta.content; max_tokens {'/'.join(map(str, max_tokens))}, greedy; a fresh prompt "
        "per request (a counter opens the system message; 'cached' = the most prompt tokens "
        "either side reported taken from its cache: the chat template's opening and the word "
        "before the counter); the side that goes first alternates per pair; paired diff = p50 of "
        "ours - theirs per pair."
    )
    return title + "\n" + render_table(header, rows)

"""Figure 2 of ``bench_daemon.py``: time to first token through the daemon - in-process
``stream_generate`` (the two IPC hops), paired and as distributions.
"""

from __future__ import annotations

from typing import Any

from common import (
    Worker,
    daemon_generate,
    inproc_generate,
    ms,
    note,
    run_alternating,
    signed_ms,
    verdict,
)
from daemon_common import Row, short
from supervisor.client import Client
from supervisor.figures import percentile, percentiles

TTFT_PROMPT = "Hello"

# Target (see the brief in bench/README.md).
TTFT_P50_TARGET_S = 0.002


def bench_ttft(
    client: Client, w: Worker, model: str, pairs: int, warmup: int, max_tokens: int
) -> dict[str, Any]:
    name = short(model)
    rows = []
    for index in range(warmup + pairs):
        inproc, daemon = run_alternating(
            index,
            lambda: inproc_generate(w, name, TTFT_PROMPT, max_tokens),
            lambda: daemon_generate(client, name, TTFT_PROMPT, max_tokens),
        )
        if index >= warmup:
            rows.append(
                {
                    "inproc_s": inproc["ttft_s"],
                    "daemon_s": daemon["ttft_s"],
                    "daemon_e2e_s": daemon["e2e_ttft_s"],
                    "runner_s": daemon["runner_ttft_s"],
                }
            )

    def column(key: str) -> list[float]:
        return [float(r[key]) for r in rows]

    def diffs(key: str) -> list[float]:
        return [r[key] - r["inproc_s"] for r in rows]

    def summary(values: list[float]) -> dict[str, float]:
        return percentiles(values, (25, 50, 75, 99))

    inproc_s, daemon_s = column("inproc_s"), column("daemon_s")
    result: dict[str, Any] = {
        "model": model,
        "pairs": pairs,
        "max_tokens": max_tokens,
        "prompt": TTFT_PROMPT,
        "inproc": summary(inproc_s),
        "daemon": summary(daemon_s),
        "daemon_e2e": summary(column("daemon_e2e_s")),
        "runner": summary(column("runner_s")),
        # headline: per-pair differences (each daemon request minus the in-process one
        # next to it), then their percentiles
        "paired_diff": summary(diffs("daemon_s")),
        "paired_diff_e2e": summary(diffs("daemon_e2e_s")),
        # the other reading: percentile of one distribution minus that of the other
        "distribution_diff": {
            "p50": percentile(daemon_s, 50) - percentile(inproc_s, 50),
            "p99": percentile(daemon_s, 99) - percentile(inproc_s, 99),
        },
        # the two hops alone: client-seen TTFT minus the runner's own TTFT
        "hops_only": summary([r["daemon_s"] - r["runner_s"] for r in rows]),
        "samples": rows,
    }
    note(
        f"  ttft {name}: {pairs} pairs, paired diff p50 "
        f"{1000 * result['paired_diff']['p50']:.3f} ms, p99 "
        f"{1000 * result['paired_diff']['p99']:.3f} ms"
    )
    return result


# --- the table ---------------------------------------------------------------


def ttft_rows(t: dict[str, Any], checked: bool) -> list[Row]:
    """``checked``: the row the target applies to (the model whose compute is smallest)."""
    m, paired = short(t["model"]), t["paired_diff"]
    dist, e2e, hops = t["distribution_diff"], t["paired_diff_e2e"], t["hops_only"]
    iqr = f"IQR {signed_ms(paired['p25'])} to {signed_ms(paired['p75'])}"
    return [
        (
            f"2 TTFT p50, Generation.ttft_s ({m}, {t['pairs']} pairs, max_tokens "
            f"{t['max_tokens']})",
            ms(t["daemon"]["p50"]),
            ms(t["inproc"]["p50"]),
            f"paired diff {signed_ms(paired['p50'])} ({iqr})",
            f"< {TTFT_P50_TARGET_S * 1000:g} ms" if checked else "",
            verdict(paired["p50"] < TTFT_P50_TARGET_S) if checked else "",
        ),
        (
            f"2 TTFT p99, Generation.ttft_s ({m})",
            ms(t["daemon"]["p99"]),
            ms(t["inproc"]["p99"]),
            f"paired diff {signed_ms(paired['p99'])}",
            "",
            "",
        ),
        (
            f"2 TTFT p50(daemon)-p50(in-proc) / p99-p99 ({m})",
            "",
            "",
            f"{signed_ms(dist['p50'])} / {signed_ms(dist['p99'])}",
            "",
            "",
        ),
        (
            f"2 TTFT incl. connect+handshake, paired p50 / p99 ({m})",
            ms(t["daemon_e2e"]["p50"]),
            "",
            f"{signed_ms(e2e['p50'])} / {signed_ms(e2e['p99'])}",
            "",
            "",
        ),
        (
            f"2 the hops alone: client ttft - runner ttft, p50 / p99 ({m})",
            "",
            "",
            f"{signed_ms(hops['p50'])} / {signed_ms(hops['p99'])}",
            "",
            "",
        ),
    ]

"""Family 2 of ``bench_engine.py``: 4 and 8 concurrent clients, ours next to
``mlx_lm.server`` (aggregate tokens/s, the slowest client's time to first token), and on
builtin:small the bf16 batch mismatch (requests served together vs each alone).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from common import fmt, note, quotient, verdict
from engine_common import (
    OURS,
    THEIRS,
    Sample,
    median,
    ours_request,
    theirs_request,
)
from supervisor.client import Client
from supervisor.figures import render_table

CONCURRENT_CLIENTS = (4, 8)
CONCURRENT_TOKENS = 64
MISMATCH_REQUESTS = 4
MISMATCH_TOKENS = 32


def concurrent_prompts(clients: int, round_index: int) -> list[str]:
    """Distinct short raw prompts (short, so that small's slow prefill stays small)."""
    return [
        f"Client {i} of {clients}, round {round_index}: the number {i * 37 + clients}"
        for i in range(clients)
    ]


def run_together(requests: Sequence[Callable[[], Sample]]) -> list[Sample]:
    """Start every request at the same moment (a barrier) on threads of its own; the
    samples in the order given. The pool's lifetime is this call."""
    barrier = threading.Barrier(len(requests))

    def start(request: Callable[[], Sample]) -> Sample:
        barrier.wait()
        return request()

    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        futures = [pool.submit(start, r) for r in requests]
        return [f.result() for f in futures]


def batch_figures(samples: Sequence[Sample]) -> dict[str, Any]:
    start = min(s.sent_at for s in samples)
    end = max(s.ended_at for s in samples)
    tokens = sum(s.generation_tokens for s in samples)
    ttfts = [s.ttft_s for s in samples]
    return {
        "wall_s": end - start,
        "tokens": tokens,
        "aggregate_tps": tokens / (end - start),
        "slowest_ttft_s": None if None in ttfts else max(t for t in ttfts if t is not None),
        "samples": [s.record() for s in samples],
    }


def concurrency_family(
    client: Client, name: str, port: int, rounds: int, tokens: int
) -> list[dict[str, Any]]:
    """Per client count: ``rounds`` rounds, each running both sides one after the other
    (the order alternating by round)."""
    cases = []
    for clients in CONCURRENT_CLIENTS:
        round_records = []
        for r in range(rounds):
            prompts = concurrent_prompts(clients, r)
            runs = {
                OURS: lambda p=prompts: run_together(
                    [lambda q=q: ours_request(client, name, prompt=q, max_tokens=tokens) for q in p]
                ),
                THEIRS: lambda p=prompts: run_together(
                    [lambda q=q: theirs_request(port, prompt=q, max_tokens=tokens) for q in p]
                ),
            }
            order = (OURS, THEIRS) if r % 2 == 0 else (THEIRS, OURS)
            figures = {side: batch_figures(runs[side]()) for side in order}
            short = [
                s
                for side in order
                for s in figures[side]["samples"]
                if s["generation_tokens"] != tokens
            ]
            if short:
                raise RuntimeError(f"a request ended before {tokens} tokens: {short[0]}")
            record = {
                "round": r,
                "order": list(order),
                **{side: figures[side] for side in order},
                "tps_ratio": figures[OURS]["aggregate_tps"] / figures[THEIRS]["aggregate_tps"],
                "slowest_ttft_ratio": quotient(
                    figures[OURS]["slowest_ttft_s"], figures[THEIRS]["slowest_ttft_s"]
                ),
            }
            round_records.append(record)
            note(
                f"  {name}: {clients} clients round {r}: "
                f"ours {figures[OURS]['aggregate_tps']:.1f} tok/s, "
                f"theirs {figures[THEIRS]['aggregate_tps']:.1f} tok/s"
            )
        cases.append(
            {
                "clients": clients,
                "tokens_per_client": tokens,
                "rounds": round_records,
                "aggregate_tps_ours": median([r[OURS]["aggregate_tps"] for r in round_records]),
                "aggregate_tps_theirs": median([r[THEIRS]["aggregate_tps"] for r in round_records]),
                "tps_ratio": median([r["tps_ratio"] for r in round_records]),
                "slowest_ttft_ours_s": median([r[OURS]["slowest_ttft_s"] for r in round_records]),
                "slowest_ttft_theirs_s": median(
                    [r[THEIRS]["slowest_ttft_s"] for r in round_records]
                ),
                "slowest_ttft_ratio": median([r["slowest_ttft_ratio"] for r in round_records]),
                "batched_ours": sum(
                    s["batched"] for r in round_records for s in r[OURS]["samples"]
                ),
            }
        )
    return cases


def concurrency_table(results: dict[str, list[dict[str, Any]]]) -> str:
    header = [
        "model",
        "clients",
        "rounds",
        "tok/s ours",
        "theirs",
        "ours/theirs",
        "target>=1",
        "slowest TTFT ours",
        "theirs",
        "ours/theirs",
        "target<=1",
        "ours batched",
    ]
    rows = []
    for model, cases in results.items():
        for c in cases:
            requests = c["clients"] * len(c["rounds"])
            rows.append(
                [
                    model,
                    str(c["clients"]),
                    str(len(c["rounds"])),
                    fmt(c["aggregate_tps_ours"], ".1f"),
                    fmt(c["aggregate_tps_theirs"], ".1f"),
                    fmt(c["tps_ratio"], ".2f"),
                    verdict(c["tps_ratio"] >= 1.0),
                    fmt(c["slowest_ttft_ours_s"], ".0f", 1e3, " ms"),
                    fmt(c["slowest_ttft_theirs_s"], ".0f", 1e3, " ms"),
                    fmt(c["slowest_ttft_ratio"], ".2f"),
                    verdict(
                        None if c["slowest_ttft_ratio"] is None else c["slowest_ttft_ratio"] <= 1
                    ),
                    f"{c['batched_ours']}/{requests}",
                ]
            )
    title = (
        f"2. Concurrent clients, {CONCURRENT_TOKENS} tokens each, started together "
        "(raw prompts: /v1/completions vs Client.generate; greedy). tok/s = all tokens / "
        "wall time from the first send to the last end; medians over rounds, ratios: "
        "median of per-round ratios."
    )
    return title + "\n" + render_table(header, rows)


def per_token_pieces(sample: Sample) -> list[str] | None:
    """The text of each generated token, when every streamed piece carried exactly one
    (the daemon merges pieces only for a client that falls behind); else None."""
    counts = [count for count, _ in sample.pieces]
    if counts != list(range(1, len(counts) + 1)):
        return None
    return [text for _, text in sample.pieces]


def mismatch_family(client: Client, name: str, tokens: int) -> dict[str, Any]:
    """Greedy outputs of MISMATCH_REQUESTS requests served together vs each alone, on our
    daemon, without the prefix cache (so each computes its whole prompt either way). The
    prompts differ in length, so the batch pads them as real traffic would."""
    prompts = [
        f"Mismatch probe {i}: " + "tell me about this item, " * (1 + i)
        for i in range(MISMATCH_REQUESTS)
    ]
    together = run_together(
        [
            lambda q=q: ours_request(client, name, prompt=q, max_tokens=tokens, cache=False)
            for q in prompts
        ]
    )
    alone = [ours_request(client, name, prompt=q, max_tokens=tokens, cache=False) for q in prompts]
    pairs = []
    differing = compared = 0
    for t, a in zip(together, alone, strict=True):
        pt, pa = per_token_pieces(t), per_token_pieces(a)
        first_diff = None
        if pt is not None and pa is not None:
            diffs = [i for i, (x, y) in enumerate(zip(pt, pa, strict=True)) if x != y]
            differing += len(diffs)
            compared += len(pt)
            first_diff = diffs[0] if diffs else None
        pairs.append(
            {
                "together": t.record(),
                "alone": a.record(),
                "same_text": t.text == a.text,
                "token_level": pt is not None and pa is not None,
                "first_differing_token": first_diff,
                "together_batched": t.extra["batched"],
            }
        )
    return {
        "requests": MISMATCH_REQUESTS,
        "tokens": tokens,
        "pairs": pairs,
        "positions_compared": compared,
        "positions_differing": differing,
        "mismatch_rate": differing / compared if compared else None,
        "identical_outputs": sum(p["same_text"] for p in pairs),
    }


def mismatch_table(model: str, m: dict[str, Any]) -> str:
    header = ["request", "served together: batched", "same text", "first differing token"]
    rows = [
        [
            str(i),
            "yes" if p["together_batched"] else "no",
            "yes" if p["same_text"] else "no",
            "-" if p["first_differing_token"] is None else str(p["first_differing_token"]),
        ]
        for i, p in enumerate(m["pairs"])
    ]
    title = (
        f"2b. bf16 batch mismatch, {model}, our daemon: {m['requests']} greedy requests x "
        f"{m['tokens']} tokens served together vs each alone (cache=False): "
        f"{m['positions_differing']}/{m['positions_compared']} token positions differ "
        f"({fmt(m['mismatch_rate'], '.1%')}); {m['identical_outputs']}/{m['requests']} "
        "outputs identical."
    )
    return title + "\n" + render_table(header, rows)

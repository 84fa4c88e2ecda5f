"""Family 3 of ``bench_engine.py``: ``runner.prefix_index.PrefixIndex.lookup`` in this
process with 10, 100 and 1,000 stored entries: us per lookup, and 1000 / 10.
"""

from __future__ import annotations

import gc
import random
import time
from typing import Any

from common import fmt, verdict
from engine_common import (
    median,
)
from runner.prefix_index import PrefixIndex
from supervisor.figures import render_table

LOOKUP_SIZES = (10, 100, 1000)
LOOKUP_SYSTEMS = 10  # distinct system prompts the stored entries start with
LOOKUP_SYSTEM_TOKENS = 500
LOOKUP_TAIL_TOKENS = (500, 1500)  # after the system prompt: entries of 1,000-2,000 tokens
LOOKUP_QUERIES = 10  # distinct queries, the same for every size
LOOKUP_VOCAB = 32_000
LOOKUP_TARGET = 2.0  # 1000 entries / 10 entries


def lookup_family(rounds: int, lookups: int) -> dict[str, Any]:
    """Time ``PrefixIndex.lookup`` with 10, 100 and 1,000 stored entries, in this process.

    Entry ``i`` is a system prompt (one of LOOKUP_SYSTEMS) then a conversation of its own,
    drawn from a generator seeded with ``i``, so the smaller indexes hold exactly the
    first entries of the larger ones. Two kinds of query, the same for every size: the
    *next turn* of a stored conversation (its key but the last 5 tokens, as a chat's
    history retokenizes, then 60 new tokens), and a *new chat* on a known system prompt
    (only that prefix is shared). Sizes take turns in an order that rotates every round.
    """
    systems = [
        random.Random(f"system {k}").choices(range(LOOKUP_VOCAB), k=LOOKUP_SYSTEM_TOKENS)
        for k in range(LOOKUP_SYSTEMS)
    ]

    def entry(i: int) -> list[int]:
        rng = random.Random(f"entry {i}")
        tail = rng.choices(range(LOOKUP_VOCAB), k=rng.randint(*LOOKUP_TAIL_TOKENS))
        return systems[i % LOOKUP_SYSTEMS] + tail

    def new_tokens(seed: str, n: int) -> list[int]:
        return random.Random(seed).choices(range(LOOKUP_VOCAB), k=n)

    query_rng = random.Random("queries")
    queries = {
        "next_turn": [
            entry(i)[:-5] + new_tokens(f"turn {i}", 60)
            for i in query_rng.sample(range(min(LOOKUP_SIZES)), LOOKUP_QUERIES)
        ],
        "new_chat": [systems[k] + new_tokens(f"chat {k}", 300) for k in range(LOOKUP_QUERIES)],
    }
    expected = {
        "next_turn": [len(q) - 60 for q in queries["next_turn"]],
        "new_chat": [LOOKUP_SYSTEM_TOKENS] * LOOKUP_QUERIES,
    }
    indexes: dict[int, PrefixIndex[None]] = {}
    build_s = {}
    for size in LOOKUP_SIZES:
        started = time.perf_counter()
        index: PrefixIndex[None] = PrefixIndex(budget_bytes=1 << 60, max_entries=max(LOOKUP_SIZES))
        for i in range(size):
            key = entry(i)
            index.insert(key, None, len(key), trimmable=True)
        build_s[size] = time.perf_counter() - started
        if len(index) != size:
            raise RuntimeError(f"index of {size} holds {len(index)} entries")
        for kind, qs in queries.items():  # the reuse must be what the query was built for
            for q, want in zip(qs, expected[kind], strict=True):
                match = index.lookup(q)
                if match is None or match.reuse != want:
                    raise RuntimeError(f"{kind} lookup with {size} entries: {match} != {want}")
        indexes[size] = index
    samples: list[dict[str, Any]] = []
    for r in range(rounds):
        order = LOOKUP_SIZES[r % 3 :] + LOOKUP_SIZES[: r % 3]
        for size in order:
            for kind, qs in queries.items():
                lookup = indexes[size].lookup
                batch = [qs[i % len(qs)] for i in range(lookups)]
                gc.collect()
                started = time.perf_counter()
                for q in batch:
                    lookup(q)
                elapsed = time.perf_counter() - started
                samples.append(
                    {
                        "round": r,
                        "entries": size,
                        "kind": kind,
                        "lookups": lookups,
                        "us_per_lookup": elapsed / lookups * 1e6,
                    }
                )
    summary = {}
    for kind in queries:
        per_size = {
            size: median(
                [s["us_per_lookup"] for s in samples if s["entries"] == size and s["kind"] == kind]
            )
            for size in LOOKUP_SIZES
        }
        ratios = []
        for r in range(rounds):
            us = {
                s["entries"]: s["us_per_lookup"]
                for s in samples
                if s["round"] == r and s["kind"] == kind
            }
            ratios.append(us[max(LOOKUP_SIZES)] / us[min(LOOKUP_SIZES)])
        summary[kind] = {
            "us_per_lookup": per_size,
            "ratio_1000_over_10": median(ratios),
            "query_tokens": median([len(q) for q in queries[kind]]),
        }
    return {
        "rounds": rounds,
        "lookups_per_sample": lookups,
        "build_s": build_s,
        "summary": summary,
        "samples": samples,
    }


def lookup_table(result: dict[str, Any]) -> str:
    header = ["query", "tokens", *[f"{n} entries" for n in LOOKUP_SIZES], "1000/10", "target<=2"]
    rows = []
    for kind, s in result["summary"].items():
        ratio = s["ratio_1000_over_10"]
        rows.append(
            [
                kind.replace("_", " "),
                fmt(s["query_tokens"], ".0f"),
                *[fmt(s["us_per_lookup"][n], ".1f", unit=" us") for n in LOOKUP_SIZES],
                fmt(ratio, ".2f"),
                verdict(ratio <= LOOKUP_TARGET),
            ]
        )
    title = (
        f"3. PrefixIndex.lookup in-process, entries of {sum(LOOKUP_TAIL_TOKENS) // 2 + 500} "
        f"tokens on average ({LOOKUP_SYSTEMS} system prompts of {LOOKUP_SYSTEM_TOKENS}), "
        f"{result['rounds']} rounds x {result['lookups_per_sample']} lookups per size "
        "(median us per lookup; ratio: median of per-round ratios)."
    )
    return title + "\n" + render_table(header, rows)

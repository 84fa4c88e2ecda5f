"""Family 4 of ``bench_engine.py``: 200 requests with shared prefixes against a small
``prefix_cache_bytes``, ``status`` sampled meanwhile: the cache never over its budget,
hits, misses, evictions, tokens reused and the runner's peak RSS.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

from tokenizers import Tokenizer

from common import fmt, verdict
from engine_chat import system_prompt
from engine_common import (
    ours_request,
)
from engine_concurrency import run_together
from supervisor.client import Client
from supervisor.figures import render_table
from supervisor.system import process_peak_rss

EVICTION_MODEL_NAME = "shared"
EVICTION_BUDGET_BYTES = 1 << 20  # tiny's KV: 512 B per token slot; a few entries fit
EVICTION_SYSTEMS = 10
EVICTION_SYSTEM_TOKENS = 200
EVICTION_CLIENTS = 4
EVICTION_TOKENS = 8
STATUS_PERIOD_S = 0.05


@contextlib.contextmanager
def status_sampler(client: Client, name: str) -> Iterator[list[dict[str, Any]]]:
    """Read ``status`` every STATUS_PERIOD_S on a thread while the block runs; yields the
    list the samples go to. The thread ends (and is joined) when the block ends."""
    samples: list[dict[str, Any]] = []
    stop = threading.Event()

    def sample() -> None:
        started = time.perf_counter()
        while not stop.is_set():
            runner = next(r for r in client.status().runners if r.name == name)
            cache = runner.prefix_cache
            samples.append(
                {
                    "t_s": time.perf_counter() - started,
                    "rss_bytes": runner.rss_bytes,
                    "mlx_peak_bytes": runner.mlx_peak_bytes,
                    "active_requests": runner.active_requests,
                    **(
                        {}
                        if cache is None
                        else {
                            "entries": cache.entries,
                            "bytes": cache.bytes,
                            "budget_bytes": cache.budget_bytes,
                            "hits": cache.hits,
                            "misses": cache.misses,
                            "evictions": cache.evictions,
                            "tokens_reused": cache.tokens_reused,
                        }
                    ),
                }
            )
            stop.wait(STATUS_PERIOD_S)

    thread = threading.Thread(target=sample, name="status-sampler")
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def eviction_family(
    client: Client, tokenizer: Tokenizer, requests: int, budget: int
) -> dict[str, Any]:
    """``requests`` chat requests over EVICTION_CLIENTS clients, each a random one of
    EVICTION_SYSTEMS system prompts and a random user line."""
    systems = [
        system_prompt(tokenizer, EVICTION_SYSTEM_TOKENS, 100 + k)[0]
        for k in range(EVICTION_SYSTEMS)
    ]
    rng = random.Random("eviction")
    words = (
        "please",
        "check",
        "order",
        "status",
        "today",
        "my",
        "account",
        "why",
        "late",
        "refund",
        "number",
        "help",
        "thanks",
        "again",
        "invoice",
        "address",
    )
    plan = [
        (rng.randrange(EVICTION_SYSTEMS), " ".join(rng.choices(words, k=rng.randint(4, 16))))
        for _ in range(requests)
    ]
    chunks = [plan[c::EVICTION_CLIENTS] for c in range(EVICTION_CLIENTS)]

    def client_loop(part: list[tuple[int, str]]) -> list[dict[str, Any]]:
        done = []
        for system, user in part:
            messages = [
                {"role": "system", "content": systems[system]},
                {"role": "user", "content": user},
            ]
            sample = ours_request(
                client, EVICTION_MODEL_NAME, messages=messages, max_tokens=EVICTION_TOKENS
            )
            done.append({"system": system, **sample.record()})
        return done

    started = time.perf_counter()
    with status_sampler(client, EVICTION_MODEL_NAME) as samples:
        per_client = run_together([lambda part=part: client_loop(part) for part in chunks])
    wall_s = time.perf_counter() - started
    runner = next(r for r in client.status().runners if r.name == EVICTION_MODEL_NAME)
    assert runner.pid is not None and runner.prefix_cache is not None
    peak_rss = process_peak_rss(runner.pid)  # VmHWM; None where there is no /proc
    final = runner.prefix_cache
    completed = [r for part in per_client for r in part]
    seen = [s["bytes"] for s in samples if "bytes" in s]
    return {
        "requests": requests,
        "completed": len(completed),
        "clients": EVICTION_CLIENTS,
        "wall_s": wall_s,
        "budget_bytes_configured": budget,
        "budget_bytes_reported": final.budget_bytes,
        "status_samples": len(samples),
        "max_bytes_seen": max(seen) if seen else None,
        "max_entries_seen": max((s["entries"] for s in samples if "entries" in s), default=None),
        "over_budget_samples": sum(b > final.budget_bytes for b in seen),
        "final": {
            "entries": final.entries,
            "bytes": final.bytes,
            "hits": final.hits,
            "misses": final.misses,
            "evictions": final.evictions,
            "tokens_reused": final.tokens_reused,
        },
        "prompt_tokens_total": sum(r["prompt_tokens"] for r in completed),
        "runner_pid": runner.pid,
        "runner_peak_rss_bytes": peak_rss,
        "runner_rss_bytes_end": runner.rss_bytes,
        "mlx_peak_bytes": runner.mlx_peak_bytes,
        "samples": samples,
        "request_samples": completed,
    }


def eviction_table(e: dict[str, Any]) -> str:
    f = e["final"]
    ok = e["max_bytes_seen"] is not None and e["max_bytes_seen"] <= e["budget_bytes_reported"]
    kib = 1 / 1024
    rows = [
        [
            "requests completed",
            f"{e['completed']}/{e['requests']} ({e['clients']} clients, {e['wall_s']:.1f} s)",
        ],
        ["status samples", f"{e['status_samples']} (every {STATUS_PERIOD_S * 1e3:.0f} ms)"],
        [
            "max prefix cache seen",
            f"{fmt(e['max_bytes_seen'], '.0f', kib, ' KiB')} of "
            f"{fmt(e['budget_bytes_reported'], '.0f', kib, ' KiB')} budget "
            f"({e['over_budget_samples']} samples over): {verdict(ok)}",
        ],
        ["max entries seen", str(e["max_entries_seen"])],
        ["hits / misses", f"{f['hits']} / {f['misses']}"],
        ["evictions", str(f["evictions"])],
        ["tokens reused", f"{f['tokens_reused']} of {e['prompt_tokens_total']} prompt tokens"],
        ["runner peak RSS (VmHWM)", fmt(e["runner_peak_rss_bytes"], ".0f", 1 / 2**20, " MiB")],
    ]
    title = (
        f"4. {e['requests']} chat requests on builtin:tiny, {EVICTION_SYSTEMS} system "
        f"prompts x random user lines, prefix_cache_bytes = {e['budget_bytes_configured']}"
    )
    return title + "\n" + render_table(None, rows)

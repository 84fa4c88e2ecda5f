"""The runner's engine (continuous batching, KV prefix cache) next to ``mlx_lm.server``.

Usage::

    python bench/bench_engine.py [--quick] [--only chat,concurrency,lookup,eviction]
                                 [--out bench/results/engine.json]

One run starts a private daemon and, per model, ``python -m mlx_lm.server`` on the same
model directory (its defaults: prompt cache of 10 sequences, batching), and measures:

1. **chat**: a multi-turn chat (a long system prompt, then turns that each append the
   answer that side returned and a new user line; greedy). Per turn, time to first
   token (client-side, to the first non-empty piece of text): ours / mlx_lm.server
   (target <= 0.8 from turn 2), ours / ours with ``cache=False`` on every request (a
   second conversation; target <= 0.2 from turn 3), and the prompt tokens each side
   computed (ours: ``prompt_tokens - cached_tokens``; mlx_lm.server:
   ``usage.prompt_tokens_details.cached_tokens``). The three sides take turns, in an
   order that rotates every turn. After each of our answers our runner prefills that
   chat's next turn while idle (next-turn prefill); every request, on any side, is sent
   once it has (a person replies later than that; the table says how long it took and
   how many tokens it computed ahead), so no side is timed beside it. builtin:tiny runs
   the issue's workload (a ~1,000-token system prompt, 8 turns, 16 tokens per answer).
   builtin:small runs a scaled-down one (~96 tokens, 6 turns, 8 tokens; --small-* to
   change it): on 2 shared CPU cores it
   prefills 3-9 tokens/s, so one uncached 1,000-token prompt takes 2-6 minutes, the
   issue's 8-turn run without the cache would take an hour, and a prefill chunk longer
   than ``prefill_stall_s`` (120 s) gets the runner killed as stalled.
2. **concurrency**: 4 and 8 clients started at the same moment (threads, a barrier),
   distinct raw prompts, 64 tokens each, on both sides in turn: aggregate tokens/s
   (ours / theirs, target >= 1.0) and the slowest client's TTFT (ours / theirs, target
   <= 1.0). builtin:tiny and builtin:small (tiny only with --quick). On small, beside
   it: the bf16 batch mismatch, 4 greedy requests served together vs each alone on our
   daemon (``cache=False``), compared piece by piece (one streamed piece per token).
3. **lookup**: ``runner.prefix_index.PrefixIndex.lookup`` in this process, with 10,
   100 and 1,000 stored chat-like entries of 1,000-2,000 tokens; the same queries for
   each size; us per lookup and the ratio 1000 / 10 (target <= 2).
4. **eviction**: 200 chat requests (10 system prompts x random user lines, 4 clients)
   on builtin:tiny with a small ``prefix_cache_bytes``; ``status`` read every 50 ms: the
   largest prefix-cache size seen against its budget (must never exceed it), hits,
   misses, evictions and tokens reused at the end, and the runner's peak RSS (VmHWM).

Order: 3, 4, then per model (tiny, small) 1 and 2. The machine is shared and noisy:
every figure is a ratio of things measured in this run, the sides alternating. Tables go
to stdout as each family ends, progress to stderr; the JSON (rewritten after each family,
``complete`` true at the end) has the machine, the settings and every raw sample. See
bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    Daemon,
    fmt,
    mlx_device,
    mlx_lm_server,
    note,
    render_table,
    runner_info,
    verdict,
    write_json,
)
from common import machine_info as common_machine_info
from runner.builtin import ensure_builtin_model
from runner.prefix_index import PrefixIndex
from supervisor.client import Client

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "results" / "engine.json"
TINY, SMALL = "builtin:tiny", "builtin:small"
SHORT_NAMES = {TINY: "tiny", SMALL: "small"}
REQUEST_TIMEOUT_S = 900.0  # one request, either side: a cold prefill on small takes minutes

OURS, THEIRS, OURS_NO_CACHE = "ours", "theirs", "ours_no_cache"
CHAT_SIDES = (OURS, THEIRS, OURS_NO_CACHE)
CHAT_TTFT_TARGET = 0.8  # ours / theirs, from turn 2
CHAT_TTFT_FROM_TURN = 2
CACHE_TTFT_TARGET = 0.2  # ours / ours without the cache, from turn 3
CACHE_TTFT_FROM_TURN = 3

CONCURRENT_CLIENTS = (4, 8)
CONCURRENT_TOKENS = 64
MISMATCH_REQUESTS = 4
MISMATCH_TOKENS = 32

LOOKUP_SIZES = (10, 100, 1000)
LOOKUP_SYSTEMS = 10  # distinct system prompts the stored entries start with
LOOKUP_SYSTEM_TOKENS = 500
LOOKUP_TAIL_TOKENS = (500, 1500)  # after the system prompt: entries of 1,000-2,000 tokens
LOOKUP_QUERIES = 10  # distinct queries, the same for every size
LOOKUP_VOCAB = 32_000
LOOKUP_TARGET = 2.0  # 1000 entries / 10 entries

EVICTION_MODEL_NAME = "shared"
EVICTION_BUDGET_BYTES = 1 << 20  # tiny's KV: 512 B per token slot; a few entries fit
EVICTION_SYSTEMS = 10
EVICTION_SYSTEM_TOKENS = 200
EVICTION_CLIENTS = 4
EVICTION_TOKENS = 8
STATUS_PERIOD_S = 0.05


def median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(statistics.median(present)) if present else None


def quotient(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


# --- one request on each side -------------------------------------------------------


@dataclass
class Sample:
    """One request as the client saw it. Times are ``time.perf_counter`` values."""

    side: str
    sent_at: float
    first_text_at: float | None
    ended_at: float
    text: str
    pieces: list[tuple[int, str]]  # (tokens so far, text) per streamed piece
    prompt_tokens: int
    cached_tokens: int | None
    generation_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ttft_s(self) -> float | None:
        """From the call to the first piece with text in it."""
        return None if self.first_text_at is None else self.first_text_at - self.sent_at

    @property
    def computed_tokens(self) -> int | None:
        """Prompt tokens this side computed (not taken from its cache)."""
        return None if self.cached_tokens is None else self.prompt_tokens - self.cached_tokens

    def record(self) -> dict[str, Any]:
        return {
            "side": self.side,
            "ttft_s": self.ttft_s,
            "duration_s": self.ended_at - self.sent_at,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "computed_tokens": self.computed_tokens,
            "generation_tokens": self.generation_tokens,
            "text": self.text,
            "pieces": len(self.pieces),
            **self.extra,
        }


def ours_request(
    client: Client,
    name: str,
    *,
    prompt: str | None = None,
    messages: list[dict[str, str]] | None = None,
    max_tokens: int,
    cache: bool = True,
    side: str = OURS,
) -> Sample:
    """One greedy generation through our daemon (``Client.generate``), streamed."""
    pieces: list[tuple[int, str]] = []
    first_text_at = None
    sent_at = time.perf_counter()
    with client.generate(
        name, prompt, messages=messages, max_tokens=max_tokens, temperature=0.0, cache=cache
    ) as gen:
        for piece in gen:
            if piece and first_text_at is None:
                first_text_at = time.perf_counter()
            pieces.append((gen.tokens, piece))
    ended_at = time.perf_counter()
    done = gen.done
    assert done is not None
    return Sample(
        side=side,
        sent_at=sent_at,
        first_text_at=first_text_at,
        ended_at=ended_at,
        text="".join(p for _, p in pieces),
        pieces=pieces,
        prompt_tokens=done.prompt_tokens,
        cached_tokens=done.cached_tokens,
        generation_tokens=done.generation_tokens,
        extra={
            "first_frame_ttft_s": gen.ttft_s,  # the Client's own: first frame, even if empty
            "runner_ttft_s": done.ttft_s,
            "batched": done.batched,
            "finish_reason": done.finish_reason,
        },
    )


def theirs_request(
    port: int,
    *,
    prompt: str | None = None,
    messages: list[dict[str, str]] | None = None,
    max_tokens: int,
) -> Sample:
    """One greedy generation from mlx_lm.server, streamed (SSE) with usage at the end:
    ``/v1/chat/completions`` for ``messages``, ``/v1/completions`` for ``prompt``."""
    body: dict[str, Any] = {
        "model": "default_model",
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if messages is not None:
        path, body["messages"] = "/v1/chat/completions", messages
    else:
        path, body["prompt"] = "/v1/completions", prompt
    payload = json.dumps(body).encode()
    pieces: list[tuple[int, str]] = []
    usage: dict[str, Any] | None = None
    keepalives = 0
    first_text_at = None
    sent_at = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        connection.request("POST", path, payload, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"mlx_lm.server answered {response.status}: {response.read()!r}")
        for raw in response:
            if raw.startswith(b": keepalive"):
                keepalives += 1
            if not raw.startswith(b"data: "):
                continue
            data = raw[len(b"data: ") :].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content") if messages else choice.get("text")
                if piece:
                    if first_text_at is None:
                        first_text_at = time.perf_counter()
                    pieces.append((len(pieces) + 1, piece))
    finally:
        connection.close()
    ended_at = time.perf_counter()
    if usage is None:
        raise RuntimeError("mlx_lm.server sent no usage (stream_options.include_usage)")
    details = usage.get("prompt_tokens_details") or {}
    return Sample(
        side=THEIRS,
        sent_at=sent_at,
        first_text_at=first_text_at,
        ended_at=ended_at,
        text="".join(p for _, p in pieces),
        pieces=pieces,
        prompt_tokens=int(usage["prompt_tokens"]),
        cached_tokens=details.get("cached_tokens"),
        generation_tokens=int(usage["completion_tokens"]),
        extra={"keepalive_lines": keepalives},
    )


# --- the two servers ----------------------------------------------------------------


def warm_up(client: Client, name: str, port: int) -> None:
    """One short request on each side (mlx_lm.server loads its model in the background
    after /health answers; both compile their first kernels)."""
    ours_request(client, name, prompt="Warm up.", max_tokens=2)
    theirs_request(port, prompt="Warm up.", max_tokens=2)


# --- 1. multi-turn chat -------------------------------------------------------------


@dataclass(frozen=True)
class ChatSettings:
    system_tokens: int
    turns: int
    answer_tokens: int
    epochs: int  # whole conversations, each with a system prompt of its own


TOPICS = ("invoices", "shipping", "refunds", "passwords", "warranties", "meetings", "reports")


def system_prompt(tokenizer: Tokenizer, target_tokens: int, session: int) -> tuple[str, int]:
    """Numbered sentences (deterministic; ``session`` makes the first tokens differ, so no
    cache holds any of it) up to ``target_tokens`` tokens; returns it and its count."""
    lines = [f"Session {session}. You are a careful support assistant."]
    count = 0
    i = 0
    while count < target_tokens:
        i += 1
        topic = TOPICS[(i * 3 + session) % len(TOPICS)]
        lines.append(f"Rule {i}: for questions on {topic}, answer briefly and cite rule {i}.")
        count = len(tokenizer.encode(" ".join(lines), add_special_tokens=False).ids)
    text = " ".join(lines)
    return text, count


def user_line(turn: int) -> str:
    return f"Question {turn}: what does rule {turn * 7} say about {TOPICS[turn % len(TOPICS)]}?"


NEXT_TURN_POLL_S = 0.002


def next_turn_prefilled(client: Client, name: str) -> tuple[float, int]:
    """Wait until our runner has prefilled the next turns it owes (it says so in its
    status: ``next_turn.pending``); returns the wait and the tokens it has computed
    ahead so far. The daemon pushes no event for it, so its status is polled."""
    started = time.perf_counter()
    while True:
        stats = runner_info(client, name).next_turn
        if stats is None or stats.pending == 0:
            return time.perf_counter() - started, stats.tokens if stats is not None else 0
        if time.perf_counter() - started > REQUEST_TIMEOUT_S:
            raise TimeoutError(f"{name}'s next-turn prefill did not end: {stats}")
        time.sleep(NEXT_TURN_POLL_S)


def chat_family(
    client: Client, name: str, port: int, tokenizer: Tokenizer, settings: ChatSettings
) -> dict[str, Any]:
    """Three conversations in step, one turn of each in a rotating order.

    After each of our answers the runner prefills that chat's next turn while it is
    idle; the next request (on any side) goes once it has, as a person's reply comes
    seconds later. No side's request meets that work: every side is timed on a quiet
    machine. What it took (``next_turn_ready_s``, ``ahead_tokens``) is recorded."""
    samples: list[dict[str, Any]] = []
    system_counts = []
    _, ahead_before = next_turn_prefilled(client, name)
    for epoch in range(settings.epochs):
        system, system_count = system_prompt(tokenizer, settings.system_tokens, epoch)
        system_counts.append(system_count)
        history = {side: [{"role": "system", "content": system}] for side in CHAT_SIDES}
        ahead_of_this_turn: dict[str, Any] = {}
        for turn in range(1, settings.turns + 1):
            shift = (turn - 1 + epoch) % len(CHAT_SIDES)
            order = CHAT_SIDES[shift:] + CHAT_SIDES[:shift]
            texts = {}
            for side in order:
                messages = [*history[side], {"role": "user", "content": user_line(turn)}]
                if side == THEIRS:
                    sample = theirs_request(
                        port, messages=messages, max_tokens=settings.answer_tokens
                    )
                else:
                    sample = ours_request(
                        client,
                        name,
                        messages=messages,
                        max_tokens=settings.answer_tokens,
                        cache=side == OURS,
                        side=side,
                    )
                history[side] = [*messages, {"role": "assistant", "content": sample.text}]
                texts[side] = sample.text
                record = {"epoch": epoch, "turn": turn, "order": list(order), **sample.record()}
                ready_s, ahead = next_turn_prefilled(client, name)
                if side == OURS:  # this turn's start, prefilled after the last answer
                    record.update(ahead_of_this_turn)
                    ahead_of_this_turn = {"next_turn_ready_s": ready_s,
                                          "ahead_tokens": ahead - ahead_before}  # fmt: skip
                ahead_before = ahead
                samples.append(record)
            note(
                f"  chat {name} epoch {epoch} turn {turn}: "
                + ", ".join(
                    f"{s['side']} {fmt(s['ttft_s'], '.0f', 1e3, ' ms')}" for s in samples[-3:]
                )
            )
    return {
        "settings": asdict(settings),
        "system_prompt_tokens": system_counts,
        "samples": samples,
        "turns": chat_summary(samples, settings),
    }


def chat_summary(samples: list[dict[str, Any]], settings: ChatSettings) -> list[dict[str, Any]]:
    """Per turn: the median TTFT of each side over epochs, the medians of the per-epoch
    ratios, and the prompt tokens each side computed (medians)."""
    rows = []
    for turn in range(1, settings.turns + 1):
        by_side: dict[str, list[dict[str, Any]]] = {side: [] for side in CHAT_SIDES}
        for s in samples:
            if s["turn"] == turn:
                by_side[s["side"]].append(s)
        epochs = range(len(by_side[OURS]))
        vs_theirs = [
            quotient(by_side[OURS][e]["ttft_s"], by_side[THEIRS][e]["ttft_s"]) for e in epochs
        ]
        vs_no_cache = [
            quotient(by_side[OURS][e]["ttft_s"], by_side[OURS_NO_CACHE][e]["ttft_s"])
            for e in epochs
        ]
        row: dict[str, Any] = {"turn": turn}
        for side in CHAT_SIDES:
            row[f"ttft_{side}_s"] = median([s["ttft_s"] for s in by_side[side]])
            row[f"prompt_tokens_{side}"] = median([s["prompt_tokens"] for s in by_side[side]])
            row[f"computed_tokens_{side}"] = median([s["computed_tokens"] for s in by_side[side]])
        row["runner_ttft_ours_s"] = median([s["runner_ttft_s"] for s in by_side[OURS]])
        row["ahead_tokens_ours"] = median([s.get("ahead_tokens") for s in by_side[OURS]])
        row["next_turn_ready_ours_s"] = median([s.get("next_turn_ready_s") for s in by_side[OURS]])
        row["ours_over_theirs"] = median(vs_theirs)
        row["cache_over_no_cache"] = median(vs_no_cache)
        row["same_text_ours_theirs"] = all(
            by_side[OURS][e]["text"] == by_side[THEIRS][e]["text"] for e in epochs
        )
        row["target_ours_over_theirs"] = (
            None
            if turn < CHAT_TTFT_FROM_TURN or row["ours_over_theirs"] is None
            else row["ours_over_theirs"] <= CHAT_TTFT_TARGET
        )
        row["target_cache_over_no_cache"] = (
            None
            if turn < CACHE_TTFT_FROM_TURN or row["cache_over_no_cache"] is None
            else row["cache_over_no_cache"] <= CACHE_TTFT_TARGET
        )
        rows.append(row)
    return rows


def chat_table(model: str, result: dict[str, Any]) -> str:
    settings = result["settings"]
    header = [
        "turn",
        "prompt tok",
        "TTFT ours",
        "(runner)",
        "theirs",
        "ours no-cache",
        "ours/theirs",
        "target<=0.8",
        "cache/no-cache",
        "target<=0.2",
        "computed: ours",
        "theirs",
        "no-cache",
        "ours ahead",
        "(ready after)",
        "same text",
    ]
    rows = []
    for r in result["turns"]:
        rows.append(
            [
                str(r["turn"]),
                fmt(r[f"prompt_tokens_{OURS}"], ".0f"),
                fmt(r[f"ttft_{OURS}_s"], ".1f", 1e3, " ms"),
                fmt(r["runner_ttft_ours_s"], ".1f", 1e3, " ms"),
                fmt(r[f"ttft_{THEIRS}_s"], ".1f", 1e3, " ms"),
                fmt(r[f"ttft_{OURS_NO_CACHE}_s"], ".1f", 1e3, " ms"),
                fmt(r["ours_over_theirs"], ".2f"),
                verdict(r["target_ours_over_theirs"]),
                fmt(r["cache_over_no_cache"], ".2f"),
                verdict(r["target_cache_over_no_cache"]),
                fmt(r[f"computed_tokens_{OURS}"], ".0f"),
                fmt(r[f"computed_tokens_{THEIRS}"], ".0f"),
                fmt(r[f"computed_tokens_{OURS_NO_CACHE}"], ".0f"),
                fmt(r["ahead_tokens_ours"], ".0f"),
                fmt(r["next_turn_ready_ours_s"], ".0f", 1e3, " ms"),
                "yes" if r["same_text_ours_theirs"] else "no",
            ]
        )
    title = (
        f"1. Multi-turn chat, {model}: system prompt {result['system_prompt_tokens'][0]} "
        f"tokens, {settings['turns']} turns x {settings['answer_tokens']} tokens, greedy, "
        f"{settings['epochs']} conversation(s) per side (medians; ratios: of per-"
        "conversation ratios). TTFT = client-side, to the first non-empty text; (runner) = "
        "the runner's own, from receiving the request to its first token. Ours ahead = "
        "the tokens of that turn our runner prefilled after the answer before it (the next "
        "turn's start), done (ready after) that long after the answer; every request was "
        "sent after that, on each side."
    )
    return title + "\n" + render_table(header, rows)


# --- 2. concurrent clients ----------------------------------------------------------


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


# --- 3. prefix lookup ---------------------------------------------------------------


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


# --- 4. eviction under a small budget -----------------------------------------------


def vm_hwm_bytes(pid: int) -> int | None:
    """The process's peak RSS (VmHWM, /proc), or None where there is no /proc."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


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
    peak_rss = vm_hwm_bytes(runner.pid)
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


# --- the run ------------------------------------------------------------------------


ENGINE_SOURCES = ("runner/engine.py", "runner/prefix_cache.py", "runner/prefix_index.py")


def source_hashes() -> dict[str, str]:
    """sha256 (first 12 hex digits) of the engine's source files: the tree is shared and
    uncommitted, so the JSON says which code ran (read at the start and at the end)."""
    src = BENCH_DIR.parent / "src"
    return {
        name: hashlib.sha256((src / name).read_bytes()).hexdigest()[:12] for name in ENGINE_SOURCES
    }


def machine_info() -> dict[str, Any]:
    """The shared machine description, with the engine's source hashes (checked
    again at the end: a run whose engine changed under it says so)."""
    return {**common_machine_info(mlx_device()), "engine_sources_start": source_hashes()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: builtin:tiny only, fewer rounds (~2 min)"
    )
    parser.add_argument(
        "--only", default="chat,concurrency,lookup,eviction", help="comma-separated families to run"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--small-system-tokens",
        type=int,
        default=96,
        help="builtin:small chat: system prompt tokens (the issue: 1000)",
    )
    parser.add_argument(
        "--small-turns", type=int, default=6, help="builtin:small chat: turns (the issue: 8)"
    )
    parser.add_argument(
        "--small-answer-tokens",
        type=int,
        default=8,
        help="builtin:small chat: tokens per answer (the issue: 16)",
    )
    parser.add_argument(
        "--small-epochs",
        type=int,
        default=1,
        help="builtin:small chat: conversations per side (~4 min each)",
    )
    parser.add_argument(
        "--small-rounds",
        type=int,
        default=2,
        help="builtin:small concurrency: rounds per client count (~2.5 min each)",
    )
    parser.add_argument(
        "--eviction-requests",
        type=int,
        default=None,
        help="family 4 requests (default 200; 60 with --quick)",
    )
    args = parser.parse_args()
    families = set(args.only.split(","))
    models = [TINY] if args.quick else [TINY, SMALL]
    chat_settings = {
        TINY: ChatSettings(
            system_tokens=1000, turns=8, answer_tokens=16, epochs=1 if args.quick else 3
        ),
        SMALL: ChatSettings(
            args.small_system_tokens,
            args.small_turns,
            args.small_answer_tokens,
            epochs=args.small_epochs,
        ),
    }
    concurrency_rounds = {TINY: 1 if args.quick else 5, SMALL: args.small_rounds}
    lookup_rounds, lookup_count = (3, 300) if args.quick else (7, 2000)
    eviction_requests = args.eviction_requests or (60 if args.quick else 200)
    settings = {
        "quick": args.quick,
        "families": sorted(families),
        "models": models,
        "chat": {m: asdict(s) for m, s in chat_settings.items() if m in models},
        "concurrency": {
            "clients": CONCURRENT_CLIENTS,
            "tokens": CONCURRENT_TOKENS,
            "rounds": {m: concurrency_rounds[m] for m in models},
        },
        "mismatch": None
        if args.quick
        else {"requests": MISMATCH_REQUESTS, "tokens": MISMATCH_TOKENS, "model": SMALL},
        "lookup": {"sizes": LOOKUP_SIZES, "rounds": lookup_rounds, "lookups": lookup_count},
        "eviction": {
            "requests": eviction_requests,
            "clients": EVICTION_CLIENTS,
            "prefix_cache_bytes": EVICTION_BUDGET_BYTES,
            "tokens": EVICTION_TOKENS,
            "system_prompts": EVICTION_SYSTEMS,
        },
        "daemon_config": "hot_spare = false (no idle spare process beside the measurements)",
        "theirs": "python -m mlx_lm.server --model DIR --host 127.0.0.1 --port P (defaults)",
    }
    results: dict[str, Any] = {"machine": machine_info(), "settings": settings}
    started = time.perf_counter()

    def publish(table: str | None) -> None:
        """Print a family's table as soon as it is done, and save what we have so far:
        a run that fails late keeps the families before it (``complete`` says which)."""
        if table is not None:
            print(table + "\n", flush=True)
        results["wall_s"] = time.perf_counter() - started
        write_json(results, args.out)

    results["complete"] = False
    if "lookup" in families:
        note("3. prefix lookup (in-process)")
        results["lookup"] = lookup_family(lookup_rounds, lookup_count)
        publish(lookup_table(results["lookup"]))

    config = (
        "hot_spare = false\n\n[[models]]\n"
        f'name = "{EVICTION_MODEL_NAME}"\nmodel = "{TINY}"\n'
        f"prefix_cache_bytes = {EVICTION_BUDGET_BYTES}\n"
    )
    with (
        tempfile.TemporaryDirectory(prefix="mlx-bench-engine-") as tmp_name,
        contextlib.ExitStack() as stack,
    ):
        tmp = Path(tmp_name)
        client = Daemon.start(
            stack, tmp, "engine", config, client_timeout_s=REQUEST_TIMEOUT_S
        ).client
        if "eviction" in families:
            note(f"4. {eviction_requests} requests with a small prefix cache")
            tokenizer = Tokenizer.from_file(str(ensure_builtin_model(TINY) / "tokenizer.json"))
            client.load(TINY, EVICTION_MODEL_NAME)
            results["eviction"] = eviction_family(
                client, tokenizer, eviction_requests, EVICTION_BUDGET_BYTES
            )
            client.unload(EVICTION_MODEL_NAME)
            publish(eviction_table(results["eviction"]))
        results["chat"], results["concurrency"] = {}, {}
        for model in models if families & {"chat", "concurrency"} else []:
            model_dir = ensure_builtin_model(model)
            tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
            name = SHORT_NAMES[model]
            note(f"loading {model} in our daemon and in mlx_lm.server")
            client.load(model, name)
            with mlx_lm_server(model_dir, tmp / f"mlx_lm_server_{name}.log") as port:
                warm_up(client, name, port)
                if "chat" in families:
                    note(f"1. multi-turn chat on {model}")
                    results["chat"][model] = chat_family(
                        client, name, port, tokenizer, chat_settings[model]
                    )
                    publish(chat_table(model, results["chat"][model]))
                if "concurrency" in families:
                    note(f"2. concurrent clients on {model}")
                    results["concurrency"][model] = concurrency_family(
                        client, name, port, concurrency_rounds[model], CONCURRENT_TOKENS
                    )
                    publish(concurrency_table({model: results["concurrency"][model]}))
                    if model == SMALL:
                        note(f"2b. batch mismatch on {model}")
                        results["mismatch"] = mismatch_family(client, name, MISMATCH_TOKENS)
                        publish(mismatch_table(SMALL, results["mismatch"]))
            client.unload(name)
    results["complete"] = True
    results["machine"]["loadavg_end"] = list(os.getloadavg())
    results["machine"]["engine_sources_end"] = source_hashes()
    if results["machine"]["engine_sources_end"] != results["machine"]["engine_sources_start"]:
        note("WARNING: the engine's source files changed during the run (see the JSON)")
    publish(None)
    note(f"done in {results['wall_s']:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The daemon's OpenAI-compatible HTTP front next to ``mlx_lm.server``, and next to our socket.

Usage::

    python bench/bench_http.py [--quick] [--out bench/results/http.json]

One run starts a private daemon with its HTTP front on a free loopback port
(``MLX_SUPERVISOR_HTTP=127.0.0.1:0``; the base URL from ``status().supervisor.http``)
and, per model, ``python -m mlx_lm.server`` on the same model directory (its defaults),
and measures, on builtin:tiny (random weights) and builtin:smollm2 (a real 135M model):

1. **Through HTTP, ours vs mlx_lm.server**: ``POST /v1/chat/completions`` with
   ``stream: true`` (and ``stream_options.include_usage``), greedy (``temperature 0``),
   the same messages and ``max_tokens`` on both sides, one request at a time, the side
   that goes first alternating by round; every request on a new TCP connection (the
   reference server speaks HTTP/1.0 and closes each one), read with httpx.

   a. **Decode tokens/s of one stream**, client-side: (completion tokens - 1) / (last
      content chunk - first content chunk). Per round the ratio ours / theirs; the
      figure is the median of the per-round ratios (target >= 1.0). Beside it, the same
      request through our socket (``Client.generate``), to tell the HTTP layer from the
      runner, and from the first content chunk to the end: CPU seconds per token (ours:
      runner + daemon; theirs: mlx_lm.server) and how busy the process that computes
      was (its CPU seconds / wall time). The three take turns in all six orders.
   b. **Time to first token**, client-side from the request sent (connect included) to
      the first chunk with non-empty ``delta.content``, over N requests per side with a
      fresh prompt each: a counter at the very start of the system message, so neither
      side can reuse a cached prefix beyond the chat template's opening and the word
      before the counter (the cached tokens each side reported are shown). p50 and p99
      of each side and ours / theirs (target <= 1.0 for both).

   Both: the completion tokens of each side (they must match: greedy) and whether the
   texts are equal.
2. **Through our HTTP vs our socket**, builtin:tiny, on the same daemon and runner: the
   end-to-end time of short requests (``max_tokens`` 4; from the request sent to the
   response read to its end, client-side), p50 over ~50 requests per path, as a
   difference and a ratio against ``Client.generate`` (connect and hello included, as
   every socket request pays them). Paths: HTTP streamed on a new connection, HTTP
   streamed on a kept-alive connection, HTTP whole (``stream: false``) kept alive. The
   paths take turns in an order that rotates every request, each with a prompt of its
   own (no path reuses another's cached prefix).

The machine is shared and noisy: every figure is a ratio or a difference of things
measured in this run, the sides taking turns. The tables go to stdout at the end (also
those measured before a failure), progress to stderr; the JSON (rewritten after each
family, ``complete`` true at the end) has the machine, the settings and every raw
sample. The exit status is 1 when two sides' token counts differ anywhere (not for the
targets). See bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS_DIR,
    Daemon,
    children_left,
    cpu_s_each,
    cpu_time,
    load_average,
    machine_info,
    median,
    mlx_device,
    mlx_lm_server,
    ms,
    note,
    percentile,
    ratio,
    render_table,
    run_alternating,
    runner_info,
    signed_ms,
    verdict,
    write_json,
)
from runner.builtin import ensure_builtin_model
from supervisor.client import Client

DEFAULT_OUT = RESULTS_DIR / "http.json"
TINY, SMOLLM2 = "builtin:tiny", "builtin:smollm2"
SHORT_NAMES = {TINY: "tiny", SMOLLM2: "smollm2"}
REQUEST_TIMEOUT_S = 300.0
CHAT_PATH = "/v1/chat/completions"
THEIRS_MODEL = "default_model"  # mlx_lm.server: the model given with --model

OURS, THEIRS = "ours", "theirs"
DECODE_TARGET = 1.0  # ours / theirs, tokens/s: at least
TTFT_TARGET = 1.0  # ours / theirs, p50 and p99: at most

SOCKET = "socket"
HTTP_NEW, HTTP_KEEP, HTTP_WHOLE = "http_stream_new_conn", "http_stream_keepalive", "http_whole"
OVERHEAD_PATHS = (SOCKET, HTTP_NEW, HTTP_KEEP, HTTP_WHOLE)
PATH_LABELS = {
    SOCKET: "socket, Client.generate",
    HTTP_NEW: "HTTP stream, new connection",
    HTTP_KEEP: "HTTP stream, kept alive",
    HTTP_WHOLE: "HTTP stream: false, kept alive",
}

DECODE_USER = "Tell me a long story about a lighthouse keeper, her cat and a storm at sea."
TTFT_USER = "What is the capital of France?"


def messages_for(kind: str, index: int, user: str) -> list[dict[str, str]]:
    """A chat whose system message opens with ``kind`` and a counter, so that no two
    requests share more than the tokens before the counter (the chat template's opening
    and ``kind``)."""
    return [
        {"role": "system", "content": f"{kind} {index}. You are a helpful assistant."},
        {"role": "user", "content": user},
    ]


# --- one request ----------------------------------------------------------------------


@dataclass
class Sample:
    """One request as the client saw it. Times are ``time.perf_counter`` values."""

    side: str
    sent_at: float
    first_text_at: float | None
    last_text_at: float | None
    ended_at: float
    text: str
    content_chunks: int
    prompt_tokens: int
    cached_tokens: int | None
    completion_tokens: int
    finish_reason: str | None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ttft_s(self) -> float | None:
        """From the request sent (connect included) to the first piece with text."""
        return None if self.first_text_at is None else self.first_text_at - self.sent_at

    @property
    def total_s(self) -> float:
        """From the request sent to the response read to its end."""
        return self.ended_at - self.sent_at

    @property
    def decode_tps(self) -> float | None:
        """(completion tokens - 1) / (last content chunk - first content chunk): the
        tokens after the first one, over the time they took to arrive."""
        if self.first_text_at is None or self.last_text_at is None:
            return None
        span = self.last_text_at - self.first_text_at
        return (self.completion_tokens - 1) / span if span > 0 else None

    def record(self) -> dict[str, Any]:
        return {
            "side": self.side,
            "ttft_s": self.ttft_s,
            "total_s": self.total_s,
            "decode_s": None
            if self.first_text_at is None or self.last_text_at is None
            else self.last_text_at - self.first_text_at,
            "decode_tps": self.decode_tps,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "content_chunks": self.content_chunks,
            "finish_reason": self.finish_reason,
            "text": self.text,
            **self.extra,
        }


def http_chat(
    http: httpx.Client,
    url: str,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    *,
    side: str,
    stream: bool = True,
    at_first: Callable[[], Any] | None = None,
) -> Sample:
    """One greedy chat completion over HTTP, read to the end of the response.

    Streamed: SSE ``data:`` lines; the times of the first and last chunks with non-empty
    ``delta.content``; usage from the last chunk (``stream_options.include_usage``).
    Whole: one JSON body (no first-token time). ``at_first`` is called when the first
    content arrives (after its time is taken); what it returns goes to ``extra``."""
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    finish_reason = None
    first_text_at = last_text_at = None
    comments = 0
    extra: dict[str, Any] = {}
    sent_at = time.perf_counter()
    with http.stream("POST", url + CHAT_PATH, json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{side}: {url} answered {response.status_code}: {response.text}")
        if stream:
            for line in response.iter_lines():  # to the end: the connection can be reused
                if line.startswith(":"):
                    comments += 1
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :].strip()
                if data == "[DONE]":
                    continue
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(f"{side}: error in the stream: {event['error']}")
                usage = event.get("usage") or usage
                for choice in event.get("choices", []):
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        last_text_at = time.perf_counter()
                        if first_text_at is None:
                            first_text_at = last_text_at
                            if at_first is not None:
                                extra["at_first"] = at_first()
                        pieces.append(piece)
                    finish_reason = choice.get("finish_reason") or finish_reason
        else:
            whole = json.loads(response.read())
            usage = whole["usage"]
            choice = whole["choices"][0]
            pieces.append(choice["message"]["content"] or "")
            finish_reason = choice.get("finish_reason")
    ended_at = time.perf_counter()
    if usage is None:
        raise RuntimeError(f"{side}: no usage in the response (stream_options.include_usage)")
    details = usage.get("prompt_tokens_details") or {}
    return Sample(
        side=side,
        sent_at=sent_at,
        first_text_at=first_text_at,
        last_text_at=last_text_at,
        ended_at=ended_at,
        text="".join(pieces),
        content_chunks=len(pieces) if stream else 0,
        prompt_tokens=int(usage["prompt_tokens"]),
        cached_tokens=details.get("cached_tokens"),
        completion_tokens=int(usage["completion_tokens"]),
        finish_reason=finish_reason,
        extra={**extra, "sse_comments": comments},
    )


def socket_chat(
    client: Client,
    name: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    at_first: Callable[[], Any] | None = None,
) -> Sample:
    """One greedy chat completion through our socket (``Client.generate``), streamed to
    ``done``; the time starts before the call (connect and hello included); ``at_first``
    as for :func:`http_chat`."""
    pieces = []
    extra: dict[str, Any] = {}
    first_text_at = last_text_at = None
    sent_at = time.perf_counter()
    with client.generate(name, messages=messages, max_tokens=max_tokens, temperature=0.0) as gen:
        for piece in gen:
            if piece:
                last_text_at = time.perf_counter()
                if first_text_at is None:
                    first_text_at = last_text_at
                    if at_first is not None:
                        extra["at_first"] = at_first()
                pieces.append(piece)
    ended_at = time.perf_counter()
    done = gen.done
    assert done is not None
    return Sample(
        side=SOCKET,
        sent_at=sent_at,
        first_text_at=first_text_at,
        last_text_at=last_text_at,
        ended_at=ended_at,
        text="".join(pieces),
        content_chunks=len(pieces),
        prompt_tokens=done.prompt_tokens,
        cached_tokens=done.cached_tokens,
        completion_tokens=done.generation_tokens,
        finish_reason=done.finish_reason,
        extra=extra,
    )


@dataclass
class Sides:
    """Where each side is: our daemon's HTTP base URL and socket client, the model's name
    there, and mlx_lm.server's base URL; the HTTP clients (one that opens a new
    connection per request, one that keeps them alive)."""

    ours_url: str
    theirs_url: str
    client: Client
    name: str
    fresh: httpx.Client
    pooled: httpx.Client
    pids: dict[str, int]  # runner, daemon, server: whose CPU time the decode rounds read

    def ours(self, messages: list[dict[str, str]], max_tokens: int, **kwargs: Any) -> Sample:
        return http_chat(
            self.fresh, self.ours_url, self.name, messages, max_tokens, side=OURS, **kwargs
        )

    def theirs(self, messages: list[dict[str, str]], max_tokens: int, **kwargs: Any) -> Sample:
        return http_chat(
            self.fresh, self.theirs_url, THEIRS_MODEL, messages, max_tokens, side=THEIRS, **kwargs
        )

    def path(
        self, path: str, messages: list[dict[str, str]], max_tokens: int, **kwargs: Any
    ) -> Sample:
        """One request to our daemon through one of OVERHEAD_PATHS."""
        if path == SOCKET:
            return socket_chat(self.client, self.name, messages, max_tokens, **kwargs)
        http = self.fresh if path == HTTP_NEW else self.pooled
        return http_chat(
            http, self.ours_url, self.name, messages, max_tokens, side=path,
            stream=path != HTTP_WHOLE, **kwargs,
        )  # fmt: skip


def warm_up(sides: Sides) -> None:
    """Two short requests on each side, untimed (mlx_lm.server loads its model after
    ``/health`` already answers; both compile their first kernels)."""
    for i in range(2):
        sides.ours(messages_for("Warm-up", i, TTFT_USER), 2)
        sides.theirs(messages_for("Warm-up", i, TTFT_USER), 2)


def quotient(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def pair_record(index: int, ours: Sample, theirs: Sample) -> dict[str, Any]:
    return {
        "index": index,
        "first": OURS if index % 2 == 0 else THEIRS,
        OURS: ours.record(),
        THEIRS: theirs.record(),
        "same_tokens": ours.completion_tokens == theirs.completion_tokens,
        "same_text": ours.text == theirs.text,
    }


def agreement(pairs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Token counts and texts of the two sides, pair by pair."""
    return {
        "same_tokens": sum(p["same_tokens"] for p in pairs),
        "same_text": sum(p["same_text"] for p in pairs),
        "pairs": len(pairs),
        "completion_tokens_ours": sorted({p[OURS]["completion_tokens"] for p in pairs}),
        "completion_tokens_theirs": sorted({p[THEIRS]["completion_tokens"] for p in pairs}),
        "prompt_tokens_ours": median(p[OURS]["prompt_tokens"] for p in pairs),
        "prompt_tokens_theirs": median(p[THEIRS]["prompt_tokens"] for p in pairs),
    }


# --- 1a. decode tokens/s --------------------------------------------------------------


# Every order of the three sides, arranged so that ours and theirs take turns at going
# first of the two (even rounds: ours before theirs); the socket's place moves too.
DECODE_ORDERS = (
    (OURS, THEIRS, SOCKET), (THEIRS, OURS, SOCKET), (OURS, SOCKET, THEIRS),
    (THEIRS, SOCKET, OURS), (SOCKET, OURS, THEIRS), (SOCKET, THEIRS, OURS),
)  # fmt: skip


def decode_family(sides: Sides, rounds: int, max_tokens: int) -> dict[str, Any]:
    """``rounds`` rounds of one long streamed request on each side (ours over HTTP,
    mlx_lm.server, and ours through the socket, to tell the HTTP layer from the runner),
    in the orders of DECODE_ORDERS; a fresh prompt per round, the same for every side.
    Around each request, the CPU seconds of our runner, our daemon and mlx_lm.server."""
    pairs = []
    for r in range(rounds):
        messages = messages_for("Story", r, DECODE_USER)
        order = DECODE_ORDERS[r % len(DECODE_ORDERS)]
        samples = {}
        for side in order:
            at_first = functools.partial(cpu_s_each, sides.pids)
            if side == OURS:
                sample = sides.ours(messages, max_tokens, at_first=at_first)
            elif side == THEIRS:
                sample = sides.theirs(messages, max_tokens, at_first=at_first)
            else:
                sample = sides.path(SOCKET, messages, max_tokens, at_first=at_first)
            after = cpu_s_each(sides.pids)
            first = sample.extra.pop("at_first", {})
            sample.extra["decode_cpu_s"] = {k: after[k] - first[k] for k in after if k in first}
            samples[side] = sample
        ours, theirs, via_socket = samples[OURS], samples[THEIRS], samples[SOCKET]
        pair = pair_record(r, ours, theirs)
        pair["order"] = list(order)
        pair[SOCKET] = via_socket.record()
        pair["same_tokens_socket"] = via_socket.completion_tokens == ours.completion_tokens
        pair["same_text_socket"] = via_socket.text == ours.text
        pair["tps_ratio"] = quotient(ours.decode_tps, theirs.decode_tps)
        pair["http_over_socket"] = quotient(ours.decode_tps, via_socket.decode_tps)
        pairs.append(pair)
        note(
            f"  decode {sides.name} round {r} ({', '.join(order)}): "
            + ", ".join(
                f"{side} {samples[side].decode_tps or 0:.1f} tok/s "
                f"({samples[side].completion_tokens} tok, {samples[side].content_chunks} chunks)"
                for side in (OURS, THEIRS, SOCKET)
            )
        )
    ratios = [p["tps_ratio"] for p in pairs if p["tps_ratio"] is not None]
    result: dict[str, Any] = {
        "rounds": rounds,
        "max_tokens": max_tokens,
        "tps_ratio": median(ratios),
        "tps_ratio_min": min(ratios, default=None),
        "tps_ratio_max": max(ratios, default=None),
        "http_over_socket": median(
            p["http_over_socket"] for p in pairs if p["http_over_socket"] is not None
        ),
        "same_tokens_socket": sum(p["same_tokens_socket"] for p in pairs),
        "same_text_socket": sum(p["same_text_socket"] for p in pairs),
    }
    for side in (OURS, THEIRS, SOCKET):
        result[f"tps_{side}"] = median(
            p[side]["decode_tps"] for p in pairs if p[side]["decode_tps"]
        )
        result[f"chunks_{side}"] = median(p[side]["content_chunks"] for p in pairs)
        for process in sides.pids:
            result[f"cpu_per_token_{side}_{process}_s"] = median(
                p[side]["decode_cpu_s"].get(process, math.nan) / (p[side]["completion_tokens"] - 1)
                for p in pairs
            )
        worker = "server" if side == THEIRS else "runner"
        result[f"busy_{side}"] = median(
            p[side]["decode_cpu_s"].get(worker, math.nan) / p[side]["decode_s"] for p in pairs
        )
    result.update(agreement(pairs))
    result["samples"] = pairs
    return result


def decode_table(results: dict[str, dict[str, Any]]) -> str:
    header = [
        "model", "rounds", "max tok", "tok/s ours", "theirs", "ours/theirs", "(min-max)",
        f"target>={DECODE_TARGET:g}", "ours via socket", "HTTP/socket", "tokens ours", "theirs",
        "same tokens", "same text", "chunks ours", "theirs", "CPU/token ours", "theirs",
        "busy ours", "theirs", "socket",
    ]  # fmt: skip
    rows = []
    for model, d in results.items():
        ours_cpu = d[f"cpu_per_token_{OURS}_runner_s"] + d[f"cpu_per_token_{OURS}_daemon_s"]
        rows.append([
            SHORT_NAMES[model], str(d["rounds"]), str(d["max_tokens"]),
            f"{d[f'tps_{OURS}']:.1f}", f"{d[f'tps_{THEIRS}']:.1f}", f"{d['tps_ratio']:.3f}",
            f"{d['tps_ratio_min']:.2f}-{d['tps_ratio_max']:.2f}",
            verdict(d["tps_ratio"] >= DECODE_TARGET),
            f"{d[f'tps_{SOCKET}']:.1f}", f"{d['http_over_socket']:.2f}",
            counts(d["completion_tokens_ours"]), counts(d["completion_tokens_theirs"]),
            f"{d['same_tokens']}/{d['pairs']}", f"{d['same_text']}/{d['pairs']}",
            f"{d[f'chunks_{OURS}']:.0f}", f"{d[f'chunks_{THEIRS}']:.0f}",
            cpu_time(ours_cpu), cpu_time(d[f"cpu_per_token_{THEIRS}_server_s"]),
            f"{d[f'busy_{OURS}']:.2f}", f"{d[f'busy_{THEIRS}']:.2f}", f"{d[f'busy_{SOCKET}']:.2f}",
        ])  # fmt: skip
    title = (
        "1a. Decode, one stream through HTTP: POST /v1/chat/completions, stream: true, greedy, "
        "ours (the daemon's HTTP front) vs mlx_lm.server on the same model directory; beside "
        "them ours through the socket (Client.generate). tok/s client-side = (completion "
        "tokens - 1) / (last content chunk - first content chunk); medians over rounds, "
        "ratios: medians of per-round ratios; ours and theirs take turns at going first; a "
        "fresh prompt per round. CPU/token: user + system CPU seconds from the first content "
        "chunk to the end, per token after the first; ours = runner + daemon, theirs = "
        "mlx_lm.server. busy: the runner's (theirs: mlx_lm.server's) CPU seconds over the "
        "same span / its wall time (1.00 = one core all the time)."
    )
    return title + "\n" + render_table(header, rows)


def counts(values: Sequence[int]) -> str:
    """The distinct token counts seen: ``256``, or ``30-32`` when they varied."""
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


# --- 1b. time to first token ----------------------------------------------------------


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


# --- 2. our HTTP vs our socket --------------------------------------------------------


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


# --- the run --------------------------------------------------------------------------


def runner_pid(client: Client, name: str) -> int:
    pid = runner_info(client, name).pid
    if pid is None:
        raise RuntimeError(f"{name} has no runner process")
    return pid


def server_pid(port: int) -> int:
    """The pid of our child ``mlx_lm.server`` listening on ``port``."""
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            argv = child.cmdline()
            if "mlx_lm.server" in argv and str(port) in argv:
                return child.pid
    raise RuntimeError(f"no mlx_lm.server child on port {port}")


@dataclass(frozen=True)
class ModelSettings:
    decode_rounds: int
    decode_tokens: int
    ttft_requests: int
    ttft_tokens: int


def settings_for(quick: bool) -> dict[str, ModelSettings]:
    """builtin:tiny decodes hundreds of tokens/s here; builtin:smollm2 4-6 (2 shared CPU
    cores), and takes ~4 s to its first token: its counts stay small. Decode rounds in
    multiples of 6 go through every order of the three sides."""
    if quick:
        return {TINY: ModelSettings(6, 256, 30, 2), SMOLLM2: ModelSettings(2, 16, 6, 2)}
    return {TINY: ModelSettings(12, 256, 100, 2), SMOLLM2: ModelSettings(6, 32, 20, 2)}


def run(
    args: argparse.Namespace,
    per_model: dict[str, ModelSettings],
    overhead_requests: int,
    config: str,
    results: dict[str, Any],
    save: Callable[[], None],
) -> None:
    """Start our daemon, then per model mlx_lm.server beside it, and measure (see the
    module's docstring); every process is stopped and reaped before this returns."""
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)
    with (
        tempfile.TemporaryDirectory(prefix="mlx-bench-http-") as tmp_name,
        contextlib.ExitStack() as stack,
    ):
        tmp = Path(tmp_name)
        daemon = Daemon.start(
            stack, tmp, "http", config, client_timeout_s=REQUEST_TIMEOUT_S, http="127.0.0.1:0"
        )
        ours_url = daemon.client.status().supervisor.http
        if ours_url is None:
            raise RuntimeError("the daemon's HTTP front is off (its port was taken?)")
        note(f"our daemon: HTTP {ours_url}, socket {daemon.process.socket_path}")
        results["machine"]["daemon_http_url"] = ours_url
        fresh = stack.enter_context(
            httpx.Client(timeout=timeout, limits=httpx.Limits(max_keepalive_connections=0))
        )
        pooled = stack.enter_context(httpx.Client(timeout=timeout))
        for model, s in per_model.items():
            name = SHORT_NAMES[model]
            model_dir = ensure_builtin_model(model)
            note(f"loading {model} ({model_dir}) in our daemon and in mlx_lm.server")
            daemon.client.load(model, name)
            daemon.settle()
            with mlx_lm_server(model_dir, tmp / f"mlx_lm_server_{name}.log") as port:
                pids = {
                    "runner": runner_pid(daemon.client, name),
                    "daemon": daemon.process.pid,
                    "server": server_pid(port),
                }
                sides = Sides(ours_url, f"http://127.0.0.1:{port}", daemon.client, name,
                              fresh, pooled, pids)  # fmt: skip
                warm_up(sides)
                note(f"1a. decode on {model}: {s.decode_rounds} rounds x {s.decode_tokens} tokens")
                results["decode"][model] = decode_family(sides, s.decode_rounds, s.decode_tokens)
                save()
                note(f"1b. TTFT on {model}: {s.ttft_requests} requests per side")
                results["ttft"][model] = ttft_family(sides, s.ttft_requests, s.ttft_tokens)
                save()
            if model == TINY:  # after mlx_lm.server has gone: nothing idle beside it
                note(f"2. HTTP vs socket on {model}: {overhead_requests} requests per path")
                results["overhead"] = overhead_family(
                    sides, overhead_requests, args.overhead_tokens
                )
                save()
            daemon.client.unload(name)
        results["daemon_exit"] = daemon.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and requests (~3 min)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--overhead-requests", type=int, default=None, help="figure 2: requests per path (50; 20 "
        "with --quick)",
    )  # fmt: skip
    parser.add_argument(
        "--overhead-tokens", type=int, default=4, help="figure 2: max_tokens per request (4)"
    )
    args = parser.parse_args()
    per_model = settings_for(args.quick)
    overhead_requests = args.overhead_requests or (20 if args.quick else 50)
    config = "hot_spare = false\n"
    settings = {
        "quick": args.quick,
        "models": {m: asdict(s) for m, s in per_model.items()},
        "overhead": {
            "requests_per_path": overhead_requests,
            "max_tokens": args.overhead_tokens,
            "paths": list(OVERHEAD_PATHS),
            "model": TINY,
        },
        "daemon_config": config.strip() + " (no idle spare process beside the measurements)",
        "daemon_http": "MLX_SUPERVISOR_HTTP=127.0.0.1:0",
        "theirs": "python -m mlx_lm.server --model DIR --host 127.0.0.1 --port P (defaults)",
        "http_client": f"httpx {httpx.__version__}",
        "prompts": {
            "decode": messages_for("Story", 0, DECODE_USER),
            "ttft": messages_for("Request", 0, TTFT_USER),
            "overhead": messages_for("Short", 0, TTFT_USER),
        },
    }
    results: dict[str, Any] = {
        "machine": machine_info(mlx_device()),
        "settings": settings,
        "complete": False,
        "decode": {},
        "ttft": {},
    }
    started = time.perf_counter()

    def save() -> None:
        """Save what we have so far: a run that fails late keeps the families before it
        (``complete`` says whether it ended)."""
        results["wall_s"] = time.perf_counter() - started
        write_json(results, args.out)

    try:
        run(args, per_model, overhead_requests, config, results, save)
    finally:  # the tables of whatever was measured, even if the run failed later
        print(tables(results), flush=True)
    results["children_left"] = children_left()
    results["machine"]["loadavg_end"] = load_average()
    results["checks"] = checks = token_checks(results)
    results["complete"] = True
    save()
    bad = [c for c in checks if not c["ok"]]
    for c in bad:
        note(f"CHECK FAILED: {c['what']}: {c['detail']}")
    if results["children_left"]:
        note(f"WARNING: child processes left: {results['children_left']}")
    note(f"done in {results['wall_s']:.0f} s; wrote {args.out}")
    return 1 if bad else 0


def tables(results: dict[str, Any]) -> str:
    """The tables of the families measured so far, in order."""
    parts = []
    if results["decode"]:
        parts.append(decode_table(results["decode"]))
    if results["ttft"]:
        parts.append(ttft_table(results["ttft"]))
    if "overhead" in results:
        parts.append(overhead_table(results["overhead"]))
    return "\n\n".join(parts) + "\n" if parts else ""


def token_checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every pair of sides must have generated the same number of tokens (greedy, same
    model files, same max_tokens)."""
    checks = []
    for family in ("decode", "ttft"):
        for model, r in results[family].items():
            checks.append({
                "what": f"{family} {SHORT_NAMES[model]}: same completion tokens",
                "ok": r["same_tokens"] == r["pairs"],
                "detail": f"{r['same_tokens']}/{r['pairs']} pairs",
            })  # fmt: skip
            if family == "decode":
                checks.append({
                    "what": f"decode {SHORT_NAMES[model]}: same completion tokens, HTTP and socket",
                    "ok": r["same_tokens_socket"] == r["pairs"],
                    "detail": f"{r['same_tokens_socket']}/{r['pairs']} rounds",
                })  # fmt: skip
    o = results.get("overhead")
    if o is not None:
        checks.append({
            "what": "overhead: same completion tokens on every path",
            "ok": o["same_tokens"] == o["requests_per_path"],
            "detail": f"{o['same_tokens']}/{o['requests_per_path']} rounds",
        })  # fmt: skip
    return checks


if __name__ == "__main__":
    sys.exit(main())

"""What each HTTP front costs next to OpenAI's chat completions: first-token
latency and decode tokens per second, front ÷ OpenAI chat, on the same request.

Usage::

    python bench/bench_fronts.py [--model builtin:smollm2] [--rounds 8]
                                 [--tokens 64] [--out bench/results/fronts.json]

One daemon, HTTP on a free port, the model loaded first. Each round sends
the same greedy chat (a system message and a user message, ``--tokens``
tokens at most) once through each front, streamed, in an order that turns
round by round so that no front always goes first or always follows
another:

- ``openai_chat``: ``POST /v1/chat/completions`` (the anchor);
- ``anthropic``: ``POST /v1/messages``;
- ``responses``: ``POST /v1/responses``;
- ``ollama_chat``: ``POST /api/chat``;
- ``ollama_generate``: ``POST /api/generate`` with ``system`` and ``prompt``
  (templated as the same chat).

Each request's system message carries the round's number and the front's,
so that every request has a prompt of the same length and none finds
another's in the prefix cache beyond the chat template's opening: all of
them pay the same prefill. The daemon's idle next-turn prefill is off
(``next_turn_prefill = false``), so that no request waits behind the one
before it. Read with plain httpx, not the SDKs: the figure is the
front's, not a client library's. First token: from the request sent to the
first piece of answer text; decode: the tokens the front reports (its usage)
after the first, over the time from the first piece to the last. The table
gives each front's medians and its ratio to OpenAI chat's in the same
rounds (targets: first token ≤ 1.05, decode ≥ 0.97).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx

from common import (
    RESULTS_DIR,
    Daemon,
    fmt,
    load_average,
    machine_info,
    mlx_device,
    note,
    write_json,
)
from supervisor.figures import median, render_table

DEFAULT_OUT = RESULTS_DIR / "fronts.json"
USER = "Tell me a long story about a lighthouse keeper, her cat and a storm at sea."
TTFT_TARGET, DECODE_TARGET = 1.05, 0.97
ANCHOR = "openai_chat"


@dataclass
class Sample:
    """One streamed request as the client saw it (``time.perf_counter`` values)."""

    sent_at: float
    first_at: float | None = None
    last_at: float | None = None
    tokens: int = 0  # as the front's usage reports them
    text: str = ""

    def piece(self, text: str) -> None:
        if text:
            self.last_at = time.perf_counter()
            self.first_at = self.first_at or self.last_at
            self.text += text

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_at is None else self.first_at - self.sent_at

    @property
    def decode_tps(self) -> float | None:
        if self.first_at is None or self.last_at is None or self.last_at <= self.first_at:
            return None
        return (self.tokens - 1) / (self.last_at - self.first_at)


def sse_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON of each ``data:`` line of a server-sent event stream."""
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: ") :])


def openai_chat(http: httpx.Client, model: str, system: str, tokens: int) -> Sample:
    body = {"model": model, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": USER}]}  # fmt: skip
    sample = Sample(time.perf_counter())
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        for event in sse_events(response):
            for choice in event.get("choices", []):
                sample.piece(choice["delta"].get("content") or "")
            if event.get("usage"):
                sample.tokens = event["usage"]["completion_tokens"]
    return sample


def anthropic(http: httpx.Client, model: str, system: str, tokens: int) -> Sample:
    body = {"model": model, "max_tokens": tokens, "temperature": 0, "stream": True,
            "system": system, "messages": [{"role": "user", "content": USER}]}  # fmt: skip
    sample = Sample(time.perf_counter())
    with http.stream("POST", "/v1/messages", json=body) as response:
        for event in sse_events(response):
            if event["type"] == "content_block_delta" and event["delta"]["type"] == "text_delta":
                sample.piece(event["delta"]["text"])
            elif event["type"] == "message_delta":
                sample.tokens = event["usage"]["output_tokens"]
    return sample


def responses(http: httpx.Client, model: str, system: str, tokens: int) -> Sample:
    body = {"model": model, "max_output_tokens": tokens, "temperature": 0, "stream": True,
            "instructions": system, "input": USER}  # fmt: skip
    sample = Sample(time.perf_counter())
    with http.stream("POST", "/v1/responses", json=body) as response:
        for event in sse_events(response):
            if event["type"] == "response.output_text.delta":
                sample.piece(event["delta"])
            elif event["type"] in ("response.completed", "response.incomplete"):
                sample.tokens = event["response"]["usage"]["output_tokens"]
    return sample


def ollama_lines(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.strip():
            yield json.loads(line)


def ollama_chat(http: httpx.Client, model: str, system: str, tokens: int) -> Sample:
    body = {"model": model, "stream": True, "options": {"temperature": 0, "num_predict": tokens},
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": USER}]}  # fmt: skip
    sample = Sample(time.perf_counter())
    with http.stream("POST", "/api/chat", json=body) as response:
        for line in ollama_lines(response):
            sample.piece(line["message"].get("content") or "")
            if line.get("done"):
                sample.tokens = line["eval_count"]
    return sample


def ollama_generate(http: httpx.Client, model: str, system: str, tokens: int) -> Sample:
    body = {"model": model, "stream": True, "system": system, "prompt": USER,
            "options": {"temperature": 0, "num_predict": tokens}}  # fmt: skip
    sample = Sample(time.perf_counter())
    with http.stream("POST", "/api/generate", json=body) as response:
        for line in ollama_lines(response):
            sample.piece(line.get("response") or "")
            if line.get("done"):
                sample.tokens = line["eval_count"]
    return sample


FRONTS: dict[str, Callable[[httpx.Client, str, str, int], Sample]] = {
    ANCHOR: openai_chat,
    "anthropic": anthropic,
    "responses": responses,
    "ollama_chat": ollama_chat,
    "ollama_generate": ollama_generate,
}


def order(round_index: int) -> list[str]:
    """The fronts in this round's order: turned by one each round, and
    reversed every other turn, so each front goes first, last and beside
    each other front."""
    names = list(FRONTS)
    turn = round_index // 2 % len(names)
    names = names[turn:] + names[:turn]
    return names[::-1] if round_index % 2 else names


def measure(url: str, model: str, rounds: int, tokens: int) -> dict[str, list[Sample]]:
    samples: dict[str, list[Sample]] = {name: [] for name in FRONTS}
    with httpx.Client(base_url=url, timeout=600) as http:
        for name in FRONTS:  # warm-up: each front's path once (code paths, connections)
            FRONTS[name](http, model, f"Warm-up {name}. You are a helpful assistant.", 4)
        for r in range(rounds):
            for name in order(r):
                system = f"Story {r}-{list(FRONTS).index(name)}. You are a helpful assistant."
                samples[name].append(FRONTS[name](http, model, system, tokens))
            note(f"round {r + 1}/{rounds}: " + ", ".join(
                f"{n} {fmt(samples[n][-1].ttft_s, '.3f', unit=' s')}" for n in FRONTS))  # fmt: skip
    return samples


def figures(samples: dict[str, list[Sample]]) -> dict[str, dict[str, Any]]:
    """Per front: median first-token time and decode rate, and the medians of
    its per-round ratios to the anchor's (the same round, the same prompt)."""
    anchor = samples[ANCHOR]
    out = {}
    for name, mine in samples.items():
        ttft_ratios = [a.ttft_s / b.ttft_s for a, b in zip(mine, anchor, strict=True)
                       if a.ttft_s and b.ttft_s]  # fmt: skip
        decode_ratios = [a.decode_tps / b.decode_tps for a, b in zip(mine, anchor, strict=True)
                         if a.decode_tps and b.decode_tps]  # fmt: skip
        out[name] = {
            "ttft_s": median([s.ttft_s for s in mine if s.ttft_s is not None]),
            "decode_tps": median([s.decode_tps for s in mine if s.decode_tps is not None]),
            "tokens": median([float(s.tokens) for s in mine]),
            "ttft_ratio": median(ttft_ratios),
            "decode_ratio": median(decode_ratios),
            "samples": [
                {"ttft_s": s.ttft_s, "decode_tps": s.decode_tps, "tokens": s.tokens} for s in mine
            ],
        }
    return out


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name, f in results.items():
        ttft_ok = f["ttft_ratio"] <= TTFT_TARGET
        decode_ok = f["decode_ratio"] >= DECODE_TARGET
        rows.append([
            name, fmt(f["ttft_s"], ".3f", unit=" s"), fmt(f["ttft_ratio"], ".3f"),
            "" if name == ANCHOR else ("ok" if ttft_ok else "MISSED"),
            fmt(f["decode_tps"], ".1f"), fmt(f["decode_ratio"], ".3f"),
            "" if name == ANCHOR else ("ok" if decode_ok else "MISSED"),
            fmt(f["tokens"], ".0f"),
        ])  # fmt: skip
    header = ["front", "first token (p50)", "÷ openai", f"≤ {TTFT_TARGET}",
              "decode tok/s (p50)", "÷ openai", f"≥ {DECODE_TARGET}", "tokens"]  # fmt: skip
    return render_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    load_before = load_average()
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-fronts-")))
        config = (f'hot_spare = false\nnext_turn_prefill = false\n[[models]]\nname = "m"\n'
                  f'model = "{args.model}"\n')  # fmt: skip
        daemon = Daemon.start(stack, tmp, "fronts", config, http="127.0.0.1:0")
        note(f"loading {args.model}")
        daemon.client.load(args.model, "m")
        daemon.settle()
        url = daemon.client.status().supervisor.http
        assert url is not None, "the daemon's HTTP front did not start"
        samples = measure(url, "m", args.rounds, args.tokens)
        daemon.shutdown()
    results = figures(samples)
    print(table(results))
    write_json({
        "machine": machine_info(mlx_device()), "load_average": {"start": load_before,
                                                         "end": load_average()},
        "settings": vars(args) | {"out": str(args.out)}, "fronts": results,
    }, args.out)  # fmt: skip


if __name__ == "__main__":
    main()

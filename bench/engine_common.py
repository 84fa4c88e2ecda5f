"""What the figure families of ``bench_engine.py`` share: the models, the sides, one
greedy request on each side (``ours_request`` through our daemon, ``theirs_request`` to
``mlx_lm.server``) as a ``Sample``, and the warm-up.

One module per family: ``engine_chat`` (1), ``engine_concurrency`` (2), ``engine_lookup``
(3), ``engine_eviction`` (4); ``bench_engine.py`` runs them.
"""

from __future__ import annotations

import http.client
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from supervisor.client import Client

TINY, SMALL = "builtin:tiny", "builtin:small"
SHORT_NAMES = {TINY: "tiny", SMALL: "small"}
REQUEST_TIMEOUT_S = 900.0  # one request, either side: a cold prefill on small takes minutes

OURS, THEIRS, OURS_NO_CACHE = "ours", "theirs", "ours_no_cache"


def median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(statistics.median(present)) if present else None


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

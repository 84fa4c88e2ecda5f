"""What the figure families of ``bench_http.py`` share: the models, the sides and the
paths, the chats sent, one request on each (``http_chat``: ours or mlx_lm.server over
HTTP; ``socket_chat``: ours through ``Client.generate``) as a ``Sample``, ``Sides`` (where
each side is), the warm-up and the pairs' agreement.

One module per family: ``http_decode`` (1a), ``http_ttft`` (1b), ``http_overhead`` (2);
``bench_http.py`` runs them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from supervisor.client import Client
from supervisor.figures import median

TINY, SMOLLM2 = "builtin:tiny", "builtin:smollm2"
SHORT_NAMES = {TINY: "tiny", SMOLLM2: "smollm2"}
REQUEST_TIMEOUT_S = 300.0
CHAT_PATH = "/v1/chat/completions"
THEIRS_MODEL = "default_model"  # mlx_lm.server: the model given with --model

OURS, THEIRS = "ours", "theirs"

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
    ours: dict[str, Any] | None = None
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
                ours = event.get("supervisor") or ours  # our finish reason and its detail
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
            ours = whole.get("supervisor")
    if ours is not None:  # why a request ended as it did (memory_pressure reads "length")
        extra["supervisor"] = ours
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


def counts(values: Sequence[int]) -> str:
    """The distinct token counts seen: ``256``, or ``30-32`` when they varied."""
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"

"""One request inside the engine: what it asked for, and how far it got.

A plain record, shared by the engine's parts (admission, the stop-string
hold-back, the steps that run it); no mlx in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ipc.messages import FinishReason, Generate
from runner.guard import RequestGuard

__all__ = ["Job"]


@dataclass(eq=False)
class Job:
    """One request inside the engine."""

    request: Generate
    received: float
    prompt: list[int]
    max_tokens: int
    clamped_to: int | None
    sampler: Any
    guard: RequestGuard
    detokenizer: Any
    use_cache: bool
    cached_tokens: int = 0
    to_compute: int | None = None  # prompt tokens to compute, as admission expects it
    held: bool = False  # it waited in line behind a run: not for company
    prefill_chunks: int = 0  # prefill steps it took part in
    tokens: list[int] = field(default_factory=list)  # generated so far (a stop token included)
    started: float = 0.0  # when its prefill began
    first_token_at: float | None = None
    uid: int | None = None  # its id in the batch
    batched: bool = False
    finish: FinishReason | None = None
    detail: str | None = None
    text: str = ""  # the text so far (cut before a stop string)
    ready: int = 0  # characters of ``text`` that may go out (none of a stop string's start)
    sent: int = 0  # characters of ``text`` sent
    sent_tokens: int = 0  # tokens its frames have covered
    sent_at: float = 0.0

    @property
    def request_id(self) -> int:
        return self.request.request_id

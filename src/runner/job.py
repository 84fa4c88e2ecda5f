"""One request inside the engine: what it asked for, and how far it got.

A plain record, shared by the engine's parts (admission, the stop-string
hold-back, the steps that run it); no mlx in it.

What a request's tokens make goes three ways: the answer's ``text`` (through
the stop strings), ``reasoning`` and ``tool_calls`` (from the output
splitter), each held on the job until the next frame takes it, with the
``logprobs`` of the tokens since the last frame.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ipc.messages import FinishReason, Generate, ToolCall
from runner.guard import RequestGuard

if TYPE_CHECKING:
    from runner.vision import VisionPrompt

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
    processors: list[Any]  # mlx-lm logits processors, this request's own
    splitter: Any  # an OutputSplitter (chat requests), or None: all is text
    guard: RequestGuard
    detokenizer: Any
    use_cache: bool
    cached_tokens: int = 0
    key_space: int = 0  # the prefix cache's key space of its adapter (0: none)
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
    stop_string: str | None = None  # the stop string that ended the text, when one did
    sent: int = 0  # characters of ``text`` sent
    sent_tokens: int = 0  # tokens its frames have covered
    sent_at: float = 0.0
    shown: bool = False  # a frame has carried text, reasoning or tool calls
    reasoning: str = ""  # reasoning text not sent yet
    tool_calls: list[ToolCall] = field(default_factory=list)  # parsed from its output
    sent_calls: int = 0  # of ``tool_calls``, sent
    logprobs: list[Any] = field(default_factory=list)  # PendingLogprobs of tokens not sent yet
    output_ended: bool = False  # the splitter gave up what it held
    invalid_tool_call: str | None = None  # tool-call text the model broke or cut short
    processor_error: Exception | None = None  # what its logits processors raised
    draft_tokens: int = 0  # speculative decoding: draft tokens the model checked
    draft_accepted: int = 0  # of those, kept
    vision: VisionPrompt | None = None  # its images (it runs alone: runner.vision)

    @property
    def request_id(self) -> int:
        return self.request.request_id

    @property
    def cache_key(self) -> list[int]:
        """Its prompt as the prefix cache keys it (an image's tokens by the image)."""
        return self.prompt if self.vision is None else self.vision.cache_key

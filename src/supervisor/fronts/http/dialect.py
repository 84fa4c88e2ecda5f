"""What each API of the HTTP front brings to the one request path: how its
body becomes a :class:`CompletionCall`, and how the generation's frames
become its answer (:class:`Answer`), framed its way (:class:`Framing`).

OpenAI's chat and text completions, Anthropic's Messages, OpenAI's Responses
and Ollama's chat and generate are each a :class:`Dialect`; everything else
(finding or loading the model, admission, the queue, cancelling when the
client leaves, errors) is :class:`~supervisor.fronts.http.completions.Completions`,
the same for all of them.
"""

from __future__ import annotations

from typing import Literal, Protocol

import msgspec
from starlette.requests import Request

from ipc.messages import ChatMessage, ChatOptions, GenerationDone, SamplingParams, TextChunk
from supervisor.fronts.http.images import RemoteImage
from supervisor.fronts.http.streaming import Framing
from supervisor.metrics import Front


class CompletionCall(msgspec.Struct, kw_only=True):
    """A request, checked, in the terms of the runner, waiting for its model.

    ``single_tool_call``: the answer ends at the model's first tool call
    (OpenAI's ``parallel_tool_calls`` false, Anthropic's
    ``disable_parallel_tool_use``). ``keep_alive_s`` (Ollama's
    ``keep_alive``, which each request sets anew): None leaves the model's
    keep-alive as it is (the other APIs); otherwise the request restarts the
    model's idle timer, and from then on the model is unloaded after that
    long idle, at once after this answer when 0, never when negative, or as
    its config says (``"default"``: a request that gives none).
    ``sampling_given``: the sampling fields the body set (SamplingParams'
    names, ``max_tokens`` aside): the model's configured defaults fill in
    the others."""

    chat: bool
    model: str
    messages: list[ChatMessage] | None
    prompt: str | None
    max_tokens: int | None
    sampling: SamplingParams
    sampling_given: tuple[str, ...] = ()
    options: ChatOptions = ChatOptions()
    stream: bool
    include_usage: bool = False
    single_tool_call: bool = False
    keep_alive_s: float | Literal["default"] | None = None
    adapter: str | None = None  # a LoRA adapter of the model's (None: its default)
    remote_images: list[RemoteImage] = []  # http(s) images, fetched once the model is known


class Answer(Protocol):
    """One generation's answer in an API's shapes. :meth:`add` gathers each
    frame's parts (and, when the call streams, returns the stream's bytes for
    them); at the end, :meth:`end` gives a stream's last events and
    :meth:`whole` the whole answer's body."""

    @property
    def tool_call_count(self) -> int:
        """The tool calls gathered so far."""
        ...

    def add(self, chunk: TextChunk, limit_calls: int | None = None) -> list[bytes]:
        """Gather ``chunk``'s parts, keeping at most ``limit_calls`` tool calls
        in all; the framed stream bytes that carry them (none when the call
        does not stream)."""
        ...

    def end(self, done: GenerationDone) -> list[bytes]:
        """A stream's last framed events."""
        ...

    def whole(self, done: GenerationDone) -> bytes:
        """The whole answer, as the JSON body of a response that does not
        stream."""
        ...


class Dialect(Protocol):
    """One API's translation onto the request path."""

    framing: Framing
    front: Front  # its name in the metrics

    async def parse(self, request: Request) -> CompletionCall:
        """The checked call the request's body asks for.

        Raises:
            ApiError: a body this API does not take, or that we cannot honour.
        """
        ...

    def answer(self, call: CompletionCall, model: str) -> Answer:
        """The answer to ``call``, from the model named ``model``."""
        ...

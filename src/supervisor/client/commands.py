"""The client's commands, free of I/O: each builds its request from its
arguments, and a reader interprets the daemon's replies to it.

:class:`~supervisor.client.Client` (blocking) and
:class:`~supervisor.client.AsyncClient` (anyio) only send the request and
feed the replies back; their methods are made from these functions
with :func:`client_method`, signature and docstring included, so neither
can lack an option the other has.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Concatenate, Generic, ParamSpec, TypeVar

import msgspec

from ipc.messages import (
    CacheCleared,
    CacheClearRequest,
    ChatMessage,
    ChatOptions,
    ClientMessage,
    EmbeddingInput,
    Embeddings,
    EmbedRequest,
    ErrorReply,
    GenerateRequest,
    GenerationDone,
    Loaded,
    LoadProgress,
    LoadRequest,
    Queued,
    ReloadReply,
    ReloadRequest,
    RestartStrategy,
    SamplingParams,
    ServerMessage,
    ShutdownAck,
    ShutdownRequest,
    StatusReply,
    StatusRequest,
    TextChunk,
    TokenLogprob,
    ToolCall,
    Unloaded,
    UnloadRequest,
)
from supervisor.client.errors import ClientError

P = ParamSpec("P")
R = TypeVar("R")
C = TypeVar("C")  # a command's request (or Call)
S = TypeVar("S")  # a client
T = TypeVar("T")  # what the client's method returns


def raise_for_error(message: ServerMessage) -> None:
    """Raise the daemon's ErrorReply as a ClientError with its code and message."""
    if isinstance(message, ErrorReply):
        raise ClientError(message.code, message.message)


@dataclass(frozen=True)
class Call(Generic[R]):
    """A command with one reply: the request to send, and the reading of the
    replies up to the one of type ``expect`` (``on_message`` sees the others)."""

    request: ClientMessage
    expect: type[R]
    on_message: Callable[[ServerMessage], None] | None = None

    def feed(self, message: ServerMessage) -> R | None:
        """Read one reply: the command's result, or None while more are due.

        Raises:
            ClientError: the daemon answered with an error.
        """
        raise_for_error(message)
        if isinstance(message, self.expect):
            return message
        if self.on_message is not None:
            self.on_message(message)
        return None


def status() -> Call[StatusReply]:
    """The daemon's pid, uptime, the machine's memory and every runner."""
    return Call(StatusRequest(), StatusReply)


def load(
    model: str,
    name: str | None = None,
    *,
    max_tokens: int | None = None,
    env: dict[str, str] | None = None,
    restart: RestartStrategy | None = None,
    keep_alive_s: float | None = None,
    pinned: bool | None = None,
    context_tokens: int | None = None,
    max_concurrent: int | None = None,
    prefix_cache: bool | None = None,
    ranks: int | None = None,
    hostfile: str | None = None,
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    on_progress: Callable[[LoadProgress], None] | None = None,
    draft_model: str | None = None,
    num_draft_tokens: int | None = None,
) -> Call[Loaded]:
    """Start a runner for ``model`` and wait until it is ready; ``on_progress``
    sees each LoadProgress on the way.

    Raises:
        ClientError: the load failed (``code`` ``load_failed``,
            ``already_loaded``, ...).
    """

    def progress(message: ServerMessage) -> None:
        if on_progress is not None and isinstance(message, LoadProgress):
            on_progress(message)

    request = LoadRequest(
        local_model_reference(model), name, max_tokens, env or {}, restart,
        keep_alive_s, pinned, context_tokens, max_concurrent, prefix_cache, ranks, hostfile,
        kv_bits, kv_group_size,
        None if draft_model is None else local_model_reference(draft_model), num_draft_tokens,
    )  # fmt: skip
    return Call(request, Loaded, progress)


def unload(name: str) -> Call[Unloaded]:
    """Stop the model's runner (escalating as needed) and forget it."""
    return Call(UnloadRequest(name), Unloaded)


def reload() -> Call[ReloadReply]:
    """Have the daemon read its config file again and apply it. A file that
    does not parse or validate is refused whole (``ok`` false, ``error`` and
    ``key`` say why) and the running config stays; otherwise the reply says
    what was added, removed, and which changes apply now or at a model's
    next load."""
    return Call(ReloadRequest(), ReloadReply)


def shutdown() -> Call[ShutdownAck]:
    """Stop every runner and the daemon; returns once the runners are reaped."""
    return Call(ShutdownRequest(), ShutdownAck)


def clear_cache(name: str, disk_only: bool = False) -> Call[CacheCleared]:
    """Drop the model's prefix cache, in RAM and on disk (``disk_only``: only
    the blocks on disk); its runner stays loaded."""
    return Call(CacheClearRequest(name, disk_only), CacheCleared)


def embed(
    name: str,
    inputs: str | Sequence[EmbeddingInput],
    *,
    dimensions: int | None = None,
    truncate: bool = False,
) -> Call[Embeddings]:
    """The vectors of ``inputs`` (a text, or a list of texts or of lists of
    token ids) from the loaded embedding model ``name``: their ``floats()``,
    or ``vectors`` as float32 bytes. ``dimensions``: that many leading
    dimensions (Matryoshka models); ``truncate``: cut inputs over the
    model's length instead of refusing them. A flat list of token ids is one
    input, as OpenAI takes it."""
    items: list[EmbeddingInput] = [inputs] if isinstance(inputs, str) else list(inputs)
    if items and all(isinstance(item, int) and not isinstance(item, bool) for item in items):
        items = [[int(item) for item in items]]  # type: ignore[arg-type]
    return Call(EmbedRequest(name, items, dimensions, truncate), Embeddings)


def generate(
    name: str,
    prompt: str | None = None,
    *,
    messages: list[ChatMessage] | list[dict[str, str]] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    cache: bool = True,
    stop: Sequence[str] = (),
    sampling: SamplingParams | None = None,
    sampling_given: Sequence[str] | None = None,
    options: ChatOptions | None = None,
    adapter: str | None = None,
) -> GenerateRequest:
    """Start a generation; iterate the result for text pieces (its
    ``reasoning``, ``tool_calls`` and ``logprobs`` gather on it). ``cache``
    False: the request neither uses nor fills the model's prefix cache.
    ``stop``: the text ends before the first of these strings. Chat turns
    may be dicts with role and content. ``max_tokens``, ``temperature``,
    ``top_p`` and ``seed`` left out (None) take the model's configured
    defaults, else 256 tokens, greedy, 1.0 and a random seed.
    ``sampling``, when given, stands for all the sampling arguments (it has
    every knob: top_k, logit_bias, logprobs, ...): each of its fields is the
    caller's choice (``temperature=0.0`` is greedy, whatever the model's
    default), unless ``sampling_given`` names those chosen (a model's
    defaults then fill in the others); ``options``: tools, tool_choice,
    response_format and chat template arguments; ``adapter``: one of the
    model's LoRA adapters, by reference or name (None: its default, "": none)."""
    chat = None
    if messages is not None:
        chat = [msgspec.convert(m, ChatMessage) if isinstance(m, dict) else m for m in messages]
    given: tuple[str, ...] = SamplingParams.__struct_fields__
    if sampling is not None and sampling_given is not None:
        given = tuple(sampling_given)
    if sampling is None:
        fields = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                  "seed": seed}  # fmt: skip
        given = tuple(key for key, value in fields.items() if value is not None)
        builtin = SamplingParams()
        sampling = SamplingParams(
            max_tokens=builtin.max_tokens if max_tokens is None else max_tokens,
            temperature=builtin.temperature if temperature is None else temperature,
            top_p=builtin.top_p if top_p is None else top_p,
            seed=seed,
            stop=tuple(stop),
        )
    return GenerateRequest(name=name, prompt=prompt, messages=chat, sampling=sampling, cache=cache,
                           chat=options or ChatOptions(), sampling_given=given,
                           adapter=adapter)  # fmt: skip


GENERATE_TEXT_DOC = """Generate to the end; return the whole text and the final stats.
Takes the arguments of ``generate``."""


class GenerationState:
    """The reading of a generation's replies: ``done`` holds the stats at the end.

    The text is what iterating gives; the other parts of the answer gather
    here as they come: ``reasoning`` (a thinking model's thought, which the
    runner keeps out of the text), ``tool_calls`` (the calls the model made,
    parsed) and ``logprobs`` (one entry per token, when the sampling asked
    for them). ``chunk`` is the last frame read, for a caller that shows the
    parts as they come (a frame of reasoning or calls alone gives an empty
    text piece).

    ``ttft_s`` is measured from ``started`` (set when the client starts the
    call: connect and handshake included) to the first frame of output, of
    any kind.
    """

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.ttft_s: float | None = None
        self.tokens = 0
        self.position: int | None = None  # place in the model's queue while waiting
        self.done: GenerationDone | None = None
        self.chunk: TextChunk | None = None
        self.tool_calls: list[ToolCall] = []
        self.logprobs: list[TokenLogprob] = []
        self._reasoning: list[str] = []

    @property
    def reasoning(self) -> str:
        """The thought so far (empty for a model that does not think)."""
        return "".join(self._reasoning)

    def feed(self, message: ServerMessage) -> str | None:
        """Read one reply: its text (empty for a frame of reasoning, tool
        calls or logprobs alone), or None (a queue position; or the end, and
        then ``done`` is set).

        Raises:
            ClientError: the daemon answered with an error, or with a message
                that has no place in a generation (code ``protocol``).
        """
        raise_for_error(message)
        if isinstance(message, Queued):
            self.position = message.position
            return None
        if isinstance(message, TextChunk):
            if self.ttft_s is None:
                self.ttft_s = time.perf_counter() - self.started
            self.tokens = message.generation_tokens
            self.chunk = message
            if message.reasoning:
                self._reasoning.append(message.reasoning)
            self.tool_calls += message.tool_calls or []
            self.logprobs += message.logprobs or []
            return message.text
        if isinstance(message, GenerationDone):
            self.done = message
            return None
        raise ClientError("protocol", f"unexpected {type(message).__name__} during generate")


def local_model_reference(model: str) -> str:
    """``model`` as the daemon should see it: a local directory or file (a
    GGUF file) that exists here (relative to *our* working directory) becomes
    an absolute path; repo ids and ``builtin:`` names pass unchanged."""
    if model.startswith("builtin:"):
        return model
    try:
        path = Path(model).expanduser()
        local = path.is_dir() or path.is_file()  # a .gguf file, or an Ollama blob
        return str(path.resolve()) if local else model
    except (OSError, RuntimeError, ValueError):  # not a usable path here: the daemon decides
        return model


def client_method(
    command: Callable[P, C],
    run: Callable[[S, C], T],
    owner: str,
    *,
    name: str = "",
    doc: str = "",
) -> Callable[Concatenate[S, P], T]:
    """The ``owner`` client's method for ``command``: it builds the request
    from its arguments and returns ``run(self, request)``. It takes the
    command's name (or ``name``), docstring (or ``doc``) and signature
    (``self`` first), as ``help`` and ``inspect.signature`` show them."""

    def method(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return run(self, command(*args, **kwargs))

    signature = inspect.signature(command)
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[self_parameter, *signature.parameters.values()],
        return_annotation=inspect.Signature.empty,  # the client's own, not the request's
    )
    method.__name__ = name or command.__name__
    method.__qualname__ = f"{owner}.{method.__name__}"
    method.__doc__ = doc or command.__doc__
    return method

"""Ollama's ``/api/chat`` and ``/api/generate``: their bodies, the one
request they translate into, and their answers (newline-delimited JSON
while they stream, one JSON object when they do not). The routes, and
Ollama's other endpoints, live in :mod:`supervisor.fronts.http.ollama_api`.

As on every front, each field is honoured or refused: ``suffix``, a
``template``, a token ``context``, and the options of samplers mlx-lm does
not have are a 400 that names them. The options that tune Ollama's own
runtime and hardware, and change nothing about the tokens, are accepted and
ignored on purpose (:data:`IGNORED_OPTIONS`).

What differs from Ollama's server: ``stream`` is true unless the body says
false (as there), but options left out take the same defaults as on the
other fronts (greedy, as :class:`~ipc.messages.SamplingParams` has them),
not Ollama's (temperature 0.8, top_k 40, top_p 0.9): the same request
gives the same tokens on every front.
"""

from __future__ import annotations

import datetime
import math
import re
import time
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from ipc.messages import (
    ChatMessage,
    ChatOptions,
    GenerationDone,
    ResponseFormat,
    SamplingParams,
    TextChunk,
    TokenLogprob,
    ToolCall,
)
from supervisor.fronts.http.dialect import CompletionCall
from supervisor.fronts.http.errors import ENCODER, ApiError
from supervisor.fronts.http.images import data_url_bytes, decode_base64
from supervisor.fronts.http.openai_replies import entry_bytes, supervisor_fields, token_bytes
from supervisor.fronts.http.openai_requests import (
    Penalty,
    Strict,
    TopLogprobs,
    Unit,
    bad,
    stop_strings,
    tool_names,
)
from supervisor.fronts.http.streaming import ndjson
from supervisor.registry.defaults import given

THINK_LEVELS = ("low", "medium", "high")
ROLES = ("system", "user", "assistant", "tool")
NO_LIMIT = (-2, -1, 0)  # num_predict: fill the context, no limit, not set
WHOLE_CONTEXT = 1 << 20  # repeat_last_n -1 (the whole context): a window no context exceeds


# --- request bodies --------------------------------------------------------------
# Unknown fields are refused (Strict): errors.validation_error turns msgspec's
# message into "unsupported parameter: X" (options.X for an option).


class IgnoredOptions(Strict, kw_only=True):
    """The options accepted and ignored on purpose: they size or place
    Ollama's own runtime (its context window and batches, GPU layers,
    threads, memory mapping, the tokens kept when its context shifts) and
    change nothing about the tokens; the runner has its own settings for what
    it needs. Every other option we do not honour is a 400."""

    num_ctx: Any = None
    num_batch: Any = None
    num_gpu: Any = None
    main_gpu: Any = None
    num_thread: Any = None
    use_mmap: Any = None
    use_mlock: Any = None
    low_vram: Any = None
    numa: Any = None
    f16_kv: Any = None
    vocab_only: Any = None
    logits_all: Any = None
    embedding_only: Any = None
    num_keep: Any = None
    draft_num_predict: Any = None


IGNORED_OPTIONS: tuple[str, ...] = IgnoredOptions.__struct_fields__
"""The names of :class:`IgnoredOptions` (the README's Ollama section lists them)."""


class Options(IgnoredOptions, kw_only=True):
    """Ollama's ``options``: the sampler and the length, as mlx-lm has them;
    and the samplers it does not have, taken only at the setting that turns
    them off (:func:`check_samplers`)."""

    temperature: Annotated[float, Meta(ge=0)] | None = None
    top_p: Unit | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    min_p: Unit | None = None
    seed: Annotated[int, Meta(le=2**63 - 1)] | None = None  # negative: a random seed
    stop: list[str] | None = None
    num_predict: Annotated[int, Meta(ge=-2)] | None = None
    repeat_penalty: Annotated[float, Meta(ge=0)] | None = None
    repeat_last_n: Annotated[int, Meta(ge=-1, le=WHOLE_CONTEXT)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None  # tune mirostat only: nothing to do while it is off
    mirostat_eta: float | None = None
    typical_p: float | None = None
    tfs_z: float | None = None
    penalize_newline: bool | None = None


class ToolFunctionCall(Strict, kw_only=True):
    index: int | None = None  # the call's place in its answer, as Ollama gives it: ignored
    name: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)


class ToolCallTurn(Strict, kw_only=True):
    """A tool call in an assistant turn of the history. Its ``id`` is the
    call's, when a client sends one; Ollama's own clients send none (then one
    is made up, :func:`chat_messages`). ``index``, the call's place in its
    answer (Open WebUI sends it here, Ollama inside ``function``), is
    accepted and ignored: the list's order is the calls' order."""

    id: str | None = None
    index: int | None = None
    type: Literal["function"] | None = None
    function: ToolFunctionCall


class Turn(Strict, kw_only=True):
    """One message of a chat, as Ollama has it: ``thinking`` is an assistant
    turn's reasoning, ``tool_name`` (and, from newer clients,
    ``tool_call_id``) says which call a ``tool`` turn answers."""

    role: str
    content: str | None = None
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCallTurn] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class Body(Strict, kw_only=True):
    """What ``/api/chat`` and ``/api/generate`` share (``model`` less a final
    ``:latest``: :func:`model_name`)."""

    model: str
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool | None = None
    keep_alive: float | str | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None


class ChatBody(Body, kw_only=True):
    messages: list[Turn] | None = None
    tools: list[dict[str, Any]] | None = None


class GenerateBody(Body, kw_only=True):
    prompt: str | None = None
    system: str | None = None
    raw: bool | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None


class OllamaCall(CompletionCall, kw_only=True):
    """A call of ``/api/chat`` or ``/api/generate``, with the moment its
    request came (``time.perf_counter()``), for the answer's durations."""

    received_at: float


# --- translation -----------------------------------------------------------------

LATEST = ":latest"
"""The tag the ollama CLI and some apps add to a model's name: the name without it."""

MAX_KEEP_ALIVE_S = 365 * 86_400.0
"""The longest keep-alive a model's config takes (``KeepAliveSeconds``): a
request's longer one keeps the model loaded for ever, as a negative one does."""

KeepAlive = float | Literal["default"]


def model_name(name: str) -> str:
    """The model a client's ``name`` stands for: itself, less a final
    ``:latest`` (``builtin:tiny:latest`` is ``builtin:tiny``; the colon of
    ``builtin:tiny`` stays)."""
    return name.removesuffix(LATEST)


DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
          "h": 3600.0}  # fmt: skip


def keep_alive_seconds(value: float | str | None) -> KeepAlive:
    """Ollama's ``keep_alive`` in seconds: a number of seconds, or a duration
    as Go writes one (``"5m"``, ``"1h30m"``, ``"10s"``, ``"0"``, ``"-1"``); any
    negative one, and any longer than :data:`MAX_KEEP_ALIVE_S`, is -1 (kept
    loaded for ever). ``"default"`` when not given: Ollama sets every
    request's keep-alive anew, and one that gives none brings back the
    model's own (a past request's does not last).

    Raises:
        ApiError: text that is no duration, a number that is not finite.
    """
    if value is None:
        return "default"
    seconds = float(value) if isinstance(value, float | int) else duration_seconds(value)
    if not math.isfinite(seconds):
        raise bad("keep_alive", f"keep_alive {value!r} is not a finite number of seconds "
                  "or duration (a negative one keeps the model loaded)")  # fmt: skip
    return -1.0 if seconds < 0 or seconds > MAX_KEEP_ALIVE_S else seconds


def duration_seconds(text: str) -> float:
    """A Go duration (``"1h30m"``, ``"-1.5h"``, ``"300ms"``), or a bare number
    of seconds, in seconds. Raises ApiError."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    parts = DURATION_PART.findall(body)
    if not body or "".join(number + unit for number, unit in parts) != body:
        raise bad("keep_alive", f"keep_alive {text!r} is no duration (a number of seconds, "
                  'or "5m", "1h30m", "10s", "-1")')  # fmt: skip
    return sign * sum(float(number) * UNIT_S[unit] for number, unit in parts)


NEUTRAL_SETTINGS: dict[str, tuple[float, str]] = {
    "mirostat": (0, "Mirostat sampling"),
    "typical_p": (1.0, "locally typical sampling"),
    "tfs_z": (1.0, "tail-free sampling"),
}
"""The samplers mlx-lm does not have: each option's setting that turns its
sampler off (taken), and the sampler's name for the 400 of any other."""


def check_samplers(options: Options) -> None:
    """Refuse the options that ask for samplers mlx-lm does not have.
    Raises ApiError naming the option."""
    for name, (off, sampler) in NEUTRAL_SETTINGS.items():
        value = getattr(options, name)
        if value is not None and value != off:
            raise bad(f"options.{name}", f"{sampler} is not one of mlx-lm's samplers "
                      f"({name} {off:g} turns it off)")  # fmt: skip
    if options.penalize_newline is False:
        raise bad("options.penalize_newline", "mlx-lm's penalties cover newlines as every "
                  "other token (true, or leave it out)")  # fmt: skip


def sampling_params(
    options: Options | None, logprobs: bool, top_logprobs: int
) -> tuple[SamplingParams, int | None]:
    """The options as the runner's sampler and logits processors, and the
    answer's length (None: the model's cap). A penalty of 0 (or a
    ``repeat_penalty`` of 1) is no penalty; ``repeat_last_n`` is the window
    of every penalty, as in llama.cpp (0: none, -1: the whole context).
    Raises ApiError."""
    options = options or Options()
    check_samplers(options)
    defaults = SamplingParams()
    window = options.repeat_last_n
    if window == -1:
        window = WHOLE_CONTEXT
    penalized = window != 0

    def penalty(value: float | None, off: float = 0.0) -> float | None:
        return value if penalized and value not in (None, 0.0, off) else None

    def chosen(value: Any, default: Any) -> Any:
        return default if value is None else value

    num_predict = options.num_predict
    sampling = SamplingParams(
        temperature=chosen(options.temperature, defaults.temperature),
        top_p=chosen(options.top_p, defaults.top_p),
        seed=options.seed if options.seed is not None and options.seed >= 0 else None,
        stop=stop_strings(options.stop),
        top_k=chosen(options.top_k, defaults.top_k),
        min_p=chosen(options.min_p, defaults.min_p),
        repetition_penalty=penalty(options.repeat_penalty, off=1.0),
        repetition_context_size=chosen(window or None, defaults.repetition_context_size),
        presence_penalty=penalty(options.presence_penalty),
        presence_context_size=chosen(window or None, defaults.presence_context_size),
        frequency_penalty=penalty(options.frequency_penalty),
        frequency_context_size=chosen(window or None, defaults.frequency_context_size),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    return sampling, None if num_predict is None or num_predict in NO_LIMIT else num_predict


def response_format(form: str | dict[str, Any] | None) -> ResponseFormat | None:
    """``format``: ``"json"`` (any JSON value) or a JSON schema. Raises ApiError."""
    if form is None or form == "":
        return None
    if form == "json":
        return ResponseFormat("json_object")
    if isinstance(form, dict):
        return ResponseFormat("json_schema", form)
    raise bad("format", f'format is "json" or a JSON schema (an object), not {form!r}')


def template_kwargs(think: bool | str | None) -> dict[str, Any] | None:
    """``think`` as the chat template's arguments: true or false as
    ``enable_thinking`` (Qwen3's and most thinking templates), a level as
    ``reasoning_effort`` too (gpt-oss's). Raises ApiError."""
    if think is None:
        return None
    if isinstance(think, bool):
        return {"enable_thinking": think}
    if think in THINK_LEVELS:
        return {"enable_thinking": True, "reasoning_effort": think}
    raise bad("think", f"think is true, false or one of {', '.join(THINK_LEVELS)}, "
              f"not {think!r}")  # fmt: skip


def tool_call(turn: ToolCallTurn, made_up_id: str) -> ToolCall:
    return ToolCall(turn.id or made_up_id, turn.function.name,
                    ENCODER.encode(turn.function.arguments).decode())  # fmt: skip


def answered_call(
    unanswered: list[ToolCall], call_id: str | None, name: str | None
) -> ToolCall | None:
    """The call a tool turn answers, of those not answered yet: the one its
    ``tool_call_id`` names, else the first of its tool (``tool_name``), else
    the first; None when there is none left to answer."""
    by_id = [call for call in unanswered if call_id is not None and call.id == call_id]
    by_name = [call for call in unanswered if name is not None and call.name == name]
    return next(iter([*by_id, *by_name, *unanswered]), None)


def chat_messages(turns: list[Turn]) -> list[ChatMessage]:
    """The turns as the runner takes them. Ollama has no tool call ids: an
    assistant turn's calls get ids made from their place in the chat (the
    same chat, the same ids, so that the prefix cache still matches), and
    each ``tool`` turn answers the earlier call it names, else the first
    one not answered yet, in order (one with nothing left to answer has no
    id). Raises ApiError."""
    messages = []
    unanswered: list[ToolCall] = []
    for i, turn in enumerate(turns):
        where = f"messages[{i}]"
        role = turn.role.lower()
        if role not in ROLES:
            raise bad(f"{where}.role", f"unsupported role {turn.role!r} (one of "
                      f"{', '.join(ROLES)})")  # fmt: skip
        images = ollama_images(turn.images, f"{where}.images")
        calls = None
        if turn.tool_calls:
            if role != "assistant":
                raise bad(f"{where}.tool_calls", "only an assistant turn has tool_calls")
            calls = [tool_call(call, f"call_{i}_{j}") for j, call in enumerate(turn.tool_calls)]
            unanswered += calls
        call_id, name = None, None
        if role == "tool":
            answered = answered_call(unanswered, turn.tool_call_id, turn.tool_name)
            if answered is not None:
                unanswered.remove(answered)
            call_id = answered.id if answered else None
            name = turn.tool_name or (answered.name if answered else None)
        messages.append(ChatMessage(role, turn.content or "", tool_calls=calls,
                                    tool_call_id=call_id, name=name, reasoning=turn.thinking,
                                    images=images or None,
                                    image_offsets=[0] * len(images) or None))  # fmt: skip
    return messages


def ollama_images(images: list[str] | None, where: str) -> list[bytes]:
    """Ollama's ``images``: base64 (a data URL too), placed before the text
    as Ollama's templates place them. Raises ApiError."""
    out = []
    for j, data in enumerate(images or ()):
        param = f"{where}[{j}]"
        out.append(data_url_bytes(data, param) if data.startswith("data:")
                   else decode_base64(data, param))  # fmt: skip
    return out


def ollama_call(
    body: Body,
    received_at: float,
    *,
    messages: list[ChatMessage] | None = None,
    prompt: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> OllamaCall:
    """The call of a chat (``messages``) or of a raw prompt, with what chat
    and generate share: sampling, length, format, thinking, streaming and
    keep-alive. Raises ApiError."""
    sampling, max_tokens = sampling_params(body.options, bool(body.logprobs),
                                           body.top_logprobs or 0)  # fmt: skip
    if body.top_logprobs and not body.logprobs:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    options = ChatOptions(tools=tools, response_format=response_format(body.format),
                          chat_template_kwargs=template_kwargs(body.think))  # fmt: skip
    opts = body.options or Options()
    chosen = given(temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k,
                   min_p=opts.min_p, repetition_penalty=opts.repeat_penalty,
                   presence_penalty=opts.presence_penalty,
                   frequency_penalty=opts.frequency_penalty, seed=opts.seed,
                   max_tokens=opts.num_predict)  # fmt: skip
    return OllamaCall(
        chat=messages is not None, model=body.model, messages=messages, prompt=prompt,
        max_tokens=max_tokens, sampling=sampling, sampling_given=chosen, options=options,
        stream=body.stream is not False, keep_alive_s=keep_alive_seconds(body.keep_alive),
        received_at=received_at,
    )  # fmt: skip


def chat_call(body: ChatBody, received_at: float) -> OllamaCall:
    """The call an ``/api/chat`` body with messages asks for. Raises ApiError."""
    tool_names(body.tools or [])
    messages = chat_messages(body.messages or [])
    return ollama_call(body, received_at, messages=messages, tools=body.tools or None)


def generate_call(body: GenerateBody, received_at: float) -> OllamaCall:
    """The call an ``/api/generate`` body with a prompt asks for: the prompt
    (after ``system``, if given) as a chat's user turn, rendered with the
    model's chat template as Ollama renders it; with ``raw``, the prompt as
    it is. Raises ApiError."""
    for name in ("suffix", "template"):
        if getattr(body, name):
            raise bad(name, f"{name} is not supported: the model's own chat template "
                      "renders the prompt (or none, with raw: true)")  # fmt: skip
    if body.context:
        raise bad("context", "context (the token ids of an earlier answer) is not supported: "
                  "send the conversation to /api/chat")  # fmt: skip
    images = ollama_images(body.images, "images")
    if body.raw and images:
        raise bad("images", "images need the chat template, which raw: true leaves out")
    if body.raw:
        for name in ("system", "think"):
            if getattr(body, name) is not None:
                raise bad(name, f"{name} needs the chat template, which raw: true leaves out")
        return ollama_call(body, received_at, prompt=body.prompt)
    system = [ChatMessage("system", body.system)] if body.system else []
    messages = [*system, ChatMessage("user", body.prompt or "", images=images or None,
                                     image_offsets=[0] * len(images) or None)]  # fmt: skip
    return ollama_call(body, received_at, messages=messages)


# --- answers ---------------------------------------------------------------------


def rfc3339(seconds: float) -> str:
    """A wall-clock time as Ollama writes one (``2025-01-02T03:04:05.678901Z``)."""
    moment = datetime.datetime.fromtimestamp(seconds, datetime.UTC)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def nanoseconds(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def logprob_object(entry: TokenLogprob) -> dict[str, Any]:
    """One token's entry of an answer's ``logprobs``."""
    top_bytes = entry.top_bytes or [None] * len(entry.top)
    top = [{"token": t, "logprob": p, "bytes": b if b is not None else token_bytes(t)}
           for (t, p), b in zip(entry.top, top_bytes, strict=False)]  # fmt: skip
    shown: dict[str, Any] = {"token": entry.token, "logprob": entry.logprob,
                             "bytes": entry_bytes(entry)}  # fmt: skip
    if top:
        shown["top_logprobs"] = top
    return shown


def tool_call_object(call: ToolCall, index: int) -> dict[str, Any]:
    """A tool call as Ollama answers it: its arguments an object, not text.
    Raises ApiError (500) for arguments that are not JSON."""
    try:
        arguments = msgspec.json.decode(call.arguments) if call.arguments.strip() else {}
    except msgspec.DecodeError:
        raise ApiError(500, f"the model wrote a tool call whose arguments are not JSON: "
                       f"{call.arguments!r}", type="server_error",
                       code="invalid_tool_call") from None  # fmt: skip
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": arguments}}


def done_reason(done: GenerationDone) -> str:
    """Ollama's two: ``length`` when the answer was cut short for want of
    room (max tokens, or memory), else ``stop``."""
    return "length" if done.finish_reason in ("length", "memory_pressure") else "stop"


class OllamaAnswer:
    """An ``/api/chat`` or ``/api/generate`` answer (``generate``): a line per
    frame while it streams, and a last line with ``done`` true and the
    counts and durations; or all of it in one object.

    Args:
        call: the call answered (an :class:`OllamaCall`: its arrival times
            the durations).
        model: the model's name, as the answer gives it.
        generate: an ``/api/generate`` answer (``response``, not ``message``).
    """

    def __init__(self, call: CompletionCall, model: str, generate: bool) -> None:
        self.stream = call.stream
        self.model = model
        self.generate = generate
        self.logprobs = call.sampling.logprobs
        self.loaded_at = time.perf_counter()  # answers are made once the model is there
        self.received_at = call.received_at if isinstance(call, OllamaCall) else self.loaded_at
        self.content: list[str] = []
        self.thinking: list[str] = []
        self.tool_calls: list[ToolCall] = []
        self.token_logprobs: list[TokenLogprob] = []

    @property
    def tool_call_count(self) -> int:
        return len(self.tool_calls)

    def add(self, chunk: TextChunk, limit_calls: int | None = None) -> list[bytes]:
        calls = chunk.tool_calls or []
        if limit_calls is not None:
            calls = calls[: max(0, limit_calls - len(self.tool_calls))]
        first_call = len(self.tool_calls)
        self.content.append(chunk.text)
        self.thinking.append(chunk.reasoning)
        self.tool_calls += calls
        entries = chunk.logprobs or []
        self.token_logprobs += entries
        if not self.stream or not (chunk.text or chunk.reasoning or calls or entries):
            return []
        part = self._part(chunk.text, chunk.reasoning, calls, first_call)
        return [ndjson(ENCODER.encode(self._object(part, entries, done=False)))]

    def end(self, done: GenerationDone) -> list[bytes]:
        final = self._object(self._part("", "", [], 0), [], done=True)
        return [ndjson(ENCODER.encode({**final, **self._counts(done)}))]

    def whole(self, done: GenerationDone) -> bytes:
        part = self._part("".join(self.content), "".join(self.thinking), self.tool_calls, 0)
        whole = self._object(part, self.token_logprobs, done=True)
        return ENCODER.encode({**whole, **self._counts(done)})

    def _part(self, text: str, thinking: str, calls: list[ToolCall], first: int) -> dict[str, Any]:
        """The answer's words: a chat's ``message``, or generate's ``response``."""
        words: dict[str, Any] = {"response" if self.generate else "content": text}
        if thinking:
            words["thinking"] = thinking
        if calls:
            words["tool_calls"] = [tool_call_object(c, first + i) for i, c in enumerate(calls)]
        return words if self.generate else {"message": {"role": "assistant", **words}}

    def _object(
        self, part: dict[str, Any], entries: list[TokenLogprob], done: bool
    ) -> dict[str, Any]:
        shown = {"model": self.model, "created_at": rfc3339(time.time()), **part, "done": done}
        if self.logprobs and entries:
            shown["logprobs"] = [logprob_object(entry) for entry in entries]
        return shown

    def _counts(self, done: GenerationDone) -> dict[str, Any]:
        """The last object's reason, counts and durations (in nanoseconds, as
        Ollama's): the load is the wait for the model; the prompt's and the
        answer's durations come from the runner's rates. ``supervisor``:
        what Ollama's objects have no field for."""
        prompt_s = done.prompt_tokens / done.prompt_tps if done.prompt_tps > 0 else done.ttft_s
        eval_s = done.generation_tokens / done.generation_tps if done.generation_tps > 0 else 0
        return {
            "done_reason": done_reason(done),
            "total_duration": nanoseconds(time.perf_counter() - self.received_at),
            "load_duration": nanoseconds(self.loaded_at - self.received_at),
            "prompt_eval_count": done.prompt_tokens,
            "prompt_eval_duration": nanoseconds(prompt_s),
            "eval_count": done.generation_tokens,
            "eval_duration": nanoseconds(eval_s),
            "supervisor": supervisor_fields(done),
        }

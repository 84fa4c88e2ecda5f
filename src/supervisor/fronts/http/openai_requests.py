"""The OpenAI API's request bodies, of chat and text completions, and the
one request they translate into (:func:`completion_call`). The objects of a
reply live in :mod:`supervisor.fronts.http.openai_replies`.

Every field of a body is either honoured or refused: a field we do not know,
or cannot honour (``n`` > 1, several prompts, ``echo``), is a 400
naming it, because a parameter dropped in silence gives an answer the client
did not ask for and no way to tell. The few fields that change nothing about
the tokens (``user``, ``metadata``, ...) are accepted and ignored on purpose:
:data:`IGNORED_FIELDS`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from ipc.messages import (
    ChatMessage,
    ChatOptions,
    NamedTool,
    ResponseFormat,
    SamplingParams,
    ToolCall,
    ToolChoiceMode,
)
from supervisor.fronts.http.dialect import CompletionCall
from supervisor.fronts.http.errors import ApiError
from supervisor.fronts.http.images import ImageUrl, RemoteImage, attach_images, image_from_url
from supervisor.registry.defaults import given
from supervisor.registry.registry import MAX_STOP_CHARS, MAX_STOP_STRINGS

IGNORED_FIELDS: tuple[str, ...] = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
)
"""Request fields accepted and ignored on purpose: they label or route a
request on OpenAI's side and change nothing about the tokens (our prefix
cache needs no ``prompt_cache_key``). Every other field we do not honour is a
400. The README's OpenAI section lists these; :class:`Ignored` declares them."""

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries; OpenAI takes 300


# --- request bodies --------------------------------------------------------------
# Unknown fields are refused (forbid_unknown_fields): errors.validation_error
# turns msgspec's message into "unsupported parameter: X".

MaxTokens = Annotated[int, Meta(ge=1, le=1 << 31)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
Unit = Annotated[float, Meta(ge=0, le=1)]
ContextSize = Annotated[int, Meta(ge=1, le=1 << 20)]
LogitBias = Annotated[
    dict[Annotated[int, Meta(ge=0)], Annotated[float, Meta(ge=-100, le=100)]],
    Meta(max_length=MAX_LOGIT_BIAS),
]
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]


class Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A request object whose unknown fields are a 400, not ignored."""


class Ignored(Strict, kw_only=True):
    """The fields of :data:`IGNORED_FIELDS` (a test keeps the two the same)."""

    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None


class TextPart(msgspec.Struct):
    """One part of a message's content: text, or (in a user turn) an
    ``image_url`` (the type is checked by itself, so that any other part is
    refused by name)."""

    type: str
    text: str | None = None
    image_url: dict[str, Any] | str | None = None  # {"url": ..., "detail": ...}, or the URL


Content = str | list[TextPart] | None


class FunctionCall(Strict, kw_only=True):
    name: str
    arguments: str


class ToolCallTurn(Strict, kw_only=True):
    """A tool call in an assistant turn of the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatTurn(Strict, kw_only=True):
    """One message of a chat. ``reasoning_content`` (or mlx_lm.server's
    ``reasoning``) is an assistant turn's thinking as our replies gave it;
    ``refusal`` is taken only empty, as the openai client sends back an
    OpenAI answer."""

    role: str
    content: Content = None
    name: str | None = None
    tool_calls: list[ToolCallTurn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: None = None


class StreamOptions(Strict, kw_only=True):
    include_usage: bool | None = None


class FunctionName(Strict, kw_only=True):
    name: str


class NamedToolChoice(Strict, kw_only=True):
    type: Literal["function"]
    function: FunctionName


class JsonSchema(Strict, kw_only=True):
    name: str
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None  # enforced either way: the grammar allows nothing else


class TextFormat(Strict, tag="text", tag_field="type", kw_only=True):
    pass


class JsonObjectFormat(Strict, tag="json_object", tag_field="type", kw_only=True):
    pass


class JsonSchemaFormat(Strict, tag="json_schema", tag_field="type", kw_only=True):
    json_schema: JsonSchema


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]


class CompletionFields(Ignored, kw_only=True):
    """What chat and text completions share: the model, the length, and the
    sampler and logits processors of mlx-lm (``top_k``, ``min_p``, the
    penalties, ``logit_bias``, XTC, as mlx_lm.server takes them)."""

    model: str
    max_tokens: MaxTokens | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Unit | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    min_p: Unit | None = None
    repetition_penalty: Annotated[float, Meta(ge=0)] | None = None
    repetition_context_size: ContextSize | None = None
    presence_penalty: Penalty | None = None
    presence_context_size: ContextSize | None = None
    frequency_penalty: Penalty | None = None
    frequency_context_size: ContextSize | None = None
    logit_bias: LogitBias | None = None
    xtc_probability: Unit | None = None
    xtc_threshold: Unit | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # mlx_lm.server's field: one of the model's LoRA adapters, by reference or
    # name ("": none); the registry refuses any its config does not list.
    adapters: Annotated[str, Meta(max_length=4096)] | None = None


class ChatCompletionRequest(CompletionFields, kw_only=True):
    messages: list[ChatTurn]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoiceMode | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: TextFormat | JsonObjectFormat | JsonSchemaFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None
    max_reasoning_tokens: Annotated[int, Meta(ge=0, le=1 << 31)] | None = None


class CompletionRequest(CompletionFields, kw_only=True):
    prompt: str | list[str]
    logprobs: TopLogprobs | None = None  # the legacy API's count of alternatives


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """``stop`` as the runner takes it. Raises ApiError."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS or not all(0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise ApiError(
            400, f"stop takes up to {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_CHARS} "
            "characters", param="stop", code="bad_request",
        )  # fmt: skip
    return tuple(stops)


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="bad_request")


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}  # fmt: skip
"""OpenAI's roles as chat templates know them: ``developer`` is OpenAI's
newer name for ``system``, which most open models' templates do not know."""


def text_of(content: Content, param: str) -> str:
    """A message's content as text. Raises ApiError for non-text parts."""
    if not isinstance(content, list):
        return content or ""
    kinds = {part.type for part in content} - {"text"}
    if kinds:
        raise bad(param, f"only text content is supported, not {', '.join(sorted(kinds))}")
    return "".join(part.text or "" for part in content)


def user_content(content: Content, param: str) -> tuple[str, list[bytes | ImageUrl], list[int]]:
    """A user turn's text, and its ``image_url`` parts' images (data URLs'
    bytes, or http(s) URLs to fetch, see :mod:`~supervisor.fronts.http.images`)
    with the offset in the text where each goes. Raises ApiError for other parts."""
    if not isinstance(content, list) or all(part.type != "image_url" for part in content):
        return text_of(content, param), [], []
    text: str = ""
    images: list[bytes | ImageUrl] = []
    offsets: list[int] = []
    for k, part in enumerate(content):
        where = f"{param}[{k}]"
        if part.type == "text":
            text += part.text or ""
        elif part.type == "image_url":
            url = part.image_url.get("url") if isinstance(part.image_url, dict) else part.image_url
            if not isinstance(url, str) or not url:
                raise bad(f"{where}.image_url.url", "an image_url part needs its url")
            images.append(image_from_url(url, f"{where}.image_url.url"))
            offsets.append(len(text))
        else:
            raise bad(param, f"only text and image_url content is supported, not {part.type}")
    return text, images, offsets


def chat_messages(turns: list[ChatTurn]) -> tuple[list[ChatMessage], list[RemoteImage]]:
    """The turns as the runner takes them: text content, an assistant's tool
    calls (their arguments must be JSON), a tool turn's answer to one call;
    and the http(s) images to fetch into them. Raises ApiError."""
    if not turns:
        raise bad("messages", "messages is empty")
    messages = []
    remote: list[RemoteImage] = []
    for i, turn in enumerate(turns):
        where = f"messages[{i}]"
        role = ROLES.get(turn.role)
        if role is None:
            raise bad(f"{where}.role", f"unsupported role {turn.role!r} (one of "
                      f"{', '.join(ROLES)})")  # fmt: skip
        calls = None
        if turn.tool_calls:
            if role != "assistant":
                raise bad(f"{where}.tool_calls", "only an assistant turn has tool_calls")
            calls = []
            for j, call in enumerate(turn.tool_calls):
                try:
                    msgspec.json.decode(call.function.arguments)
                except msgspec.DecodeError:
                    raise bad(f"{where}.tool_calls[{j}].function.arguments",
                              "a tool call's arguments must be JSON text") from None  # fmt: skip
                calls.append(ToolCall(call.id, call.function.name, call.function.arguments))
        if role == "tool" and not turn.tool_call_id:
            raise bad(f"{where}.tool_call_id", "a tool turn names the call it answers")
        images: list[bytes | ImageUrl] = []
        offsets: list[int] = []
        if role == "user":
            text, images, offsets = user_content(turn.content, f"{where}.content")
        else:
            text = text_of(turn.content, f"{where}.content")
        message = ChatMessage(
            role, text, tool_calls=calls,
            tool_call_id=turn.tool_call_id if role == "tool" else None, name=turn.name,
            reasoning=turn.reasoning_content or turn.reasoning, image_offsets=offsets or None,
        )  # fmt: skip
        remote += attach_images(message, images)
        messages.append(message)
    return messages, remote


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    """The names of OpenAI function tools. Raises ApiError for any other kind."""
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise bad(f"tools[{i}]", 'only {"type": "function", "function": {...}} tools '
                      "are supported")  # fmt: skip
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad(f"tools[{i}].function.name", "a function tool needs a name")
        names.append(name)
    return names


def chat_options(body: ChatCompletionRequest) -> ChatOptions:
    """Tools, tool choice, answer format and template arguments, checked.
    ``reasoning_effort`` goes to the chat template as the variable of that
    name (gpt-oss's reads it), and ``"none"`` as ``enable_thinking=False``
    (Qwen3's and most thinking templates), unless chat_template_kwargs says
    otherwise. Raises ApiError."""
    names = tool_names(body.tools or [])
    choice: ToolChoiceMode | NamedTool = "auto"
    if isinstance(body.tool_choice, NamedToolChoice):
        name = body.tool_choice.function.name
        if name not in names:
            raise bad("tool_choice", f"tool_choice names {name!r}, which is not in tools")
        choice = NamedTool(name)
    elif body.tool_choice is not None:
        choice = body.tool_choice
    if choice == "required" and not names:
        raise bad("tool_choice", 'tool_choice "required" needs tools')
    form = body.response_format
    response_format = None
    if isinstance(form, JsonObjectFormat):
        response_format = ResponseFormat("json_object")
    elif isinstance(form, JsonSchemaFormat):
        spec = form.json_schema  # without a schema (OpenAI allows it): any JSON object
        kind: Literal["json_object", "json_schema"] = "json_object"
        if spec.schema is not None:
            kind = "json_schema"
        response_format = ResponseFormat(kind, spec.schema, spec.name)
    kwargs = reasoning_kwargs(body.reasoning_effort, body.chat_template_kwargs)
    return ChatOptions(
        tools=body.tools or None, tool_choice=choice, response_format=response_format,
        chat_template_kwargs=kwargs or None,
    )  # fmt: skip


def reasoning_kwargs(effort: str | None, given: dict[str, Any] | None = None) -> dict[str, Any]:
    """The chat template's arguments for a reasoning effort, on top of those
    ``given``, which win: the effort as the variable of that name (gpt-oss's
    template reads it), and ``"none"`` as ``enable_thinking=False`` (Qwen3's
    and most thinking templates)."""
    kwargs = dict(given or {})
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
        if effort == "none":
            kwargs.setdefault("enable_thinking", False)
    return kwargs


def sampling_params(
    body: ChatCompletionRequest | CompletionRequest, logprobs: bool, top_logprobs: int
) -> SamplingParams:
    """The body's sampler and logits processors (max_tokens is set later,
    once the model's cap is known). A penalty of 0 is no penalty, as in
    mlx_lm.server."""
    defaults = SamplingParams()

    def given(value: float | None) -> float | None:
        return value if value else None

    def chosen(value: Any, default: Any) -> Any:
        return default if value is None else value

    return SamplingParams(
        temperature=chosen(body.temperature, defaults.temperature),
        top_p=chosen(body.top_p, defaults.top_p),
        seed=body.seed,
        stop=stop_strings(body.stop),
        top_k=chosen(body.top_k, defaults.top_k),
        min_p=chosen(body.min_p, defaults.min_p),
        repetition_penalty=given(body.repetition_penalty),
        repetition_context_size=chosen(
            body.repetition_context_size, defaults.repetition_context_size
        ),
        presence_penalty=given(body.presence_penalty),
        presence_context_size=chosen(body.presence_context_size, defaults.presence_context_size),
        frequency_penalty=given(body.frequency_penalty),
        frequency_context_size=chosen(body.frequency_context_size, defaults.frequency_context_size),
        logit_bias=body.logit_bias or None,
        xtc_probability=chosen(body.xtc_probability, defaults.xtc_probability),
        xtc_threshold=chosen(body.xtc_threshold, defaults.xtc_threshold),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        max_reasoning_tokens=getattr(body, "max_reasoning_tokens", None),
    )


def sampling_given(body: ChatCompletionRequest | CompletionRequest) -> tuple[str, ...]:
    """The sampling fields the body set (a model's configured defaults fill in the others)."""
    return given(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                 min_p=body.min_p, repetition_penalty=body.repetition_penalty,
                 presence_penalty=body.presence_penalty,
                 frequency_penalty=body.frequency_penalty, seed=body.seed)  # fmt: skip


def completion_call(body: ChatCompletionRequest | CompletionRequest) -> CompletionCall:
    """The request a chat or text completion's body asks for, checked.
    Raises ApiError."""
    if body.n not in (None, 1):
        raise bad("n", "only n = 1 is supported")
    options = body.stream_options
    include_usage = bool(options is not None and options.include_usage)
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
        sampling = sampling_params(body, bool(body.logprobs), body.top_logprobs or 0)
        messages, remote = chat_messages(body.messages)
        return CompletionCall(
            chat=True, model=body.model, messages=messages, remote_images=remote, prompt=None,
            max_tokens=body.max_completion_tokens or body.max_tokens, sampling=sampling,
            sampling_given=sampling_given(body),
            options=chat_options(body), stream=bool(body.stream), include_usage=include_usage,
            single_tool_call=body.parallel_tool_calls is False and bool(body.tools),
            adapter=body.adapters,
        )  # fmt: skip
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise bad("prompt", "give one prompt per request")
        prompt = prompt[0]
    sampling = sampling_params(body, body.logprobs is not None, body.logprobs or 0)
    return CompletionCall(
        chat=False, model=body.model, messages=None, prompt=prompt, max_tokens=body.max_tokens,
        sampling=sampling, sampling_given=sampling_given(body), stream=bool(body.stream),
        include_usage=include_usage, adapter=body.adapters,
    )  # fmt: skip

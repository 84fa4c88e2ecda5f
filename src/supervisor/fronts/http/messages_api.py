"""Anthropic's Messages API as a dialect of the request path: ``POST
/v1/messages`` (a whole message, or its stream of named events) and ``POST
/v1/messages/count_tokens``. The replies are
:mod:`~supervisor.fronts.http.messages_replies`'.

A body translates into the one chat request: the ``system`` prompt into a
system turn; in a user turn, each ``tool_result`` block into a ``tool`` turn
(before the turn's text, as Anthropic has tool results come first); in an
assistant turn, ``tool_use`` blocks into tool calls and ``thinking`` blocks
into its reasoning; Anthropic's tools into OpenAI function tools, as chat
templates take them. The text blocks of one turn are joined with a blank
line between them.

Every field is honoured or refused with a 400 that names it: documents,
server tools, an assistant turn last (a prefill: the chat
template would start a new answer, not go on with it). On purpose, some
things are accepted and ignored: :data:`IGNORED_FIELDS`, which label a
request on Anthropic's side; ``cache_control`` wherever it is (our prefix
cache is automatic); a text block's ``citations``; and ``redacted_thinking``
blocks, which are dropped (their thinking is encrypted for Anthropic's
models: no model here can read it).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import anyio
import msgspec
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ipc.messages import (
    ChatMessage,
    ChatOptions,
    NamedTool,
    ResponseFormat,
    SamplingParams,
    ToolCall,
    ToolChoiceMode,
)
from supervisor.config import SupervisorConfig
from supervisor.fronts.http.completions import Completions
from supervisor.fronts.http.dialect import CompletionCall
from supervisor.fronts.http.errors import ENCODER
from supervisor.fronts.http.images import (
    ImageUrl,
    RemoteImage,
    attach_images,
    check_images,
    decode_base64,
    image_from_url,
)
from supervisor.fronts.http.messages_replies import ANTHROPIC, MessagesAnswer
from supervisor.fronts.http.openai_requests import MaxTokens, Strict, Unit, bad, reasoning_kwargs
from supervisor.fronts.http.requests import ApiKey, guarded, read_json
from supervisor.fronts.http.routes import InfoRoutes
from supervisor.fronts.http.streaming import Framing
from supervisor.metrics import Front
from supervisor.registry.defaults import given
from supervisor.registry.registry import MAX_STOP_CHARS, MAX_STOP_STRINGS, RequestError

T = TypeVar("T")

IGNORED_FIELDS: tuple[str, ...] = ("metadata", "service_tier", "cache_control")
"""Request fields accepted and ignored on purpose: ``metadata`` (a user id)
and ``service_tier`` label or route a request on Anthropic's side, and
``cache_control`` asks for prompt caching, which our prefix cache does by
itself. Every other field we do not honour is a 400."""

TURN_SEPARATOR = "\n\n"  # between the text blocks of one turn, or of the system prompt


# --- request bodies --------------------------------------------------------------
# Content blocks and tools are decoded by type, one at a time (block_of,
# function_tool), so that an unsupported one is refused by its type's name.


class TextBlock(Strict, tag="text", tag_field="type", kw_only=True):
    text: str
    cache_control: Any = None
    citations: Any = None  # of Anthropic's documents, which we do not take


class ToolUseBlock(Strict, tag="tool_use", tag_field="type", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Any = None


class ToolResultBlock(Strict, tag="tool_result", tag_field="type", kw_only=True):
    tool_use_id: str
    content: str | list[dict[str, Any]] = ""
    is_error: bool = False
    cache_control: Any = None


class ThinkingBlock(Strict, tag="thinking", tag_field="type", kw_only=True):
    thinking: str
    signature: str | None = None  # Anthropic's; ours are empty


class RedactedThinkingBlock(Strict, tag="redacted_thinking", tag_field="type", kw_only=True):
    data: str


class ImageBlock(Strict, tag="image", tag_field="type", kw_only=True):
    """An image in a user turn: ``{"type": "base64", "media_type", "data"}``
    or ``{"type": "url", "url"}`` (see :mod:`~supervisor.fronts.http.images`)."""

    source: dict[str, Any]
    cache_control: Any = None


ContentBlock = (
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock | ImageBlock
)
BLOCK_TYPES: dict[str, type[ContentBlock]] = {
    "text": TextBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock,
    "redacted_thinking": RedactedThinkingBlock,
    "image": ImageBlock,
}
LATER_BLOCK_TYPES = ("document",)  # refused for now, by name


class CustomTool(Strict, kw_only=True):
    """A tool the client runs (Anthropic's ``custom`` tool)."""

    name: Annotated[str, Meta(min_length=1)]
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: Any = None


class Turn(Strict, kw_only=True):
    role: str
    content: str | list[dict[str, Any]]


class ToolChoice(Strict, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Strict, kw_only=True):
    """``enabled`` with a budget of thinking tokens, ``adaptive`` (the model
    thinks as long as it likes) or ``disabled``; ``display`` "omitted"
    leaves the thinking blocks of the answer empty."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Meta(ge=1, le=1 << 31)] | None = None
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(Strict, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(Strict, kw_only=True):
    """``effort``: how hard the model should think (to the chat template as
    ``reasoning_effort``, as the OpenAI front's ``reasoning_effort``);
    ``format``: a JSON schema the answer follows (constrained decoding)."""

    effort: Literal["low", "medium", "high", "max"] | None = None
    format: OutputFormat | None = None


class ContextManagement(Strict, kw_only=True):
    """Anthropic's context editing (clearing old tool results or thinking
    once a prompt grows past a trigger). Not applied here: the prompt goes
    to the model whole, and the answer's ``context_management`` says that
    no edit was applied. Taken because Claude Code sends it with every
    request."""

    edits: list[dict[str, Any]] = msgspec.field(default_factory=list)


class Prompt(Strict, kw_only=True):
    """What makes the prompt: ``count_tokens``' whole body."""

    model: str
    messages: list[Turn]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None
    cache_control: Any = None


class MessagesRequest(Prompt, kw_only=True):
    """``POST /v1/messages``' body."""

    max_tokens: MaxTokens
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_p: Unit | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    metadata: Any = None
    service_tier: Any = None


class MessagesCall(CompletionCall, kw_only=True):
    """A Messages request on the request path; ``show_thinking`` false:
    the answer's thinking blocks are empty (``thinking.display`` "omitted");
    ``context_management``: the request asked for context editing, and its
    answer says that none was applied."""

    show_thinking: bool = True
    context_management: bool = False  # asked for: the answer says no edit was applied


# --- translation -----------------------------------------------------------------


def convert(raw: Any, kind: type[T], where: str) -> T:
    """``raw`` (decoded JSON at ``where`` in the body) as ``kind``. Raises
    ApiError naming the field it cannot take."""
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        text = str(exc).replace("`$", f"`{where}")
        unknown = re.fullmatch(r"Object contains unknown field `(.+?)`(?: - at `(.+)`)?", text)
        if unknown is not None:
            field, path = unknown.groups()
            param = f"{path or where}.{field}"
            raise bad(param, f"unsupported parameter: {param}") from None
        raise bad(where, f"invalid {where}: {text}") from None


def block_of(raw: dict[str, Any], where: str) -> ContentBlock:
    """One content block. Raises ApiError for a type we do not take."""
    kind = raw.get("type")
    if kind in LATER_BLOCK_TYPES:
        raise bad(f"{where}.type", f"{kind} content blocks are not supported ({where}): "
                  "send text")  # fmt: skip
    block_type = BLOCK_TYPES.get(kind) if isinstance(kind, str) else None
    if block_type is None:
        raise bad(f"{where}.type", f"unsupported content block type {kind!r} ({where}; "
                  f"supported: {', '.join(BLOCK_TYPES)})")  # fmt: skip
    return convert(raw, block_type, where)


def text_of(content: str | list[dict[str, Any]], where: str) -> str:
    """Content that may hold only text blocks (the system prompt, a tool
    result), as text. Raises ApiError for any other block."""
    if isinstance(content, str):
        return content
    texts = []
    for j, raw in enumerate(content):
        block = block_of(raw, f"{where}[{j}]")
        if not isinstance(block, TextBlock):
            raise bad(f"{where}[{j}]", f"{where} takes text blocks only, not {raw['type']}")
        texts.append(block.text)
    return TURN_SEPARATOR.join(texts)


def turn_messages(turn: Turn, where: str) -> tuple[list[ChatMessage], list[RemoteImage]]:
    """One Anthropic turn as the runner's chat messages: a user turn's tool
    results as ``tool`` turns before its text; an assistant turn's tool
    calls and thinking. And the http(s) images to fetch into them. Raises
    ApiError."""
    content = turn.content
    raws = [{"type": "text", "text": content}] if isinstance(content, str) else content
    blocks = [(f"{where}.content[{j}]", block_of(raw, f"{where}.content[{j}]"))
              for j, raw in enumerate(raws)]  # fmt: skip
    if turn.role == "user":
        return user_messages(blocks)
    if turn.role == "assistant":
        return [assistant_message(blocks)], []
    raise bad(f"{where}.role", f"unsupported role {turn.role!r} (user or assistant; the "
              "system prompt is the body's system field)")  # fmt: skip


def user_messages(
    blocks: list[tuple[str, ContentBlock]],
) -> tuple[list[ChatMessage], list[RemoteImage]]:
    """A user turn's tool results (``is_error``: the text says so), then its
    text and images; the http(s) images to fetch into it."""
    results: list[ChatMessage] = []
    texts: list[str] = []
    images: list[bytes | ImageUrl] = []
    offsets: list[int] = []
    for where, block in blocks:
        if isinstance(block, ImageBlock):
            images.append(image_of(block, where))
            offsets.append(len(TURN_SEPARATOR.join(texts)))
        elif isinstance(block, ToolResultBlock):
            text = text_of(block.content, f"{where}.content")
            if block.is_error:
                text = f"Error: {text}"
            results.append(ChatMessage("tool", text, tool_call_id=block.tool_use_id))
        elif isinstance(block, TextBlock):
            texts.append(block.text)
        else:
            kind = block_tag(block)
            raise bad(where, f"a user turn holds text and tool_result blocks, not {kind}")
    remote: list[RemoteImage] = []
    if texts or images or not results:
        message = ChatMessage("user", TURN_SEPARATOR.join(texts), image_offsets=offsets or None)
        remote = attach_images(message, images)
        results.append(message)
    return results, remote


def image_of(block: ImageBlock, where: str) -> bytes | ImageUrl:
    """An image block's bytes (or an http(s) URL to fetch). Raises ApiError."""
    source = block.source
    kind = source.get("type")
    if kind == "base64" and isinstance(source.get("data"), str):
        return decode_base64(source["data"], f"{where}.source.data")
    if kind == "url" and isinstance(source.get("url"), str):
        url: str = source["url"]
        if not url.startswith(("http://", "https://", "data:")):
            raise bad(f"{where}.source.url", "an image url must be http(s)")
        return image_from_url(url, f"{where}.source.url")
    raise bad(f"{where}.source", 'an image source is {"type": "base64", "media_type", "data"} '
              'or {"type": "url", "url"}')  # fmt: skip


def assistant_message(blocks: list[tuple[str, ContentBlock]]) -> ChatMessage:
    """An assistant turn: its text, tool calls (their input as JSON text)
    and thinking; ``redacted_thinking`` is dropped (see the module's doc)."""
    texts, thoughts, calls = [], [], []
    for where, block in blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            arguments = ENCODER.encode(block.input).decode()
            calls.append(ToolCall(block.id, block.name, arguments))
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        elif not isinstance(block, RedactedThinkingBlock):
            raise bad(where, "an assistant turn holds text, tool_use and thinking blocks, "
                      f"not {block_tag(block)}")  # fmt: skip
    return ChatMessage(
        "assistant", TURN_SEPARATOR.join(texts), tool_calls=calls or None,
        reasoning=TURN_SEPARATOR.join(thoughts) if thoughts else None,
    )  # fmt: skip


def block_tag(block: ContentBlock) -> str:
    """A block's ``type``."""
    return str(block.__struct_config__.tag)


def chat_messages(body: Prompt) -> tuple[list[ChatMessage], list[RemoteImage]]:
    """The system prompt and the turns as the runner takes them, and the
    http(s) images to fetch into them. Raises ApiError."""
    if not body.messages:
        raise bad("messages", "messages is empty")
    if body.messages[-1].role == "assistant":
        last = len(body.messages) - 1
        raise bad(f"messages[{last}]", "the last turn is the assistant's (a prefill): not "
                  "supported, the answer would not go on from it")  # fmt: skip
    messages = []
    remote: list[RemoteImage] = []
    if body.system:
        messages.append(ChatMessage("system", text_of(body.system, "system")))
    for i, turn in enumerate(body.messages):
        turn_chat, turn_remote = turn_messages(turn, f"messages[{i}]")
        messages += turn_chat
        remote += turn_remote
    return messages, remote


def function_tool(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """An Anthropic custom tool as an OpenAI function tool. Raises ApiError
    for a server tool (any other ``type``)."""
    kind = raw.get("type")
    if kind not in (None, "custom"):
        raise bad(f"{where}.type", f"server tool {kind!r} is not supported: only tools the "
                  "client runs ({name, description, input_schema})")  # fmt: skip
    tool = convert(raw, CustomTool, where)
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.input_schema
    return {"type": "function", "function": function}


def chat_options(body: Prompt) -> ChatOptions:
    """Tools, tool choice and thinking, checked. Thinking goes to the chat
    template as ``enable_thinking`` (absent: the template's default).
    Raises ApiError."""
    tools = [function_tool(raw, f"tools[{i}]") for i, raw in enumerate(body.tools or [])]
    names = [tool["function"]["name"] for tool in tools]
    mode: ToolChoiceMode | NamedTool = "auto"
    choice = body.tool_choice
    if choice is not None:
        if (choice.type == "tool") != (choice.name is not None):
            raise bad("tool_choice.name", 'tool_choice names a tool when, and only when, its '
                      'type is "tool"')  # fmt: skip
        if choice.name is not None and choice.name not in names:
            raise bad("tool_choice.name", f"tool_choice names {choice.name!r}, which is not "
                      "in tools")  # fmt: skip
        if choice.type == "any" and not tools:
            raise bad("tool_choice", 'tool_choice "any" needs tools')
        modes: dict[str, ToolChoiceMode] = {"auto": "auto", "any": "required", "none": "none"}
        mode = NamedTool(choice.name) if choice.name is not None else modes[choice.type]
    kwargs = {}
    if body.thinking is not None:
        kwargs["enable_thinking"] = body.thinking.type != "disabled"
    output = body.output_config or OutputConfig()
    kwargs = reasoning_kwargs(output.effort, kwargs)
    form = None
    if output.format is not None:
        form = ResponseFormat("json_schema", output.format.schema, "output")
    return ChatOptions(tools=tools or None, tool_choice=mode, response_format=form,
                       chat_template_kwargs=kwargs or None)  # fmt: skip


def reasoning_budget(thinking: Thinking | None) -> int | None:
    """The most thinking tokens ``thinking`` allows. Raises ApiError."""
    if thinking is None:
        return None
    if thinking.type == "enabled" and thinking.budget_tokens is None:
        raise bad("thinking.budget_tokens", 'thinking "enabled" needs budget_tokens')
    if thinking.type != "enabled" and thinking.budget_tokens is not None:
        raise bad("thinking.budget_tokens", f'thinking "{thinking.type}" takes no budget_tokens')
    return thinking.budget_tokens


def stop_sequences(stops: list[str] | None) -> tuple[str, ...]:
    """``stop_sequences`` as the runner takes them. Raises ApiError."""
    stops = stops or []
    if len(stops) > MAX_STOP_STRINGS or not all(0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise bad("stop_sequences", f"stop_sequences takes up to {MAX_STOP_STRINGS} strings "
                  f"of 1 to {MAX_STOP_CHARS} characters")  # fmt: skip
    return tuple(stops)


def messages_call(body: MessagesRequest) -> MessagesCall:
    """The request a Messages body asks for, checked. Raises ApiError."""
    defaults = SamplingParams()
    sampling = SamplingParams(
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        top_k=defaults.top_k if body.top_k is None else body.top_k,
        stop=stop_sequences(body.stop_sequences),
        max_reasoning_tokens=reasoning_budget(body.thinking),
    )
    options = chat_options(body)
    choice = body.tool_choice
    single = bool(options.tools and choice is not None and choice.disable_parallel_tool_use)
    shown = body.thinking is None or body.thinking.display != "omitted"
    messages, remote = chat_messages(body)
    return MessagesCall(
        chat=True, model=body.model, messages=messages, remote_images=remote, prompt=None,
        max_tokens=body.max_tokens, sampling=sampling, options=options,
        sampling_given=given(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k),
        stream=bool(body.stream), single_tool_call=single, show_thinking=shown,
        context_management=body.context_management is not None,
    )  # fmt: skip


# --- the routes ------------------------------------------------------------------


class Messages:
    """``POST /v1/messages``."""

    framing: Framing = ANTHROPIC
    front: Front = "anthropic"

    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self._decoder = msgspec.json.Decoder(MessagesRequest)

    async def parse(self, request: Request) -> CompletionCall:
        body = await read_json(request, self._decoder, self.config)
        call = messages_call(body)
        check_images(call.messages, call.remote_images, self.config)
        return call

    def answer(self, call: CompletionCall, model: str) -> MessagesAnswer:
        assert isinstance(call, MessagesCall)
        return MessagesAnswer(call, model, show_thinking=call.show_thinking,
                              context_management=call.context_management)  # fmt: skip


class TokenCounter:
    """``POST /v1/messages/count_tokens``: the prompt tokens a body makes
    with the model's own chat template (the model is loaded on demand)."""

    def __init__(self, completions: Completions) -> None:
        self.completions = completions
        self._decoder = msgspec.json.Decoder(Prompt)

    async def count(self, request: Request) -> Response:
        body = await read_json(request, self._decoder, self.completions.config)
        reasoning_budget(body.thinking)  # checked as a message's would be
        (messages, remote), options = chat_messages(body), chat_options(body)
        check_images(messages, remote, self.completions.config)
        entry = await self.completions.model_for(body.model, anyio.Event())
        if entry is None:  # only a cancel gives none, and nothing cancels this one
            raise RequestError("internal", f"{body.model} was not found or loaded")
        await self.completions.ready_images(messages, remote, entry)  # as a message's
        count = await self.completions.registry.count_tokens(entry, messages, None, options)
        return Response(ENCODER.encode({"input_tokens": count}), media_type="application/json")


def routes(completions: Completions, info: InfoRoutes, key: ApiKey) -> list[Route]:
    """The Messages API's routes, with Anthropic's error shape."""
    messages = completions.route_for(Messages(completions.config))
    count = guarded(TokenCounter(completions).count, key, ANTHROPIC)
    return [
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count, methods=["POST"]),
    ]

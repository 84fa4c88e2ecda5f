"""OpenAI's Responses API as a dialect of the request path: ``POST
/v1/responses``. Its body becomes the one chat request
(:func:`responses_call`); the reply objects and the stream's events live in
:mod:`supervisor.fronts.http.responses_replies`.

Nothing is stored: every response answers the history its request sends as
``input`` (messages, the model's earlier reasoning, function calls and their
outputs, as a response's ``output`` gives them back), so
``previous_response_id``, ``conversation`` and ``background`` are refused
and a reply says ``store: false``. As in the OpenAI front, every field is
honoured or refused with a 400 naming it; those that only label a request
(:data:`~supervisor.fronts.http.openai_requests.IGNORED_FIELDS`) are
accepted and ignored on purpose.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta
from starlette.requests import Request
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
from supervisor.fronts.http.errors import ApiError, validation_error
from supervisor.fronts.http.images import (
    ImageUrl,
    RemoteImage,
    attach_images,
    check_images,
    image_from_url,
)
from supervisor.fronts.http.openai_requests import (
    ROLES,
    Ignored,
    JsonObjectFormat,
    MaxTokens,
    Strict,
    TextFormat,
    TopLogprobs,
    Unit,
    bad,
    reasoning_kwargs,
)
from supervisor.fronts.http.requests import ApiKey, read_json
from supervisor.fronts.http.responses_replies import (
    RESPONSES,
    ResponseEvents,
    ResponsesAnswer,
    ResponsesCall,
)
from supervisor.fronts.http.routes import InfoRoutes
from supervisor.fronts.http.streaming import Framing
from supervisor.metrics import Front
from supervisor.registry.defaults import given

T = TypeVar("T")

LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = (LOGPROBS, "reasoning.encrypted_content")
"""What ``include`` may ask for: the message's logprobs, and the reasoning in
a form that can go back as input, which is every reasoning item's
``content``, in the clear (``encrypted_content`` stays null: there is no
secret to keep)."""

NOT_STORED = "nothing is stored here: send the whole history as input"
TEXT_PARTS = ("input_text", "output_text")
TOOL_MODES: dict[str, ToolChoiceMode] = {"auto": "auto", "none": "none", "required": "required"}


# --- request bodies --------------------------------------------------------------


class ResponseJsonSchema(Strict, tag="json_schema", tag_field="type", kw_only=True):
    name: str
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None  # enforced either way: the grammar allows nothing else


class TextConfig(Strict, kw_only=True):
    format: TextFormat | JsonObjectFormat | ResponseJsonSchema | None = None


class ReasoningConfig(Strict, kw_only=True):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(Strict, kw_only=True):
    include_obfuscation: bool | None = None


class ResponsesRequest(Ignored, kw_only=True):
    """A request's body. ``input`` items and ``tools`` are checked one by
    one (:func:`chat_messages`, :func:`function_tools`), so that a kind we
    do not take is refused by its name."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Unit | None = None
    top_logprobs: TopLogprobs | None = None
    include: list[str] | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    truncation: str | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None


class InputText(Strict, tag="input_text", tag_field="type", kw_only=True):
    text: str


class InputImage(Strict, tag="input_image", tag_field="type", kw_only=True):
    """An image in a user message: ``image_url`` a data URL or http(s) (see
    :mod:`~supervisor.fronts.http.images`); a ``file_id`` is refused (no
    file is stored here)."""

    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class OutputText(Strict, tag="output_text", tag_field="type", kw_only=True):
    """Text of an earlier answer, as a response's output gives it back."""

    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] | None = None


class MessageItem(Strict, kw_only=True):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText | OutputText | InputImage]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(Strict, tag="function_call", tag_field="type", kw_only=True):
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict, tag="function_call_output", tag_field="type", kw_only=True):
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None


class SummaryText(Strict, tag="summary_text", tag_field="type", kw_only=True):
    text: str


class ReasoningText(Strict, tag="reasoning_text", tag_field="type", kw_only=True):
    text: str


class ReasoningItem(Strict, tag="reasoning", tag_field="type", kw_only=True):
    summary: list[SummaryText] = msgspec.field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    id: str | None = None
    status: str | None = None


class FunctionTool(Strict, kw_only=True):
    type: Literal["function"]
    name: Annotated[str, Meta(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


def converted(value: Any, kind: type[T], where: str) -> T:
    """``value`` (a part of the body) as ``kind``. Raises ApiError naming
    the field at fault, from ``where`` (``input[2]``) on."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        error = validation_error(exc)
        unknown = error.message.removeprefix("unsupported parameter: ")
        if unknown != error.message:
            param = f"{where}.{unknown}"
            raise ApiError(400, f"unsupported parameter: {param}", code="bad_request",
                           param=param) from None  # fmt: skip
        raise bad(where, f"invalid {where}: {exc}") from None


# --- the history ---------------------------------------------------------------------


def only_text(parts: Any, where: str, also: tuple[str, ...] = ()) -> None:
    """Refuse, by their type, parts other than text (files, audio; images
    too, unless ``also`` names ``input_image``). Raises ApiError."""
    if not isinstance(parts, list):
        return
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS + also:
            taken = "text and image" if also else "text"
            raise bad(f"{where}[{j}]", f"only {taken} content is supported, not {kind}")


def message_content(
    content: str | list[InputText | OutputText | InputImage], role: str, where: str
) -> tuple[str, list[bytes | ImageUrl], list[int]]:
    """A message's text, and its images (a user message's) with the offset
    in the text where each goes. Raises ApiError."""
    if isinstance(content, str):
        return content, [], []
    text = ""
    images: list[bytes | ImageUrl] = []
    offsets: list[int] = []
    for j, part in enumerate(content):
        if not isinstance(part, InputImage):
            text += part.text
            continue
        param = f"{where}[{j}]"
        if role != "user":
            raise bad(param, "only a user message holds images")
        if part.file_id is not None:
            raise bad(f"{param}.file_id", "file_id is not supported (no file is stored here): "
                      "send the image as image_url, a data URL or http(s)")  # fmt: skip
        if not part.image_url:
            raise bad(f"{param}.image_url", "an input_image needs its image_url")
        images.append(image_from_url(part.image_url, f"{param}.image_url"))
        offsets.append(len(text))
    return text, images, offsets


def text_of(content: str | list[InputText] | list[InputText | OutputText]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


class History:
    """The chat the ``input`` items make, built one item at a time: an
    assistant's reasoning joins its next message or call, function calls
    join the assistant turn before them, and each output answers a call
    made earlier in the input."""

    def __init__(self, instructions: str | None) -> None:
        self.messages = [] if instructions is None else [ChatMessage("system", instructions)]
        self.reasoning: str | None = None  # waiting for the assistant turn it belongs to
        self.call_names: dict[str, str] = {}
        self.remote: list[RemoteImage] = []  # http(s) images to fetch into the messages

    def add(self, item: Any, where: str) -> None:
        """One input item. Raises ApiError."""
        if not isinstance(item, dict):
            raise bad(where, "an input item is an object")
        kind = item.get("type", "message")
        if kind == "message":
            only_text(item.get("content"), f"{where}.content", also=("input_image",))
            self.message(converted(item, MessageItem, where), where)
        elif kind == "function_call":
            self.function_call(converted(item, FunctionCallItem, where), where)
        elif kind == "function_call_output":
            only_text(item.get("output"), f"{where}.output")
            self.function_output(converted(item, FunctionCallOutputItem, where), where)
        elif kind == "reasoning":
            self.add_reasoning(converted(item, ReasoningItem, where), where)
        elif kind == "item_reference":
            raise bad(where, f"an item_reference cannot be followed: {NOT_STORED}")
        else:
            raise bad(f"{where}.type", f"unsupported input item type {kind!r} (message, "
                      "function_call, function_call_output or reasoning)")  # fmt: skip

    def message(self, item: MessageItem, where: str) -> None:
        role = ROLES[item.role]
        text, images, offsets = message_content(item.content, role, f"{where}.content")
        if role != "assistant":
            self._flush_reasoning()
        message = ChatMessage(role, text, reasoning=self._reasoning(),
                              image_offsets=offsets or None)  # fmt: skip
        self.remote += attach_images(message, images)
        self.messages.append(message)

    def function_call(self, item: FunctionCallItem, where: str) -> None:
        try:
            msgspec.json.decode(item.arguments)
        except msgspec.DecodeError:
            raise bad(
                f"{where}.arguments", "a function call's arguments must be JSON text"
            ) from None
        call = ToolCall(item.call_id, item.name, item.arguments)
        self.call_names[item.call_id] = item.name
        last = self.messages[-1] if self.messages else None
        if last is not None and last.role == "assistant" and self.reasoning is None:
            last.tool_calls = [*(last.tool_calls or []), call]
            return
        self.messages.append(ChatMessage("assistant", "", [call], reasoning=self._reasoning()))

    def function_output(self, item: FunctionCallOutputItem, where: str) -> None:
        name = self.call_names.get(item.call_id)
        if name is None:
            raise bad(f"{where}.call_id", f"no function_call with call_id {item.call_id!r} "
                      f"comes before this output in input ({NOT_STORED})")  # fmt: skip
        self._flush_reasoning()
        self.messages.append(ChatMessage("tool", text_of(item.output), tool_call_id=item.call_id,
                                         name=name))  # fmt: skip

    def add_reasoning(self, item: ReasoningItem, where: str) -> None:
        if item.encrypted_content is not None:
            raise bad(f"{where}.encrypted_content", "encrypted reasoning cannot be read here; "
                      "send the reasoning's text as content")  # fmt: skip
        parts = item.content if item.content is not None else item.summary
        self.reasoning = (self.reasoning or "") + "".join(part.text for part in parts)

    def _reasoning(self) -> str | None:
        reasoning, self.reasoning = self.reasoning, None
        return reasoning

    def _flush_reasoning(self) -> None:
        """Reasoning that no message or call followed: an assistant turn of
        its own (an answer cut short while it thought)."""
        if self.reasoning is not None:
            self.messages.append(ChatMessage("assistant", "", reasoning=self._reasoning()))

    def end(self) -> list[ChatMessage]:
        self._flush_reasoning()
        return self.messages


def chat_messages(body: ResponsesRequest) -> tuple[list[ChatMessage], list[RemoteImage]]:
    """The instructions (a leading system message) and the input, as the
    runner's chat, and the http(s) images to fetch into it. Raises ApiError."""
    items: list[Any] = (
        body.input if isinstance(body.input, list) else [{"role": "user", "content": body.input}]
    )
    if not items:
        raise bad("input", "input is empty")
    history = History(body.instructions)
    for i, item in enumerate(items):
        history.add(item, f"input[{i}]")
    return history.end(), history.remote


# --- tools, format, reasoning ------------------------------------------------------------


def function_tools(tools: list[dict[str, Any]]) -> list[FunctionTool]:
    """The request's tools, each a function tool. Raises ApiError naming any
    other kind (web_search, file_search, mcp, ...)."""
    functions = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise bad(f"tools[{i}]", f"only function tools are supported, not {kind}")
        functions.append(converted(tool, FunctionTool, f"tools[{i}]"))
    return functions


def chat_tool(tool: FunctionTool) -> dict[str, Any]:
    """A function tool as chat templates take it (OpenAI chat's shape)."""
    shown = {k: v for k, v in msgspec.structs.asdict(tool).items() if v is not None}
    del shown["type"]
    return {"type": "function", "function": shown}


def tool_choice(
    choice: str | dict[str, Any] | None, names: list[str]
) -> ToolChoiceMode | NamedTool:
    """``tool_choice``, checked against the tools. Raises ApiError."""
    if choice is None:
        return "auto"
    if isinstance(choice, str) and choice in TOOL_MODES:
        if choice == "required" and not names:
            raise bad("tool_choice", 'tool_choice "required" needs tools')
        return TOOL_MODES[choice]
    if (
        not isinstance(choice, dict)
        or set(choice) != {"type", "name"}
        or choice["type"] != "function"
    ):
        raise bad("tool_choice", 'tool_choice is "auto", "none", "required" or '
                  '{"type": "function", "name": ...}')  # fmt: skip
    name = choice["name"]
    if name not in names:
        raise bad("tool_choice", f"tool_choice names {name!r}, which is not in tools")
    return NamedTool(name)


def response_format(text: TextConfig | None) -> ResponseFormat | None:
    form = text.format if text is not None else None
    if isinstance(form, JsonObjectFormat):
        return ResponseFormat("json_object")
    if isinstance(form, ResponseJsonSchema):
        return ResponseFormat("json_schema", form.schema, form.name)
    return None


def template_kwargs(reasoning: ReasoningConfig | None) -> dict[str, Any] | None:
    """The reasoning effort as the chat template's variable of that name
    (gpt-oss's reads it), and ``"none"`` as ``enable_thinking=False``
    (Qwen3's and most thinking templates), as the OpenAI front does for
    ``reasoning_effort``. Raises ApiError for a summary we cannot make."""
    if reasoning is None:
        return None
    if reasoning.summary not in (None, "auto"):
        raise bad("reasoning.summary", "reasoning is not summarized here; the whole of it "
                  'comes in the reasoning item\'s content (summary "auto" or null)')  # fmt: skip
    if reasoning.effort is None:
        return None
    return reasoning_kwargs(reasoning.effort)


# --- the call ----------------------------------------------------------------------------


def refuse_state(body: ResponsesRequest) -> None:
    """Refuse what would need a response kept on the server. Raises ApiError."""
    if body.previous_response_id is not None:
        raise bad("previous_response_id", f"previous_response_id cannot be followed: "
                  f"{NOT_STORED}")  # fmt: skip
    if body.conversation is not None:
        raise bad("conversation", f"conversations are not kept: {NOT_STORED}")
    if body.background:
        raise bad("background", "background responses are not supported: nothing is stored "
                  "to fetch later; stream the answer instead")  # fmt: skip
    if body.truncation not in (None, "disabled"):
        raise bad("truncation", 'only truncation "disabled" is supported: the input is never '
                  "cut to fit the context")  # fmt: skip
    if body.stream_options is not None and body.stream_options.include_obfuscation:
        raise bad("stream_options.include_obfuscation", "stream events carry no obfuscation")


def wants_logprobs(body: ResponsesRequest) -> bool:
    """Whether ``include`` asks for the message's logprobs. Raises ApiError
    for anything else we cannot include, and for top_logprobs without it."""
    for i, name in enumerate(body.include or []):
        if name not in INCLUDABLE:
            raise bad(f"include[{i}]", f"cannot include {name!r} (only "
                      f"{', '.join(INCLUDABLE)})")  # fmt: skip
    logprobs = LOGPROBS in (body.include or [])
    if body.top_logprobs is not None and not logprobs:
        raise bad("top_logprobs", f'top_logprobs needs include ["{LOGPROBS}"]')
    return logprobs


def echo(
    body: ResponsesRequest, sampling: SamplingParams, tools: list[FunctionTool]
) -> dict[str, Any]:
    """The request's settings as the Response object gives them back; the
    sampling ones as used (ours are greedy by default)."""
    form = body.text.format if body.text is not None else None
    reasoning = body.reasoning or ReasoningConfig()
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_logprobs": sampling.top_logprobs,
        "tool_choice": body.tool_choice or "auto",
        "tools": [msgspec.structs.asdict(tool) for tool in tools],
        "text": {"format": msgspec.to_builtins(form or TextFormat())},
        "reasoning": msgspec.to_builtins(reasoning),
        "truncation": "disabled",
        "metadata": body.metadata or {},
        "user": body.user,
        "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key,
    }


def responses_call(body: ResponsesRequest) -> ResponsesCall:
    """The request a Responses body asks for, checked. Raises ApiError."""
    refuse_state(body)
    logprobs = wants_logprobs(body)
    tools = function_tools(body.tools or [])
    names = [tool.name for tool in tools]
    options = ChatOptions(
        tools=[chat_tool(tool) for tool in tools] or None,
        tool_choice=tool_choice(body.tool_choice, names),
        response_format=response_format(body.text),
        chat_template_kwargs=template_kwargs(body.reasoning),
    )
    defaults = SamplingParams()
    sampling = SamplingParams(
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        logprobs=logprobs,
        top_logprobs=body.top_logprobs or 0,
    )
    stream = bool(body.stream)
    messages, remote = chat_messages(body)
    return ResponsesCall(
        chat=True, model=body.model, messages=messages, remote_images=remote, prompt=None,
        max_tokens=body.max_output_tokens, sampling=sampling, options=options, stream=stream,
        sampling_given=given(temperature=body.temperature, top_p=body.top_p),
        single_tool_call=body.parallel_tool_calls is False and bool(tools),
        events=ResponseEvents(body.model, echo(body, sampling, tools), stream),
    )  # fmt: skip


class ResponsesDialect:
    """``POST /v1/responses``."""

    framing: Framing = RESPONSES
    front: Front = "responses"

    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self._decoder = msgspec.json.Decoder(ResponsesRequest)

    async def parse(self, request: Request) -> ResponsesCall:
        call = responses_call(await read_json(request, self._decoder, self.config))
        check_images(call.messages, call.remote_images, self.config)
        return call

    def answer(self, call: CompletionCall, model: str) -> ResponsesAnswer:
        return ResponsesAnswer(call, model)


def routes(completions: Completions, info: InfoRoutes, key: ApiKey) -> list[Route]:
    """The Responses API's routes: ``POST /v1/responses``."""
    dialect = ResponsesDialect(completions.config)
    return [Route("/v1/responses", completions.route_for(dialect), methods=["POST"])]

"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``)
as the unmodified ``anthropic`` client reads it: whole messages and their
named-event streams, the blocks of thinking, text and tool use, usage with
the prefix cache's reads, stop reasons; what each request field becomes in
the runner's request; and errors in Anthropic's shape.

The shapes run against scripted runner frames (a stand-in registry behind
the real front, over ASGI); one test runs a real daemon with builtin:tiny,
where the count of a prompt's tokens must be the prompt of a real answer."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import anthropic
import msgspec
import pytest

from conftest import DaemonFactory
from ipc.messages import (
    ChatMessage,
    ChatOptions,
    GenerationDone,
    NamedTool,
    SamplingParams,
    TextChunk,
    ToolCall,
)
from scripted import ScriptedRegistry, asgi_http2, done, scripted_app
from supervisor.client import Client
from supervisor.config import HTTP_ENV
from supervisor.fronts.http import messages_api
from supervisor.fronts.http.messages_api import IGNORED_FIELDS, MessagesRequest
from supervisor.registry.registry import RequestError

HELLO: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
WEATHER_FUNCTION = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": WEATHER["input_schema"],
    },
}
CALLS = [
    ToolCall("toolu_1", "get_weather", '{"city": "Paris"}'),
    ToolCall("toolu_2", "get_weather", '{"city": "Rome"}'),
]
FRAMES: list[TextChunk | GenerationDone] = [
    TextChunk(1, "", 2, reasoning="They ask ", prompt_tokens=40, cached_tokens=32),
    TextChunk(1, "Let me ", 3, reasoning="the weather."),
    TextChunk(1, "look.", 4),
    TextChunk(1, "", 6, tool_calls=CALLS[:1]),
    TextChunk(1, "", 9, tool_calls=CALLS[1:]),
    msgspec.structs.replace(
        done("tool_calls", cached_tokens=32, reasoning_tokens=3), prompt_tokens=40
    ),
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def api_of(registry: ScriptedRegistry, key: str | None = None, api_key: str = "x") -> Any:
    """The real anthropic client on the real front, over ASGI, before
    ``registry`` (the client's own HTTP library, httpx2, carries it)."""
    app = scripted_app(registry, messages_api.routes, key=key)
    return anthropic.AsyncAnthropic(
        base_url="http://front", api_key=api_key, max_retries=0, http_client=asgi_http2(app)
    )


def blocks(message: Any) -> list[tuple[str, Any]]:
    """A message's content as (type, what it holds)."""
    held = {"thinking": "thinking", "text": "text", "tool_use": "input"}
    return [(b.type, getattr(b, held[b.type])) for b in message.content]


# --- the message, whole and streamed ---------------------------------------------------


@pytest.mark.anyio
async def test_a_whole_message_has_thinking_text_and_tool_use_blocks_and_cache_reads() -> None:
    api = api_of(ScriptedRegistry(FRAMES))
    message = await api.messages.create(
        model="tiny", max_tokens=64, messages=HELLO, tools=[WEATHER]
    )
    assert message.id.startswith("msg_") and message.model == "tiny"
    assert (message.type, message.role, message.stop_reason) == ("message", "assistant", "tool_use")
    assert message.stop_sequence is None
    assert blocks(message) == [
        ("thinking", "They ask the weather."),
        ("text", "Let me look."),
        ("tool_use", {"city": "Paris"}),
        ("tool_use", {"city": "Rome"}),
    ]
    assert message.content[0].signature == ""
    assert [(b.id, b.name) for b in message.content[2:]] == [
        ("toolu_1", "get_weather"),
        ("toolu_2", "get_weather"),
    ]
    usage = message.usage
    assert (usage.input_tokens, usage.cache_read_input_tokens) == (8, 32)
    assert (usage.output_tokens, usage.cache_creation_input_tokens) == (9, 0)
    assert usage.output_tokens_details is not None
    assert usage.output_tokens_details.thinking_tokens == 3


@pytest.mark.anyio
async def test_stop_reasons_and_the_stop_sequence_that_ended_the_message() -> None:
    registry = ScriptedRegistry()
    api = api_of(registry)
    ends = [
        (done("stop"), "end_turn", None),
        (done("stop", stop_string="\n\nQ:"), "stop_sequence", "\n\nQ:"),
        (done("length"), "max_tokens", None),
        (done("memory_pressure"), "max_tokens", None),
        (done("cancelled"), "end_turn", None),
    ]
    for last, reason, sequence in ends:
        registry.frames = [TextChunk(1, "A.", 1), last]
        message = await api.messages.create(
            model="tiny", max_tokens=5, messages=HELLO, stop_sequences=["\n\nQ:", "END"]
        )
        assert (message.stop_reason, message.stop_sequence) == (reason, sequence), last
        async with api.messages.stream(
            model="tiny", max_tokens=5, messages=HELLO, stop_sequences=["\n\nQ:", "END"]
        ) as stream:
            final = await stream.get_final_message()
        assert (final.stop_reason, final.stop_sequence) == (reason, sequence), last
    assert {r.sampling.stop for r in registry.requests} == {("\n\nQ:", "END")}
    assert {r.sampling.max_tokens for r in registry.requests} == {5}


@pytest.mark.anyio
async def test_the_stream_helper_rebuilds_the_whole_message() -> None:
    api = api_of(ScriptedRegistry(FRAMES))
    whole = await api.messages.create(model="tiny", max_tokens=64, messages=HELLO, tools=[WEATHER])
    async with api.messages.stream(
        model="tiny", max_tokens=64, messages=HELLO, tools=[WEATHER]
    ) as stream:
        texts = [event.text async for event in stream if event.type == "text"]
        final = await stream.get_final_message()
    assert texts == ["Let me ", "look."]
    assert blocks(final) == blocks(whole)
    assert final.stop_reason == "tool_use"
    assert final.usage.model_dump() == whole.usage.model_dump()


@pytest.mark.anyio
async def test_raw_stream_events_come_in_anthropic_order() -> None:
    """Each block opens, takes its deltas and closes before the next kind
    begins, with increasing indexes; ``message_start`` has the prompt's
    counts (from the first frame) and the usage comes whole at the end."""
    api = api_of(ScriptedRegistry(FRAMES))
    stream = await api.messages.create(
        model="tiny", max_tokens=64, messages=HELLO, tools=[WEATHER], stream=True
    )
    events = [event async for event in stream]
    shown = []
    for event in events:
        if event.type == "content_block_start":
            shown.append((event.type, event.index, event.content_block.type))
        elif event.type == "content_block_delta":
            shown.append((event.type, event.index, event.delta.type))
        elif event.type == "content_block_stop":
            shown.append((event.type, event.index, None))
        else:
            shown.append((event.type, None, None))
    assert shown == [
        ("message_start", None, None),
        ("content_block_start", 0, "thinking"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("content_block_start", 3, "tool_use"),
        ("content_block_delta", 3, "input_json_delta"),
        ("content_block_stop", 3, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    start = events[0].message
    assert (start.id[:4], start.model, start.content, start.stop_reason) == (
        "msg_",
        "tiny",
        [],
        None,
    )
    assert (start.usage.input_tokens, start.usage.cache_read_input_tokens) == (8, 32)
    assert (start.usage.output_tokens, start.usage.cache_creation_input_tokens) == (0, 0)
    assert events[9].content_block.input == {} and events[9].content_block.name == "get_weather"
    assert events[10].delta.partial_json == '{"city": "Paris"}'
    delta = events[-2]
    assert (delta.delta.stop_reason, delta.delta.stop_sequence) == ("tool_use", None)
    assert (delta.usage.output_tokens, delta.usage.input_tokens) == (9, 8)
    assert delta.usage.cache_read_input_tokens == 32


@pytest.mark.anyio
async def test_message_start_counts_the_prompt_it_knows_of() -> None:
    """The first frame's counts, even when it has no text yet; without them,
    0; with no frame before the end, the end's counts."""
    registry = ScriptedRegistry()
    api = api_of(registry)
    last = msgspec.structs.replace(done(cached_tokens=4), prompt_tokens=10)
    cases = [
        ([TextChunk(1, "", 1, prompt_tokens=12, cached_tokens=0), TextChunk(1, "A.", 2)], 12, 0),
        ([TextChunk(1, "A.", 1)], 0, 0),
        ([], 6, 4),
    ]
    for frames, computed, cached in cases:
        registry.frames = [*frames, last]
        stream = await api.messages.create(model="tiny", max_tokens=8, messages=HELLO, stream=True)
        events = [event async for event in stream]
        assert events[0].type == "message_start", frames
        start, end = events[0].message.usage, events[-2].usage
        assert (start.input_tokens, start.cache_read_input_tokens) == (computed, cached), frames
        assert (end.input_tokens, end.cache_read_input_tokens) == (6, 4)


@pytest.mark.anyio
async def test_thinking_display_omitted_leaves_the_thinking_blocks_empty() -> None:
    registry = ScriptedRegistry(FRAMES)
    api = api_of(registry)
    thinking: Any = {"type": "enabled", "budget_tokens": 100, "display": "omitted"}
    message = await api.messages.create(
        model="tiny", max_tokens=64, messages=HELLO, tools=[WEATHER], thinking=thinking
    )
    assert blocks(message)[:2] == [("thinking", ""), ("text", "Let me look.")]
    async with api.messages.stream(
        model="tiny", max_tokens=64, messages=HELLO, tools=[WEATHER], thinking=thinking
    ) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert "thinking" not in kinds  # no thinking_delta
    assert blocks(final) == blocks(message)


# --- what each field becomes -----------------------------------------------------------


@pytest.mark.anyio
async def test_the_system_prompt_as_text_or_as_blocks_with_cache_control() -> None:
    """``cache_control`` (on blocks, tools and the body) and the fields of
    IGNORED_FIELDS are accepted and change nothing."""
    registry = ScriptedRegistry([TextChunk(1, "ok", 1), done()])
    api = api_of(registry)
    await api.messages.create(model="tiny", max_tokens=8, system="Be brief.", messages=HELLO)
    ephemeral: Any = {"type": "ephemeral"}
    await api.messages.create(
        model="tiny",
        max_tokens=8,
        system=[
            {"type": "text", "text": "You are a weather bot."},
            {"type": "text", "text": "Be brief.", "cache_control": ephemeral},
        ],
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<reminder>metric</reminder>"},
                    {"type": "text", "text": "Weather in Paris?", "cache_control": ephemeral},
                ],
            }
        ],
        tools=[{**WEATHER, "cache_control": ephemeral}],
        metadata={"user_id": "u-1"},
        service_tier="auto",
        extra_body={"cache_control": ephemeral},
    )
    first, second = registry.requests
    assert first.messages == [
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Weather in Paris?"),
    ]
    assert second.messages == [
        ChatMessage("system", "You are a weather bot.\n\nBe brief."),
        ChatMessage("user", "<reminder>metric</reminder>\n\nWeather in Paris?"),
    ]
    assert second.chat.tools == [WEATHER_FUNCTION]
    assert set(IGNORED_FIELDS) <= set(MessagesRequest.__struct_fields__)


@pytest.mark.anyio
async def test_tool_use_and_tool_results_go_back_as_tool_calls_and_tool_turns() -> None:
    """The client sends the answer back as it holds it (thinking, text,
    tool_use blocks), then the results (text or text blocks, an error)."""
    api = api_of(ScriptedRegistry(FRAMES))
    answer = await api.messages.create(model="tiny", max_tokens=64, messages=HELLO, tools=[WEATHER])
    registry = ScriptedRegistry([TextChunk(1, "Sunny, rainy.", 2), done()])
    again = api_of(registry)
    results: Any = [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
        {
            "type": "tool_result",
            "tool_use_id": "toolu_2",
            "content": [{"type": "text", "text": "timeout"}],
            "is_error": True,
        },
        {"type": "text", "text": "And tomorrow?"},
    ]
    history = [
        *HELLO,
        {"role": "assistant", "content": answer.content},
        {"role": "user", "content": results},
    ]
    message = await again.messages.create(
        model="tiny", max_tokens=64, messages=history, tools=[WEATHER],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0.3, "top_p": 0.9, "top_k": 20},  # not in this client's list
    )  # fmt: skip
    assert blocks(message) == [("text", "Sunny, rainy.")] and message.stop_reason == "end_turn"
    (request,) = registry.requests
    assert request.messages == [
        ChatMessage("user", "Weather in Paris?"),
        ChatMessage(
            "assistant",
            "Let me look.",
            tool_calls=[
                ToolCall("toolu_1", "get_weather", '{"city":"Paris"}'),
                ToolCall("toolu_2", "get_weather", '{"city":"Rome"}'),
            ],
            reasoning="They ask the weather.",
        ),
        ChatMessage("tool", "sunny", tool_call_id="toolu_1"),
        ChatMessage("tool", "Error: timeout", tool_call_id="toolu_2"),
        ChatMessage("user", "And tomorrow?"),
    ]
    assert request.chat == ChatOptions(tools=[WEATHER_FUNCTION], tool_choice="required")
    assert request.sampling == SamplingParams(max_tokens=64, temperature=0.3, top_p=0.9, top_k=20)

    # Redacted thinking (Claude's, encrypted) is dropped; each tool_choice's mode.
    redacted: Any = [
        {"type": "redacted_thinking", "data": "EmwKAhgB"},
        {"type": "text", "text": "Hi"},
    ]
    modes: list[tuple[Any, Any]] = [
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "get_weather"}, NamedTool("get_weather")),
    ]
    for choice, mode in modes:
        await again.messages.create(
            model="tiny", max_tokens=8, tools=[WEATHER], tool_choice=choice,
            messages=[*HELLO, {"role": "assistant", "content": redacted}, *HELLO],
        )  # fmt: skip
        assert registry.requests[-1].chat.tool_choice == mode
        assert registry.requests[-1].messages is not None
        assert registry.requests[-1].messages[1] == ChatMessage("assistant", "Hi")


@pytest.mark.anyio
async def test_disable_parallel_tool_use_ends_the_message_at_its_first_call() -> None:
    frames = [
        TextChunk(1, "", 3, tool_calls=CALLS),
        TextChunk(1, "more", 4),
        done("cancelled", invalid_tool_call="<tool_call>{"),  # the cancel cut a third call
    ]
    registry = ScriptedRegistry(frames)
    api = api_of(registry)
    single: Any = {"type": "auto", "disable_parallel_tool_use": True}
    message = await api.messages.create(
        model="tiny", max_tokens=64, messages=HELLO, tools=[WEATHER], tool_choice=single
    )
    assert blocks(message) == [("tool_use", {"city": "Paris"})]
    assert message.stop_reason == "tool_use"
    assert registry.cancelled[0], "the generation was stopped after its first call"
    async with api.messages.stream(
        model="tiny", max_tokens=64, messages=HELLO, tools=[WEATHER], tool_choice=single
    ) as stream:
        final = await stream.get_final_message()
    assert blocks(final) == blocks(message) and final.stop_reason == "tool_use"
    # Allowed in parallel (the default), both calls are the answer.
    registry.frames = [TextChunk(1, "", 3, tool_calls=CALLS), done("tool_calls")]
    both = await api.messages.create(model="tiny", max_tokens=64, messages=HELLO, tools=[WEATHER])
    assert len(both.content) == 2


@pytest.mark.anyio
async def test_a_thinking_budget_reaches_the_sampler_and_the_chat_template() -> None:
    registry = ScriptedRegistry([TextChunk(1, "ok", 1), done()])
    api = api_of(registry)
    configs: list[tuple[Any, Any, Any]] = [
        ({"type": "enabled", "budget_tokens": 2048}, {"enable_thinking": True}, 2048),
        ({"type": "disabled"}, {"enable_thinking": False}, None),
        ({"type": "adaptive"}, {"enable_thinking": True}, None),
    ]
    for thinking, kwargs, budget in configs:
        await api.messages.create(model="tiny", max_tokens=4096, messages=HELLO, thinking=thinking)
        request = registry.requests[-1]
        assert request.chat.chat_template_kwargs == kwargs, thinking
        assert request.sampling.max_reasoning_tokens == budget, thinking
    await api.messages.create(model="tiny", max_tokens=8, messages=HELLO)
    assert registry.requests[-1].chat.chat_template_kwargs is None  # the template's default


@pytest.mark.anyio
async def test_a_claude_code_request_is_taken_and_says_no_context_edit_was_applied() -> None:
    """What Claude Code sends with every request: a user id, cache marks on
    the system prompt and tools, context editing, an effort. The effort and
    an output schema are honoured; context editing is not applied, and the
    message says so (``applied_edits`` empty), whole and streamed."""
    registry = ScriptedRegistry([TextChunk(1, '{"city": "Paris"}', 1), done()])
    api = api_of(registry)
    edits = {"edits": [{"type": "clear_tool_uses_20250919",
                        "trigger": {"type": "input_tokens", "value": 100000}}]}  # fmt: skip
    body: dict[str, Any] = {
        "model": "tiny", "max_tokens": 64, "messages": HELLO,
        "metadata": {"user_id": "user_abc"},
        "system": [{"type": "text", "text": "You are Claude Code.",
                    "cache_control": {"type": "ephemeral"}}],
        "tools": [{**WEATHER, "cache_control": {"type": "ephemeral"}}],
        "extra_body": {
            "context_management": edits,
            "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": {
                "type": "object", "properties": {"city": {"type": "string"}}}}},
        },
    }  # fmt: skip
    message = await api.messages.create(**body)
    assert (message.model_extra or {})["context_management"] == {"applied_edits": []}
    request = registry.requests[-1]
    assert request.chat.chat_template_kwargs == {"reasoning_effort": "low"}
    form = request.chat.response_format
    assert form is not None and form.type == "json_schema"
    assert form.schema == {"type": "object", "properties": {"city": {"type": "string"}}}
    async with api.messages.stream(**body) as stream:
        async for event in stream:
            if event.type == "message_delta":
                assert (event.model_extra or {})["context_management"] == {"applied_edits": []}
        final = await stream.get_final_message()
    assert final.content[0].type == "text" and json.loads(final.content[0].text)["city"] == "Paris"


@pytest.mark.anyio
async def test_count_tokens_counts_the_prompt_with_the_models_template() -> None:
    registry = ScriptedRegistry(token_count=123)
    api = api_of(registry)
    counted = await api.messages.count_tokens(
        model="tiny", system="Be brief.", messages=HELLO, tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        thinking={"type": "enabled", "budget_tokens": 1024},
    )  # fmt: skip
    assert counted.input_tokens == 123
    ((messages, prompt, chat),) = registry.counted
    assert prompt is None
    assert messages == [
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Weather in Paris?"),
    ]
    assert chat == ChatOptions(
        tools=[WEATHER_FUNCTION],
        tool_choice=NamedTool("get_weather"),
        chat_template_kwargs={"enable_thinking": True},
    )
    assert registry.requests == [], "counting generates nothing"


# --- errors ----------------------------------------------------------------------------


def error_of(exc: anthropic.APIStatusError) -> tuple[int, str, str]:
    """The status, Anthropic error type and message of a refusal (checking its shape)."""
    body = exc.body
    assert isinstance(body, dict) and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}, body
    return exc.status_code, body["error"]["type"], body["error"]["message"]


def said(*content: Any) -> dict[str, Any]:
    """A body's messages: one user turn of these blocks."""
    return {"messages": [{"role": "user", "content": list(content)}]}


@pytest.mark.anyio
async def test_what_we_cannot_honour_is_a_400_naming_it() -> None:
    registry = ScriptedRegistry([TextChunk(1, "ok", 1), done()])
    api = api_of(registry)
    image: Any = {
        "type": "image",
        "source": {"type": "file", "file_id": "file_1"},  # images come as base64 or a URL
    }
    document: Any = {"type": "document", "source": {"type": "text", "data": "x"}}
    search: Any = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    plain = {"type": "text", "text": "x"}
    result = {"type": "tool_result", "tool_use_id": "t", "content": [image]}
    refused: list[tuple[dict[str, Any], str]] = [
        ({"extra_body": {"bogus": 1}}, "unsupported parameter: bogus"),
        (
            {"extra_body": {"output_config": {"task_budget": 1}}},
            "unsupported parameter: output_config.task_budget",
        ),
        (
            {"extra_body": {"context_management": {"edits": [], "x": 1}}},
            "unsupported parameter: context_management.x",
        ),
        (said(image), "an image source is"),
        (said(plain, document), "document content blocks are not supported"),
        (said({"type": "search_result"}), "unsupported content block type 'search_result'"),
        (said({**plain, "bogus": 1}), "unsupported parameter: messages[0].content[0].bogus"),
        (
            said(result),
            "messages[0].content[0].content takes text blocks only, not image",
        ),
        ({"messages": [{"role": "system", "content": "x"}]}, "unsupported role 'system'"),
        ({"messages": [*HELLO, {"role": "assistant", "content": "The answer is"}]}, "prefill"),
        ({"messages": []}, "messages is empty"),
        ({"tools": [search]}, "server tool 'web_search_20250305' is not supported"),
        ({"tools": [{**WEATHER, "strict": True}]}, "unsupported parameter: tools[0].strict"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
            "'nope', which is not",
        ),
        ({"tool_choice": {"type": "any"}}, '"any" needs tools'),
        ({"thinking": {"type": "enabled"}}, "needs budget_tokens"),
        ({"stop_sequences": [""]}, "stop_sequences takes up to"),
        ({"extra_body": {"temperature": 1.5}}, "invalid request"),
        ({"system": [image]}, "system takes text blocks only, not image"),
    ]
    for fields, message in refused:
        kwargs: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "messages": HELLO, **fields}
        with pytest.raises(anthropic.BadRequestError) as caught:
            await api.messages.create(**kwargs)
        status, kind, text = error_of(caught.value)
        assert (status, kind) == (400, "invalid_request_error"), fields
        assert message in text, (fields, text)
    with pytest.raises(anthropic.BadRequestError, match="an image source is"):
        await api.messages.count_tokens(
            model="tiny", messages=[{"role": "user", "content": [image]}]
        )
    assert registry.requests == [] and registry.counted == [], "nothing refused reached the runner"


@pytest.mark.anyio
async def test_the_api_key_comes_as_x_api_key() -> None:
    registry = ScriptedRegistry([TextChunk(1, "ok", 1), done()])
    wrong = api_of(registry, key="sesame", api_key="nope")
    with pytest.raises(anthropic.AuthenticationError) as caught:
        await wrong.messages.create(model="tiny", max_tokens=8, messages=HELLO)
    assert error_of(caught.value)[:2] == (401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        await wrong.messages.count_tokens(model="tiny", messages=HELLO)
    right = api_of(registry, key="sesame", api_key="sesame")
    message = await right.messages.create(model="tiny", max_tokens=8, messages=HELLO)
    assert blocks(message) == [("text", "ok")]
    assert (await right.messages.count_tokens(model="tiny", messages=HELLO)).input_tokens == 7


class NoModels(ScriptedRegistry):
    """A registry that knows no model (as a daemon with load_on_demand off
    and nothing loaded)."""

    async def ensure_loaded(self, ref: str, on_progress: Any) -> Any:
        raise RequestError("unknown_model", f"no model {ref!r}")


@pytest.mark.anyio
async def test_an_unknown_model_is_not_found() -> None:
    api = api_of(NoModels())
    with pytest.raises(anthropic.NotFoundError) as caught:
        await api.messages.create(model="nope", max_tokens=8, messages=HELLO)
    assert error_of(caught.value) == (404, "not_found_error", "no model 'nope'")
    with pytest.raises(anthropic.NotFoundError):
        await api.messages.count_tokens(model="nope", messages=HELLO)
    with pytest.raises(anthropic.NotFoundError):
        async with api.messages.stream(model="nope", max_tokens=8, messages=HELLO) as stream:
            await stream.get_final_message()


@pytest.mark.anyio
async def test_a_broken_tool_call_is_an_api_error_whole_or_as_the_streams_last_event() -> None:
    registry = ScriptedRegistry(
        [TextChunk(1, "Sure.", 2), done("stop", invalid_tool_call='<tool_call>{"name": ')]
    )
    api = api_of(registry)
    with pytest.raises(anthropic.InternalServerError) as caught:
        await api.messages.create(model="tiny", max_tokens=8, messages=HELLO, tools=[WEATHER])
    status, kind, text = error_of(caught.value)
    assert (status, kind) == (500, "api_error") and "does not parse" in text
    stream = await api.messages.create(
        model="tiny", max_tokens=8, messages=HELLO, tools=[WEATHER], stream=True
    )
    seen = []
    with pytest.raises(anthropic.APIStatusError) as streamed:
        async for event in stream:
            seen.append(event.type)
    assert seen[:2] == ["message_start", "content_block_start"] and "message_stop" not in seen
    assert error_of(streamed.value)[1:] == ("api_error", text)
    # A call whose arguments are JSON but no object cannot be a tool_use block.
    registry.frames = [
        TextChunk(1, "", 2, tool_calls=[ToolCall("t", "get_weather", "[1]")]),
        done(),
    ]
    with pytest.raises(anthropic.InternalServerError, match="not a JSON object"):
        await api.messages.create(model="tiny", max_tokens=8, messages=HELLO, tools=[WEATHER])


# --- a real daemon ---------------------------------------------------------------------


def test_count_tokens_is_the_prompt_of_a_real_answer(start_daemon: DaemonFactory) -> None:
    """builtin:tiny, configured and loaded on demand by the count: the count
    is the prompt tokens (computed and read from the cache) of an answer to
    the same body, whole or streamed (there ``message_start`` has them), and
    the answer names the model as configured."""
    config = '[[models]]\nname = "terse"\nmodel = "builtin:tiny"\n'
    daemon = start_daemon(config, env={HTTP_ENV: "127.0.0.1:0"})
    url = Client(daemon.socket_path).status().supervisor.http
    assert url is not None
    api = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120)
    body: Any = {
        "model": "terse",
        "system": [
            {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}
        ],
        "messages": [
            {"role": "user", "content": "Hello there."},
            {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]},
            {"role": "user", "content": "Name a colour."},
        ],
    }
    counted = api.messages.count_tokens(**body).input_tokens
    message = api.messages.create(max_tokens=3, **body)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3
    assert message.model == "terse" and message.content[0].type == "text"
    assert message.usage.cache_read_input_tokens is not None
    assert counted == message.usage.input_tokens + message.usage.cache_read_input_tokens > 10
    with api.messages.stream(max_tokens=3, **body) as stream:
        start = next(event for event in stream if event.type == "message_start").message.usage
        stream.until_done()
    assert start.cache_read_input_tokens is not None and start.output_tokens == 0
    assert start.input_tokens + start.cache_read_input_tokens == counted  # from the first frame


def test_the_readme_names_each_ignored_field() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("### Anthropic Messages API", 1)[1].split("\n### ")[0]
    ignored = re.search(r"accepted and ignored on purpose: ([^.]+)\.", section)
    assert ignored is not None, "the README's Anthropic section lists the ignored fields"
    assert set(re.findall(r"`(\w+)`", ignored.group(1))) == set(IGNORED_FIELDS)

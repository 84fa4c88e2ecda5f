"""OpenAI's Responses API (``POST /v1/responses``), read and written by the
real, unmodified ``openai`` client: the history it sends as ``input``
reaching the runner as a chat, the Response objects and stream events it
builds from our frames (its stream helper checks their order), and the
400s that name what we refuse, above all what would need a response kept
on the server, since nothing is stored.

Shapes are tested against scripted runner frames (a stand-in registry
behind the real front); one test runs a real daemon with builtin:tiny."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from conftest import DaemonFactory
from ipc.messages import (
    ChatMessage,
    GenerationDone,
    NamedTool,
    ResponseFormat,
    TextChunk,
    TokenLogprob,
    ToolCall,
)
from scripted import ScriptedRegistry, asgi_http, done, scripted_app
from supervisor.client import Client
from supervisor.config import HTTP_ENV, SupervisorConfig
from supervisor.fronts.http import responses_api
from supervisor.fronts.http.errors import ApiError
from supervisor.fronts.http.openai_requests import IGNORED_FIELDS
from supervisor.fronts.http.responses_replies import RESPONSES
from supervisor.registry.registry import RequestError

WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
CALLS = [
    ToolCall("call_1", "get_weather", '{"city": "Paris"}'),
    ToolCall("call_2", "get_weather", '{"city": "Rome"}'),
]
THINK_TALK_CALL: list[TextChunk | GenerationDone] = [
    TextChunk(1, "", 1, reasoning="They ask "),
    TextChunk(1, "", 2, reasoning="the weather."),
    TextChunk(1, "Let me", 3),
    TextChunk(1, " look.", 4),
    TextChunk(1, "", 6, tool_calls=CALLS),
    done("tool_calls", reasoning_tokens=2),
]
HELLO: list[TextChunk | GenerationDone] = [
    TextChunk(1, "Hello", 1),
    TextChunk(1, " there.", 2),
    done(),
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def api_of(registry: ScriptedRegistry) -> openai.AsyncOpenAI:
    """The real openai client on the real Responses front, before ``registry``."""
    app = scripted_app(registry, responses_api.routes)
    return openai.AsyncOpenAI(
        base_url="http://front/v1", api_key="x", max_retries=0, http_client=asgi_http(app)
    )


# --- the request -------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_string_input_is_one_user_turn_and_the_answer_is_output_text() -> None:
    registry = ScriptedRegistry(HELLO)
    reply = await api_of(registry).responses.create(model="tiny", input="Hi")
    assert reply.output_text == "Hello there."
    assert reply.id.startswith("resp_") and reply.object == "response"
    assert (reply.status, reply.incomplete_details, reply.error) == ("completed", None, None)
    (message,) = reply.output
    assert message.type == "message" and message.id.startswith("msg_")
    assert (message.role, message.status) == ("assistant", "completed")
    assert reply.usage is not None
    assert (reply.usage.input_tokens, reply.usage.output_tokens, reply.usage.total_tokens) == (
        5,
        9,
        14,
    )
    assert reply.store is False and reply.temperature == 0.0 and reply.parallel_tool_calls
    (request,) = registry.requests
    assert request.messages == [ChatMessage("user", "Hi")]
    assert request.sampling.max_tokens == SupervisorConfig().max_tokens  # the daemon's cap


@pytest.mark.anyio
async def test_a_message_list_with_instructions_reaches_the_runner_as_a_chat() -> None:
    registry = ScriptedRegistry(HELLO)
    await api_of(registry).responses.create(
        model="tiny",
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Answer in English."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hi, "},
                                         {"type": "input_text", "text": "there"}]},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Hello."}]},
            {"type": "message", "role": "user", "content": "Again?"},
        ],
    )  # fmt: skip
    assert registry.requests[0].messages == [
        ChatMessage("system", "Be brief."),
        ChatMessage("system", "Answer in English."),
        ChatMessage("user", "Hi, there"),
        ChatMessage("assistant", "Hello."),
        ChatMessage("user", "Again?"),
    ]


@pytest.mark.anyio
async def test_ignored_fields_are_accepted_and_echoed_and_store_is_false() -> None:
    labels: dict[str, Any] = {field: "x" for field in IGNORED_FIELDS}
    labels |= {"metadata": {"k": "v"}, "store": True, "truncation": "disabled"}
    reply = await api_of(ScriptedRegistry(HELLO)).responses.create(
        model="tiny", input="Hi", **labels
    )
    assert reply.metadata == {"k": "v"} and reply.user == "x" and reply.store is False


# --- tools ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_reasoning_text_and_calls_are_output_items_that_go_back_as_input() -> None:
    registry = ScriptedRegistry(THINK_TALK_CALL)
    api = api_of(registry)
    reply = await api.responses.create(model="tiny", input="Weather?", tools=[WEATHER])
    assert [item.type for item in reply.output] == [
        "reasoning",
        "message",
        "function_call",
        "function_call",
    ]
    reasoning, _, *calls = reply.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert [c.text for c in reasoning.content or []] == ["They ask the weather."]
    assert reply.output_text == "Let me look."
    assert [(c.call_id, c.name, json.loads(c.arguments), c.status) for c in calls] == [
        ("call_1", "get_weather", {"city": "Paris"}, "completed"),
        ("call_2", "get_weather", {"city": "Rome"}, "completed"),
    ]
    assert all(c.id and c.id.startswith("fc_") for c in calls)
    assert reply.usage and reply.usage.output_tokens_details.reasoning_tokens == 2
    function = {k: v for k, v in WEATHER.items() if k != "type"}
    assert registry.requests[0].chat.tools == [{"type": "function", "function": function}]
    assert [t.name for t in reply.tools] == ["get_weather"]

    # The round trip: the output, and each call's output, as the next input.
    registry.frames = HELLO
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"}
               for c in calls]  # fmt: skip
    history: list[Any] = [{"role": "user", "content": "Weather?"}, *reply.output, *outputs]
    await api.responses.create(model="tiny", input=history, tools=[WEATHER])
    assert registry.requests[1].messages == [
        ChatMessage("user", "Weather?"),
        ChatMessage("assistant", "Let me look.", CALLS, reasoning="They ask the weather."),
        ChatMessage("tool", "sunny", tool_call_id="call_1", name="get_weather"),
        ChatMessage("tool", "sunny", tool_call_id="call_2", name="get_weather"),
    ]


@pytest.mark.anyio
async def test_tool_choice_forms_and_parallel_tool_calls_false() -> None:
    registry = ScriptedRegistry(THINK_TALK_CALL)
    api = api_of(registry)
    for choice, expected in [
        ("required", "required"),
        ("none", "none"),
        ({"type": "function", "name": "get_weather"}, NamedTool("get_weather")),
    ]:
        reply = await api.responses.create(
            model="tiny",
            input="Hi",
            tools=[WEATHER],
            tool_choice=choice,
        )
        assert registry.requests[-1].chat.tool_choice == expected
        assert reply.tool_choice == choice or reply.tool_choice.model_dump() == choice
    one = await api.responses.create(
        model="tiny",
        input="Hi",
        tools=[WEATHER],
        parallel_tool_calls=False,
    )
    assert [o.call_id for o in one.output if o.type == "function_call"] == ["call_1"]
    assert one.parallel_tool_calls is False and registry.cancelled[-1]


@pytest.mark.anyio
async def test_a_broken_tool_call_is_a_500_or_a_failed_response_after_the_others() -> None:
    frames = [TextChunk(1, "Sure.", 2), done("stop", invalid_tool_call='<tool_call>{"name": ')]
    api = api_of(ScriptedRegistry(frames))
    with pytest.raises(openai.InternalServerError, match="does not parse") as caught:
        await api.responses.create(model="tiny", input="Hi", tools=[WEATHER])
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "invalid_tool_call"
    stream = await api.responses.create(model="tiny", input="Hi", tools=[WEATHER], stream=True)
    events = [event async for event in stream]
    error, failed = failed_end(events)
    assert error.code == failed.response.error.code == "invalid_tool_call"
    assert [(o.type, o.status, o.content[0].text) for o in failed.response.output] == [
        ("message", "incomplete", "Sure.")
    ]


def failed_end(events: list[Any]) -> tuple[Any, Any]:
    """A failed stream's last two events, ``error`` then ``response.failed``
    (which Responses clients such as Codex wait for), checked: numbered
    after the others, the failed response the one the stream created, its
    error the event's. Returns the two events."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    error, failed = events[-2:]
    assert (error.type, failed.type, failed.response.status) == (
        "error", "response.failed", "failed"
    )  # fmt: skip
    assert failed.response.id == events[0].response.id
    assert failed.response.error.message == error.message
    return error, failed


# --- format, reasoning, length, logprobs ---------------------------------------------------


class City(BaseModel):
    name: str
    population: int


@pytest.mark.anyio
async def test_a_json_schema_format_reaches_the_runner_and_parses() -> None:
    registry = ScriptedRegistry([TextChunk(1, '{"name": "Paris", "population": 2}', 9), done()])
    api = api_of(registry)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    reply = await api.responses.create(
        model="tiny",
        input="Hi",
        text={"format": {"type": "json_schema", "name": "thing", "schema": schema}},
    )
    assert registry.requests[0].chat.response_format == ResponseFormat(
        "json_schema", schema, "thing"
    )
    assert reply.text and reply.text.format and reply.text.format.type == "json_schema"
    await api.responses.create(model="tiny", input="Hi", text={"format": {"type": "json_object"}})
    assert registry.requests[1].chat.response_format == ResponseFormat("json_object")
    parsed = await api.responses.parse(model="tiny", input="Hi", text_format=City)
    assert parsed.output_parsed == City(name="Paris", population=2)
    format = registry.requests[2].chat.response_format
    assert format is not None and format.name == "City" and format.schema is not None


@pytest.mark.anyio
async def test_reasoning_effort_reaches_the_chat_template() -> None:
    registry = ScriptedRegistry(HELLO)
    api = api_of(registry)
    await api.responses.create(model="tiny", input="Hi", reasoning={"effort": "high"})
    await api.responses.create(model="tiny", input="Hi", reasoning={"effort": "none"})
    reply = await api.responses.create(
        model="tiny", input="Hi", reasoning={"effort": "low", "summary": "auto"}
    )
    assert [r.chat.chat_template_kwargs for r in registry.requests] == [
        {"reasoning_effort": "high"},
        {"reasoning_effort": "none", "enable_thinking": False},
        {"reasoning_effort": "low"},
    ]
    assert reply.reasoning and reply.reasoning.effort == "low"


@pytest.mark.anyio
async def test_max_output_tokens_caps_the_answer_and_a_cut_one_is_incomplete() -> None:
    registry = ScriptedRegistry([TextChunk(1, "Once upon", 16), done("length")])
    api = api_of(registry)
    reply = await api.responses.create(model="tiny", input="Story?", max_output_tokens=16)
    assert registry.requests[0].sampling.max_tokens == 16
    assert reply.status == "incomplete" and reply.max_output_tokens == 16
    assert reply.incomplete_details and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.output[0].status == "incomplete" and reply.output_text == "Once upon"
    stream = await api.responses.create(
        model="tiny", input="Story?", max_output_tokens=16, stream=True
    )
    last = [event async for event in stream][-1]
    assert last.type == "response.incomplete" and last.response.output_text == "Once upon"


@pytest.mark.anyio
async def test_logprobs_come_with_the_text_when_included() -> None:
    entry = TokenLogprob("Hi", -0.5, [("Hi", -0.5), ("Yo", -1.5)])
    registry = ScriptedRegistry([TextChunk(1, "Hi", 1, logprobs=[entry]), done()])
    api = api_of(registry)
    reply = await api.responses.create(
        model="tiny", input="Hi", top_logprobs=2, include=["message.output_text.logprobs"]
    )
    sampling = registry.requests[0].sampling
    assert (sampling.logprobs, sampling.top_logprobs) == (True, 2)
    part = reply.output[0].content[0]
    assert part.type == "output_text" and part.logprobs is not None
    assert [(p.token, p.logprob, [t.token for t in p.top_logprobs]) for p in part.logprobs] == [
        ("Hi", -0.5, ["Hi", "Yo"])
    ]
    stream = await api.responses.create(
        model="tiny", input="Hi", stream=True, include=["message.output_text.logprobs"]
    )
    deltas = [e async for e in stream if e.type == "response.output_text.delta"]
    assert [p.token for d in deltas for p in d.logprobs] == ["Hi"]


# --- streaming --------------------------------------------------------------------------


EXPECTED_EVENTS = [
    "response.created",
    "response.in_progress",
    *["response.output_item.added", "response.content_part.added"],
    *["response.reasoning_text.delta"] * 2,
    "response.reasoning_text.done",
    *["response.content_part.done", "response.output_item.done"],
    *["response.output_item.added", "response.content_part.added"],
    *["response.output_text.delta"] * 2,
    "response.output_text.done",
    *["response.content_part.done", "response.output_item.done"],
    *[
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    * 2,
    "response.completed",
]


@pytest.mark.anyio
async def test_a_stream_has_its_events_in_order_with_increasing_sequence_numbers() -> None:
    api = api_of(ScriptedRegistry(THINK_TALK_CALL))
    stream = await api.responses.create(model="tiny", input="Hi", tools=[WEATHER], stream=True)
    events = [event async for event in stream]
    assert [e.type for e in events] == EXPECTED_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, completed = events[0], events[-1]
    assert created.response.status == "in_progress" and created.response.output == []
    assert completed.response.id == created.response.id
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == "Let me look." == completed.response.output_text
    arguments = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == [c.arguments for c in CALLS]


@pytest.mark.anyio
async def test_the_stream_helper_rebuilds_the_whole_response() -> None:
    api = api_of(ScriptedRegistry(THINK_TALK_CALL))
    whole = await api.responses.parse(model="tiny", input="Hi", tools=[WEATHER])
    async with api.responses.stream(model="tiny", input="Hi", tools=[WEATHER]) as stream:
        texts = [e.snapshot async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert texts == ["Let me", "Let me look."]
    assert final.output_text == whole.output_text
    shapes = [item.model_dump(exclude={"id"}) for item in final.output]
    assert shapes == [item.model_dump(exclude={"id"}) for item in whole.output]


class FailingRegistry(ScriptedRegistry):
    """The runner dies after its first frame."""

    async def generate(
        self, request: Any, emit: Any, cancel: Any, on_queued: Any = None, *, front: str = "socket"
    ) -> None:
        await super().generate(request, emit, cancel, on_queued, front=front)
        raise RequestError("runner_died", "the runner died (SIGKILL)")


@pytest.mark.anyio
async def test_an_error_mid_stream_ends_it_with_an_error_and_a_failed_response() -> None:
    api = api_of(FailingRegistry([TextChunk(1, "Hel", 1)]))
    stream = await api.responses.create(model="tiny", input="Hi", stream=True)
    events = [event async for event in stream]
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    error, failed = failed_end(events)
    assert error.code == failed.response.error.code == "runner_died"
    assert "SIGKILL" in error.message
    assert failed.response.output_text == "Hel"
    assert failed.response.output[0].status == "incomplete"


def test_an_error_before_the_first_word_still_follows_a_response_created() -> None:
    """A stream that opened with keep-alive comments (the model loading, or
    a place in line) and then failed: the openai client's stream helper
    takes no event before ``response.created``, so the error comes after it."""
    call = responses_api.responses_call(
        responses_api.ResponsesRequest(model="tiny", input="Hi", stream=True)
    )
    framed = RESPONSES.error_event(ApiError(503, "tiny is failed", code="not_ready"), call)
    events = [json.loads(block.split(b"data: ", 1)[1]) for block in framed.split(b"\n\n") if block]
    assert [(e["type"], e["sequence_number"]) for e in events] == [
        ("response.created", 0),
        ("response.in_progress", 1),
        ("error", 2),
        ("response.failed", 3),
    ]
    assert events[0]["response"]["model"] == "tiny"
    assert (events[2]["code"], events[2]["message"]) == ("not_ready", "tiny is failed")
    failed = events[3]["response"]
    assert (failed["id"], failed["status"], failed["output"]) == (events[0]["response"]["id"],
                                                                  "failed", [])  # fmt: skip
    assert failed["error"] == {"code": "not_ready", "message": "tiny is failed"}


# --- refusals ----------------------------------------------------------------------------


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "name": "f", "bogus": 1}]}, "tools[0].bogus"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}}, "tool_choice"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"include": ["file_search_call.results"]}, "include[0]"),
    ({"reasoning": {"summary": "detailed"}}, "reasoning.summary"),
    ({"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"bogus": 1}, "bogus"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "system", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": "x", "audio": 1}]}, "input[0].audio"),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
     "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]},
     "input[0].arguments"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]},
     "input[0].encrypted_content"),
]  # fmt: skip


@pytest.mark.anyio
async def test_what_we_cannot_honour_is_a_400_naming_it() -> None:
    """Above all what would need a response kept here: nothing is stored."""
    registry = ScriptedRegistry(HELLO)
    api = api_of(registry)
    for fields, param in REFUSED:
        body = {"model": "tiny", "input": "Hi", **fields}
        with pytest.raises(openai.BadRequestError) as caught:
            await api.post("/responses", body=body, cast_to=dict)
        error = caught.value.body
        assert isinstance(error, dict) and error["param"] == param, (fields, error)
        assert set(error) == {"message", "type", "param", "code"}
    assert not registry.requests, "no refused request reached the runner"
    with pytest.raises(openai.BadRequestError, match="nothing is stored"):
        await api.responses.create(model="tiny", input="Hi", previous_response_id="resp_1")


# --- a real daemon -------------------------------------------------------------------------


def test_a_real_model_answers_whole_and_streamed(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(None, env={HTTP_ENV: "127.0.0.1:0"})
    client = Client(daemon.socket_path)
    client.load("builtin:tiny")
    url = client.status().supervisor.http
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    reply = api.responses.create(model="tiny", input="Tell me a story.", max_output_tokens=8)
    assert reply.status == "incomplete" and reply.output_text
    assert reply.usage is not None and reply.usage.output_tokens == 8
    events = list(
        api.responses.create(
            model="tiny", input="Tell me a story.", max_output_tokens=8, stream=True
        )
    )
    last = events[-1]
    assert last.type == "response.incomplete"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == last.response.output_text == reply.output_text  # greedy: the same words

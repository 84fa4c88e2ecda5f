"""Ollama's native API (``/api/...``), read by the real, unmodified ``ollama``
client: chat and generate, whole and streamed (thinking, tool calls, counts
and durations), every option honoured or refused by name, ``keep_alive`` in
each of its forms, Ollama's load and unload by an empty request, and what
``/api/tags``, ``/api/ps`` and ``/api/show`` say, in the client's own types.

The shapes run against scripted runner frames (a stand-in registry behind the
real front); one test runs a real daemon with builtin:tiny."""

from __future__ import annotations

import datetime
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest

from conftest import DaemonFactory
from ipc.messages import (
    ChatMessage,
    ResponseFormat,
    RunnerInfo,
    SamplingParams,
    TextChunk,
    TokenLogprob,
    ToolCall,
)
from scripted import Frames, ScriptedRegistry, done, scripted_app
from supervisor import __version__
from supervisor.client import Client
from supervisor.config import HTTP_ENV, ModelConfig, SupervisorConfig
from supervisor.fronts.http.ollama_api import (
    NOTHING_TO_PULL,
    OLLAMA_API_VERSION,
    routes,
    template_capabilities,
)
from supervisor.fronts.http.ollama_chat import (
    IGNORED_OPTIONS,
    Options,
    duration_seconds,
    model_name,
)
from supervisor.fronts.model_facts import model_facts

README = Path(__file__).resolve().parent.parent / "README.md"
CHAT = [{"role": "user", "content": "Tell me a story."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city."}},
            "required": ["city"],
        },
    },
}
THOUGHT_AND_WORDS: Frames = (
    TextChunk(request_id=1, text="", generation_tokens=2, reasoning="Let me think. "),
    TextChunk(request_id=1, text="Hello", generation_tokens=3),
    TextChunk(request_id=1, text=" there", generation_tokens=4),
    done("stop"),
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def front(
    registry: ScriptedRegistry, config: SupervisorConfig | None = None, key: str | None = None
) -> httpx.ASGITransport:
    return httpx.ASGITransport(app=scripted_app(registry, routes, config, key))


def ollama_of(
    registry: ScriptedRegistry,
    config: SupervisorConfig | None = None,
    key: str | None = None,
    headers: dict[str, str] | None = None,
) -> ollama.AsyncClient:
    """The real client, over ASGI, in front of ``registry``."""
    transport = front(registry, config, key)
    return ollama.AsyncClient(host="http://front", transport=transport, headers=headers)


def refused(caught: pytest.ExceptionInfo[ollama.ResponseError], status: int = 400) -> str:
    assert caught.value.status_code == status
    return str(caught.value.error)


# --- chat and generate --------------------------------------------------------------


@pytest.mark.anyio
async def test_chat_answers_whole_with_thinking_counts_and_durations() -> None:
    registry = ScriptedRegistry(THOUGHT_AND_WORDS)
    reply = await ollama_of(registry).chat(model="tiny", messages=CHAT, stream=False)
    assert isinstance(reply, ollama.ChatResponse)
    assert (reply.message.role, reply.message.content) == ("assistant", "Hello there")
    assert reply.message.thinking == "Let me think. "
    assert (reply.done, reply.done_reason, reply.model) == (True, "stop", "tiny")
    assert (reply.prompt_eval_count, reply.eval_count) == (5, 9)
    # The scripted rates are 1 token/s: 5 s of prompt, 9 s of answer.
    assert (reply.prompt_eval_duration, reply.eval_duration) == (5 * 10**9, 9 * 10**9)
    assert reply.total_duration is not None and reply.load_duration is not None
    assert reply.total_duration >= reply.load_duration >= 0
    assert reply.created_at is not None
    created = datetime.datetime.fromisoformat(reply.created_at)
    assert abs(created.timestamp() - time.time()) < 60
    request = registry.requests[0]
    assert request.messages == [ChatMessage("user", "Tell me a story.")]
    assert request.prompt is None


@pytest.mark.anyio
async def test_chat_streams_a_line_per_frame_then_the_counts() -> None:
    registry = ScriptedRegistry(THOUGHT_AND_WORDS)
    parts = [part async for part in await ollama_of(registry).chat(
        model="tiny", messages=CHAT, stream=True)]  # fmt: skip
    assert [p.message.content for p in parts] == ["", "Hello", " there", ""]
    assert [p.message.thinking for p in parts] == ["Let me think. ", None, None, None]
    assert [p.done for p in parts] == [False, False, False, True]
    assert all(p.done_reason is None and p.eval_count is None for p in parts[:-1])
    assert (parts[-1].done_reason, parts[-1].eval_count, parts[-1].prompt_eval_count) == (
        "stop", 9, 5)  # fmt: skip


@pytest.mark.anyio
async def test_chat_streams_ndjson_unless_the_body_says_stream_false() -> None:
    registry = ScriptedRegistry(THOUGHT_AND_WORDS)
    async with httpx.AsyncClient(transport=front(registry), base_url="http://front") as http:
        streamed = await http.post("/api/chat", json={"model": "tiny", "messages": CHAT})
        assert streamed.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in streamed.text.splitlines()]
        assert len(lines) == 4 and lines[-1]["done"] is True
        assert lines[-1]["supervisor"]["finish_reason"] == "stop"
        whole = await http.post("/api/chat", json={"model": "tiny", "messages": CHAT,
                                                   "stream": False})  # fmt: skip
        assert whole.headers["content-type"] == "application/json"
        assert whole.json()["message"]["content"] == "Hello there"


@pytest.mark.anyio
async def test_an_answer_cut_short_is_done_for_length() -> None:
    for finish in ("length", "memory_pressure"):
        registry = ScriptedRegistry([TextChunk(request_id=1, text="Hi", generation_tokens=1),
                             done(finish)])  # fmt: skip
        reply = await ollama_of(registry).chat(model="tiny", messages=CHAT, stream=False)
        assert reply.done_reason == "length"
        async with httpx.AsyncClient(transport=front(registry), base_url="http://f") as http:
            body = {"model": "tiny", "messages": CHAT, "stream": False}
            raw = (await http.post("/api/chat", json=body)).json()
        assert raw["supervisor"]["finish_reason"] == finish  # ours, beside Ollama's reason


@pytest.mark.anyio
async def test_generate_renders_the_prompt_as_a_chat_unless_raw() -> None:
    registry = ScriptedRegistry(THOUGHT_AND_WORDS)
    client = ollama_of(registry)
    reply = await client.generate(model="tiny", prompt="Hi", system="Be brief.", stream=False)
    assert isinstance(reply, ollama.GenerateResponse)
    assert (reply.response, reply.thinking, reply.done_reason) == (
        "Hello there", "Let me think. ", "stop")  # fmt: skip
    assert (reply.prompt_eval_count, reply.eval_count) == (5, 9)
    request = registry.requests[-1]
    assert request.messages == [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")]
    assert request.prompt is None

    parts = [p async for p in await client.generate(model="tiny", prompt="Once upon", raw=True,
                                                    stream=True)]  # fmt: skip
    assert "".join(p.response or "" for p in parts) == "Hello there"
    assert [p.done for p in parts][-2:] == [False, True] and parts[-1].done_reason == "stop"
    request = registry.requests[-1]
    assert (request.prompt, request.messages) == ("Once upon", None)


@pytest.mark.anyio
async def test_generate_refuses_what_it_cannot_honour_by_name() -> None:
    registry = ScriptedRegistry(THOUGHT_AND_WORDS)
    client = ollama_of(registry)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"suffix": "return x"}, "suffix"),
        ({"template": "{{ .Prompt }}"}, "template"),
        ({"context": [1, 2, 3]}, "context"),
        ({"raw": True, "images": [b"\x89PNG\r\n"]}, "images"),
        ({"raw": True, "system": "Be brief."}, "system"),
        ({"raw": True, "think": True}, "think"),
    ]
    for fields, name in cases:
        with pytest.raises(ollama.ResponseError) as caught:
            await client.generate(model="tiny", prompt="Hi", **fields)
        assert name in refused(caught), fields
    await client.generate(model="tiny", prompt="Hi", context=[])  # an empty context is none
    assert len(registry.requests) == 1


@pytest.mark.anyio
async def test_format_json_and_a_schema_hold_the_answer() -> None:
    registry = ScriptedRegistry(THOUGHT_AND_WORDS)
    client = ollama_of(registry)
    await client.chat(model="tiny", messages=CHAT, format="json")
    assert registry.requests[-1].chat.response_format == ResponseFormat("json_object")
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    await client.generate(model="tiny", prompt="Where?", format=schema)
    assert registry.requests[-1].chat.response_format == ResponseFormat("json_schema", schema)
    await client.chat(model="tiny", messages=CHAT, format="")
    assert registry.requests[-1].chat.response_format is None
    async with httpx.AsyncClient(transport=front(registry), base_url="http://front") as http:
        yaml = await http.post("/api/chat", json={"model": "tiny", "messages": CHAT,
                                                  "format": "yaml"})  # fmt: skip
    assert yaml.status_code == 400 and "format" in yaml.json()["error"]


@pytest.mark.anyio
async def test_think_reaches_the_chat_template() -> None:
    registry = ScriptedRegistry(THOUGHT_AND_WORDS)
    client = ollama_of(registry)
    expected = {
        True: {"enable_thinking": True},
        False: {"enable_thinking": False},
        "high": {"enable_thinking": True, "reasoning_effort": "high"},
    }
    for think, kwargs in expected.items():
        await client.chat(model="tiny", messages=CHAT, think=think)
        assert registry.requests[-1].chat.chat_template_kwargs == kwargs
    await client.chat(model="tiny", messages=CHAT)
    assert registry.requests[-1].chat.chat_template_kwargs is None
    with pytest.raises(ollama.ResponseError) as caught:
        await client.chat(model="tiny", messages=CHAT, think="extreme")
    assert "think" in refused(caught)


# --- options ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_options_reach_the_sampler() -> None:
    registry = ScriptedRegistry(THOUGHT_AND_WORDS)
    client = ollama_of(registry)
    options = ollama.Options(
        temperature=0.7, top_p=0.9, top_k=40, seed=42, stop=["\n\n", "END"], num_predict=64,
        repeat_penalty=1.1, repeat_last_n=32, presence_penalty=0.5, frequency_penalty=0.25,
    )  # fmt: skip
    await client.chat(model="tiny", messages=CHAT, options=options)
    assert registry.requests[-1].sampling == SamplingParams(
        max_tokens=64, temperature=0.7, top_p=0.9, top_k=40, seed=42, stop=("\n\n", "END"),
        repetition_penalty=1.1, repetition_context_size=32, presence_penalty=0.5,
        presence_context_size=32, frequency_penalty=0.25, frequency_context_size=32,
    )  # fmt: skip
    await client.generate(model="tiny", prompt="Hi", options={"min_p": 0.05})
    assert registry.requests[-1].sampling.min_p == 0.05

    # Ollama's settings that mean "none": no limit, a random seed, no penalty.
    for num_predict in (-1, -2):
        await client.chat(model="tiny", messages=CHAT, options={
            "num_predict": num_predict, "seed": -1, "repeat_penalty": 1.0})  # fmt: skip
        sampling = registry.requests[-1].sampling
        assert sampling.max_tokens == SupervisorConfig().max_tokens  # the model's cap
        assert (sampling.seed, sampling.repetition_penalty) == (None, None)
    await client.chat(model="tiny", messages=CHAT, options={
        "repeat_last_n": 0, "repeat_penalty": 1.3, "presence_penalty": 1.0})  # fmt: skip
    sampling = registry.requests[-1].sampling
    assert (sampling.repetition_penalty, sampling.presence_penalty) == (None, None)
    await client.chat(model="tiny", messages=CHAT, options={"repeat_last_n": -1,
                                                            "repeat_penalty": 1.3})  # fmt: skip
    assert registry.requests[-1].sampling.repetition_context_size == 1 << 20


@pytest.mark.anyio
async def test_options_that_change_nothing_or_turn_a_sampler_off_are_taken() -> None:
    registry = ScriptedRegistry(THOUGHT_AND_WORDS)
    runtime = {"num_ctx": 8192, "num_batch": 512, "num_gpu": 99, "main_gpu": 0,
               "num_thread": 8, "use_mmap": True, "use_mlock": False, "low_vram": False,
               "numa": False, "f16_kv": True, "vocab_only": False, "logits_all": False,
               "embedding_only": False, "num_keep": 4, "draft_num_predict": 4}  # fmt: skip
    assert set(runtime) == set(IGNORED_OPTIONS)
    off = {"mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "typical_p": 1.0,
           "tfs_z": 1.0, "penalize_newline": True}  # fmt: skip
    await ollama_of(registry).chat(model="tiny", messages=CHAT, options={**runtime, **off})
    assert registry.requests[-1].sampling == SamplingParams(
        max_tokens=SupervisorConfig().max_tokens
    )
    # Every option of the client's own type is known: honoured, ignored, or refused by name.
    assert set(ollama.Options.model_fields) <= set(Options.__struct_fields__)


@pytest.mark.anyio
async def test_options_we_cannot_honour_are_400s_naming_them() -> None:
    client = ollama_of(ScriptedRegistry(THOUGHT_AND_WORDS))
    cases = {
        "mirostat": 2,
        "typical_p": 0.5,
        "tfs_z": 0.95,
        "penalize_newline": False,
        "n_probs": 3,
        "temperature": -1,
    }
    for name, value in cases.items():
        with pytest.raises(ollama.ResponseError) as caught:
            await client.chat(model="tiny", messages=CHAT, options={name: value})
        assert f"options.{name}" in refused(caught), name
    with pytest.raises(ollama.ResponseError) as caught:
        await client.chat(model="tiny", messages=CHAT, options={"n_probs": 3})
    assert refused(caught) == "unsupported parameter: options.n_probs"


# --- keep_alive, load and unload ------------------------------------------------------


def test_keep_alive_takes_seconds_and_go_durations() -> None:
    assert duration_seconds("5m") == 300
    assert duration_seconds("1h30m") == 5400
    assert duration_seconds("10s") == 10
    assert duration_seconds("1.5h") == 5400
    assert duration_seconds("300ms") == pytest.approx(0.3)
    assert duration_seconds("2h45m10s") == 9910
    assert duration_seconds("-1") == -1
    assert duration_seconds("-1m") == -60
    assert duration_seconds("0") == 0
    assert duration_seconds("90") == 90


@pytest.mark.anyio
async def test_keep_alive_reaches_the_model_in_each_form() -> None:
    registry = ScriptedRegistry(THOUGHT_AND_WORDS)
    client = ollama_of(registry, config=SupervisorConfig(keep_alive_s=45))
    year = 365 * 86_400
    for keep_alive, seconds in (("5m", 300), (10, 10), ("1h30m", 5400), (2.5, 2.5),
                                (-1, 0.0), ("-1", 0.0), (year, year), (year + 1, 0.0),
                                ("9000h", 0.0), (1e300, 0.0)):  # fmt: skip
        touched = registry.entry.touched
        await client.chat(model="tiny", messages=CHAT, keep_alive=keep_alive)
        assert registry.entry.keep_alive_s == seconds, keep_alive  # ours: 0 is never
        assert registry.entry.touched > touched, keep_alive  # its idle timer starts again
    assert registry.unloaded == []
    await client.generate(model="tiny", prompt="Hi", keep_alive="0s")
    assert registry.unloaded == ["tiny"]  # unloaded once the answer is out
    for bad in ("soon", "5 minutes", "1h-30m", "", "inf", "-inf", "1e400", "NaN", "nan"):
        with pytest.raises(ollama.ResponseError) as caught:
            await client.chat(model="tiny", messages=CHAT, keep_alive=bad)
        assert "keep_alive" in refused(caught), bad
    async with httpx.AsyncClient(transport=front(registry), base_url="http://front") as http:
        huge = await http.post("/api/chat", content=b'{"model": "tiny", "keep_alive": 1e400}')
    assert huge.status_code == 400 and "keep_alive" in huge.json()["error"]


@pytest.mark.anyio
async def test_a_request_without_keep_alive_brings_the_models_own_back() -> None:
    registry = ScriptedRegistry(THOUGHT_AND_WORDS)
    client = ollama_of(registry, config=SupervisorConfig(keep_alive_s=45))
    asked: list[Any] = [
        client.chat(model="tiny", messages=CHAT),
        client.generate(model="tiny", prompt="Hi"),
        client.generate(model="tiny"),  # the empty load
        client.chat(model="tiny", messages=[]),
    ]
    for request in asked:
        await client.chat(model="tiny", messages=CHAT, keep_alive=-1)
        assert registry.entry.keep_alive_s == 0.0  # never, for as long as it is asked
        touched = registry.entry.touched
        await request
        assert registry.entry.keep_alive_s == 45  # the daemon's, not the last client's
        assert registry.entry.touched > touched
    registry.entry.spec.keep_alive_s = 90  # the model's own, from its [[models]] entry
    await client.chat(model="tiny", messages=CHAT)
    assert registry.entry.keep_alive_s == 90


@pytest.mark.anyio
async def test_an_empty_request_loads_the_model_and_with_keep_alive_0_unloads_it() -> None:
    registry = ScriptedRegistry(THOUGHT_AND_WORDS)
    client = ollama_of(registry)
    loaded = await client.chat(model="tiny", messages=[], keep_alive="10m")
    assert (loaded.done, loaded.done_reason, loaded.message.role) == (True, "load", "assistant")
    assert registry.entry.keep_alive_s == 600
    assert registry.entry.touched == 1  # idle from now: not expired for an old last use
    loaded_g = await client.generate(model="tiny", stream=True)
    assert [(p.done, p.done_reason, p.response) async for p in loaded_g] == [(True, "load", "")]
    assert registry.requests == []  # nothing was generated
    unloaded = await client.generate(model="tiny", keep_alive=0)
    assert (unloaded.done_reason, registry.unloaded) == ("unload", ["tiny"])
    unloaded_c = await client.chat(model="builtin:tiny", messages=[], keep_alive=0)
    assert (unloaded_c.done_reason, registry.unloaded) == ("unload", ["tiny", "tiny"])
    with pytest.raises(ollama.ResponseError) as caught:
        await client.chat(model="nope", keep_alive=0)
    assert refused(caught, 404) == "model 'nope' not found"
    assert registry.requests == []
    async with httpx.AsyncClient(transport=front(registry), base_url="http://front") as http:
        plain = await http.post("/api/generate", json={"model": "tiny", "keep_alive": 0})
    assert "supervisor" not in plain.json()  # unloaded now: nothing to add


@pytest.mark.anyio
async def test_keep_alive_0_leaves_a_pinned_model_and_a_busy_one_goes_once_idle() -> None:
    registry = ScriptedRegistry(THOUGHT_AND_WORDS)
    client = ollama_of(registry)
    registry.entry.spec.pinned = True
    with pytest.raises(ollama.ResponseError) as caught:
        await client.generate(model="tiny", keep_alive=0)
    assert refused(caught, 409).startswith("tiny is pinned: keep_alive 0 does not unload it")
    assert (registry.unloaded, registry.entry.touched) == ([], 0)  # nothing was done

    registry.entry.spec.pinned = False
    registry.entry.state = "busy"  # a request in flight: not evictable
    async with httpx.AsyncClient(transport=front(registry), base_url="http://front") as http:
        answer = (await http.post("/api/chat", json={"model": "tiny", "keep_alive": 0})).json()
    assert (answer["done"], answer["done_reason"]) == (True, "unload")
    assert answer["supervisor"] == {"note": "tiny is in use: it unloads once its requests end"}
    assert registry.unloaded == []  # not now: keep-alive expiry takes it once it is idle
    assert 0 < registry.entry.keep_alive_s < 1


@pytest.mark.anyio
async def test_a_final_latest_tag_names_the_model_without_it() -> None:
    registry = ScriptedRegistry(THOUGHT_AND_WORDS)
    client = ollama_of(registry)
    reply = await client.chat(model="tiny:latest", messages=CHAT)
    assert (reply.model, reply.message.content) == ("tiny", "Hello there")
    assert (await client.generate(model="builtin:tiny:latest", prompt="Hi")).model == "tiny"
    loaded = await client.generate(model="tiny:latest")
    assert (loaded.done_reason, loaded.model) == ("load", "tiny")
    unloaded = await client.chat(model="builtin:tiny:latest", messages=[], keep_alive=0)
    assert (unloaded.done_reason, registry.unloaded) == ("unload", ["tiny"])
    with pytest.raises(ollama.ResponseError) as caught:  # only a final :latest goes
        await client.chat(model="tiny:latest:v2", messages=[], keep_alive=0)
    assert refused(caught, 404) == "model 'tiny:latest:v2' not found"
    assert [model_name(n) for n in ("builtin:tiny", "a:latest:b", "x:latest")] == [
        "builtin:tiny", "a:latest:b", "x"]  # fmt: skip
    assert len(registry.requests) == 2


# --- tools -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_tool_calls_come_as_objects_and_their_answers_go_back_to_them() -> None:
    call = ToolCall("call_x1", "get_weather", '{"city": "Paris"}')
    registry = ScriptedRegistry([TextChunk(request_id=1, text="", generation_tokens=5,
                                   tool_calls=[call]), done("tool_calls")])  # fmt: skip
    client = ollama_of(registry)
    reply = await client.chat(model="tiny", messages=CHAT, tools=[WEATHER], stream=False)
    assert reply.done_reason == "stop"
    (made,) = reply.message.tool_calls or []
    assert (made.function.name, made.function.arguments) == ("get_weather", {"city": "Paris"})
    tools = registry.requests[-1].chat.tools
    assert tools is not None and tools[0]["function"]["name"] == "get_weather"

    parts = [p async for p in await client.chat(model="tiny", messages=CHAT, tools=[WEATHER],
                                                stream=True)]  # fmt: skip
    streamed = [c for p in parts for c in p.message.tool_calls or []]
    assert [c.function.arguments for c in streamed] == [{"city": "Paris"}]

    # The client sends the answer back without ids: they are made up, and
    # each tool turn answers its call (by tool_name, else in order).
    history = [
        *CHAT,
        reply.message,
        {"role": "tool", "content": "18 C", "tool_name": "get_weather"},
    ]
    await client.chat(model="tiny", messages=history, tools=[WEATHER])
    sent = registry.requests[-1].messages or []
    assert sent[1].tool_calls == [ToolCall("call_1_0", "get_weather", '{"city":"Paris"}')]
    assert (sent[2].role, sent[2].tool_call_id, sent[2].name) == ("tool", "call_1_0",
                                                                   "get_weather")  # fmt: skip

    two = {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
        {"function": {"name": "get_time", "arguments": {}}},
    ]}  # fmt: skip
    history = [*CHAT, two, {"role": "tool", "content": "12:00", "tool_name": "get_time"},
               {"role": "tool", "content": "3 C"}]  # fmt: skip
    await client.chat(model="tiny", messages=history)
    sent = registry.requests[-1].messages or []
    assert [(m.tool_call_id, m.name) for m in sent[2:]] == [
        ("call_1_1", "get_time"), ("call_1_0", "get_weather")]  # fmt: skip


@pytest.mark.anyio
async def test_tool_turns_answer_by_id_then_tool_then_order() -> None:
    registry = ScriptedRegistry(THOUGHT_AND_WORDS)
    # Open WebUI's Ollama connection: each call with its index and id at the top.
    three = {"role": "assistant", "content": "", "tool_calls": [
        {"index": 0, "id": "w1", "function": {"name": "get_weather", "arguments": {}}},
        {"index": 1, "id": "t1", "function": {"name": "get_time", "arguments": {}}},
        {"index": 2, "function": {"index": 2, "name": "get_date", "arguments": {}}},
    ]}  # fmt: skip
    history = [
        *CHAT, three,
        {"role": "tool", "content": "a", "tool_call_id": "t1"},  # by id
        {"role": "tool", "content": "b", "tool_call_id": "gone", "tool_name": "get_date"},
        {"role": "tool", "content": "c", "tool_name": "get_news"},  # no such call: the first
        {"role": "tool", "content": "d"},  # nothing left to answer: no id
    ]  # fmt: skip
    async with httpx.AsyncClient(transport=front(registry), base_url="http://front") as http:
        sent = await http.post("/api/chat", json={"model": "tiny", "messages": history,
                                                  "stream": False})  # fmt: skip
    assert sent.status_code == 200, sent.text
    messages = registry.requests[-1].messages or []
    assert [c.id for c in messages[1].tool_calls or []] == ["w1", "t1", "call_1_2"]
    assert [(m.tool_call_id, m.name) for m in messages[2:]] == [
        ("t1", "get_time"), ("call_1_2", "get_date"), ("w1", "get_news"), (None, None)]  # fmt: skip


@pytest.mark.anyio
async def test_a_tool_call_the_model_broke_ends_the_answer_with_an_error() -> None:
    frames = [TextChunk(request_id=1, text="Hi", generation_tokens=1),
              done("stop", invalid_tool_call='{"name": "get_weather", "argu')]  # fmt: skip
    client = ollama_of(ScriptedRegistry(frames))
    with pytest.raises(ollama.ResponseError) as caught:
        await client.chat(model="tiny", messages=CHAT, stream=False)
    assert "tool call" in refused(caught, 500)
    with pytest.raises(ollama.ResponseError) as caught:  # mid-stream: an error line
        async for _ in await client.chat(model="tiny", messages=CHAT, stream=True):
            pass
    assert "tool call" in str(caught.value.error)


# --- messages, logprobs, errors -------------------------------------------------------


@pytest.mark.anyio
async def test_messages_are_checked_by_name() -> None:
    registry = ScriptedRegistry(THOUGHT_AND_WORDS)
    client = ollama_of(registry)
    image = [{"role": "user", "content": "What is this?", "images": [b"\x89PNG\r\n"]}]
    await client.chat(model="tiny", messages=image)  # the bytes go on (test_vision.py)
    assert registry.requests[-1].messages[0].images == [b"\x89PNG\r\n"]
    with pytest.raises(ollama.ResponseError) as caught:
        await client.chat(model="tiny", messages=[{"role": "narrator", "content": "Once"}])
    assert refused(caught).startswith("messages[0].role: unsupported role 'narrator'")
    async with httpx.AsyncClient(transport=front(registry), base_url="http://front") as http:
        nameless = await http.post("/api/chat", json={"model": "", "messages": CHAT})
    assert (nameless.status_code, nameless.json()) == (400, {"error": "model is required"})
    thinking = [*CHAT, {"role": "Assistant", "content": "Hi", "thinking": "A greeting."}]
    await client.chat(model="tiny", messages=thinking)
    assert (registry.requests[-1].messages or [])[-1] == ChatMessage(
        "assistant", "Hi", reasoning="A greeting.")  # fmt: skip


@pytest.mark.anyio
async def test_logprobs_come_with_each_token() -> None:
    entry = TokenLogprob("Hi", -0.1, [("Hi", -0.1), ("Ho", -2.5)])
    registry = ScriptedRegistry([TextChunk(request_id=1, text="Hi", generation_tokens=1,
                                   logprobs=[entry]), done("stop")])  # fmt: skip
    client = ollama_of(registry)
    reply = await client.chat(model="tiny", messages=CHAT, logprobs=True, top_logprobs=2)
    (token,) = reply.logprobs or []
    assert (token.token, token.logprob) == ("Hi", -0.1)
    assert [t.token for t in token.top_logprobs or []] == ["Hi", "Ho"]
    sampling = registry.requests[-1].sampling
    assert (sampling.logprobs, sampling.top_logprobs) == (True, 2)
    plain = await client.chat(model="tiny", messages=CHAT)
    assert plain.logprobs is None
    with pytest.raises(ollama.ResponseError) as caught:
        await client.chat(model="tiny", messages=CHAT, top_logprobs=2)
    assert "top_logprobs" in refused(caught)


@pytest.mark.anyio
async def test_the_api_key_is_asked_for_on_every_route() -> None:
    registry = ScriptedRegistry(THOUGHT_AND_WORDS)
    keyless = ollama_of(registry, key="sekret")
    for call in (keyless.chat(model="tiny", messages=CHAT), keyless.list(),
                 keyless.generate(model="tiny")):  # fmt: skip
        with pytest.raises(ollama.ResponseError) as caught:
            await call
        assert "API key" in refused(caught, 401)
    keyed = ollama_of(registry, key="sekret", headers={"Authorization": "Bearer sekret"})
    assert (await keyed.chat(model="tiny", messages=CHAT)).message.content == "Hello there"


# --- the models --------------------------------------------------------------------------


CONFIGURED = SupervisorConfig(models=[ModelConfig(name="small", model="builtin:small")])


@pytest.mark.anyio
async def test_version_list_ps_and_show_parse_in_the_clients_types() -> None:
    registry = ScriptedRegistry()
    client = ollama_of(registry, config=CONFIGURED)
    async with httpx.AsyncClient(transport=front(registry), base_url="http://front") as http:
        version = (await http.get("/api/version")).json()
    assert version == {"version": OLLAMA_API_VERSION, "mlx_supervisor": __version__}

    tiny = model_facts("builtin:tiny")
    listed = await client.list()
    assert [m.model for m in listed.models] == ["tiny", "small"]  # loaded, then configured
    first = listed.models[0]
    assert first.size == tiny.size_bytes and first.digest is not None
    assert re.fullmatch(r"[0-9a-f]{64}", first.digest)
    assert first.details is not None
    assert (first.details.format, first.details.family, first.details.parent_model) == (
        "mlx", "llama", "builtin:tiny")  # fmt: skip
    assert first.details.quantization_level == tiny.quantization
    assert first.modified_at is not None

    running = await client.ps()
    (loaded,) = running.models  # the configured one is not loaded
    assert (loaded.name, loaded.model, loaded.context_length) == ("tiny", "tiny", 4096)
    assert loaded.size == loaded.size_vram == 1 << 28  # unified memory: all the GPU's
    assert loaded.expires_at is not None and loaded.expires_at.year > 2200  # never
    registry.entry.keep_alive_s = 60.0
    (loaded,) = (await client.ps()).models
    assert loaded.expires_at is not None
    assert abs(loaded.expires_at.timestamp() - (time.time() + 60)) < 30
    for endless in (1e300, math.inf, math.nan):  # past any date: never
        registry.entry.keep_alive_s = endless
        (loaded,) = (await client.ps()).models
        assert loaded.expires_at is not None and loaded.expires_at.year > 2200

    shown = await client.show("tiny")
    assert shown.modelinfo == {"general.architecture": "llama", "llama.context_length": 4096}
    assert shown.capabilities == ["completion"]  # builtin:tiny's template has no tools
    assert shown.details is not None and shown.details.family == "llama"
    assert (await client.show("small")).details is not None
    assert (await client.show("small:latest")).details is not None  # the CLI's tag
    with pytest.raises(ollama.ResponseError) as caught:
        await client.show("nope")
    assert refused(caught, 404) == "model 'nope' not found"


def test_capabilities_are_read_from_the_chat_template(tmp_path: Path) -> None:
    template = "{% for m in messages %}{% if tools %}{{ tools }}{% endif %}<think>{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    assert template_capabilities(str(tmp_path)) == ("tools", "thinking")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert template_capabilities(str(plain)) == ()
    assert template_capabilities(None) == ()


@pytest.mark.anyio
async def test_pull_has_nothing_to_fetch_and_the_blob_routes_say_why() -> None:
    client = ollama_of(ScriptedRegistry(), config=CONFIGURED)
    assert (await client.pull("small")).status == "success"
    assert [p.status async for p in await client.pull("tiny", stream=True)] == [
        NOTHING_TO_PULL, "success"]  # fmt: skip
    with pytest.raises(ollama.ResponseError) as caught:
        await client.pull("nope")
    assert refused(caught, 404) == "model 'nope' not found"
    refusals = {
        client.delete("tiny"): "nothing to delete",
        client.copy("tiny", "tiny2"): "[[models]]",
        client.create(model="mine", from_="tiny"): "[[models]]",
        client.push("tiny"): "nothing to push",
    }
    for call, words in refusals.items():
        with pytest.raises(ollama.ResponseError) as caught:
            await call
        assert words in refused(caught, 501)


def test_the_readme_names_each_ignored_option() -> None:
    text = README.read_text()
    assert "### Ollama" in text, "the README has an Ollama section"
    section = text.split("### Ollama", 1)[1].split("\n## ")[0]
    ignored = re.search(r"accepted and ignored on purpose: ([^.]+)\.", section)
    assert ignored is not None, "the README's Ollama section lists the ignored options"
    assert set(re.findall(r"`(\w+)`", ignored.group(1))) == set(IGNORED_OPTIONS)


# --- a real daemon -------------------------------------------------------------------------


def test_a_real_model_through_the_ollama_client(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon("keep_alive_s = 120\n", env={HTTP_ENV: "127.0.0.1:0"})
    control = Client(daemon.socket_path)
    url = control.status().supervisor.http
    assert url is not None
    control.load("builtin:tiny")
    client = ollama.Client(host=url, timeout=120)

    def runner() -> RunnerInfo:
        (tiny,) = control.status().runners
        return tiny

    # keep_alive restarts the idle timer and holds for that request; one
    # with none brings the daemon's keep_alive_s back.
    idle_since = runner().last_used_at
    assert idle_since is not None
    assert client.generate(model="tiny:latest", keep_alive="10m").done_reason == "load"
    loaded = runner()
    assert loaded.keep_alive_s == 600 and (loaded.last_used_at or 0) > idle_since
    reply = client.chat(model="tiny", messages=CHAT, options={"num_predict": 8}, stream=False)
    assert reply.done_reason == "length" and reply.eval_count == 8
    assert reply.prompt_eval_count and reply.prompt_eval_count > 0
    assert reply.eval_duration and reply.eval_duration > 0
    parts = list(client.generate(model="tiny", prompt="Hi", options={"num_predict": 4},
                                 stream=True))  # fmt: skip
    assert parts[-1].done and parts[-1].eval_count == 4
    assert "".join(p.response or "" for p in parts[:-1]) != ""
    (running,) = client.ps().models
    assert running.size_vram and running.size_vram > 0 and running.context_length == 4096
    assert client.show("tiny").capabilities == ["completion"]
    assert runner().keep_alive_s == 120  # the requests above gave no keep_alive
    assert client.generate(model="tiny", keep_alive=0).done_reason == "unload"
    assert control.status().runners == []

    control.load("builtin:tiny", pinned=True)
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="tiny", messages=[], keep_alive=0)
    assert "tiny is pinned" in refused(caught, 409)
    assert runner().state == "ready"  # still loaded

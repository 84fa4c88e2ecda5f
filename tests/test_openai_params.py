"""Every parameter of the OpenAI front: honoured (it reaches the runner and
changes the tokens) or refused with a 400 that names it, never dropped in
silence; and the replies' parts (reasoning, tool calls, logprobs) in the
shapes the unmodified ``openai`` client and ``langchain-openai`` read.

Three kinds of test: the reply shapes against scripted runner frames (a
stand-in registry behind the real front, read by the real ``openai``
client), real daemons with builtin:tiny for the sampling parameters, and,
in the last section, constrained decoding (JSON schemas, forced tool calls),
which needs the runner's grammar (runner/constrained.py) and output splitter
(runner/output.py)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal, cast

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from starlette.applications import Starlette
from starlette.routing import Route
from tokenizers import Tokenizer

from conftest import DaemonFactory
from ipc.messages import (
    ChatMessage,
    ChatOptions,
    GenerationDone,
    NamedTool,
    ResponseFormat,
    SamplingParams,
    TextChunk,
    TokenLogprob,
    ToolCall,
)
from runner.builtin import ensure_builtin_model
from scripted import ScriptedRegistry, done
from supervisor.client import Client
from supervisor.config import HTTP_ENV, SupervisorConfig
from supervisor.fronts.http.completions import Completions
from supervisor.fronts.http.openai_requests import IGNORED_FIELDS, Ignored
from supervisor.fronts.http.requests import ApiKey
from supervisor.registry.registry import Registry

README = Path(__file__).resolve().parent.parent / "README.md"
CHAT = [{"role": "user", "content": "Tell me a story."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def start(start_daemon: DaemonFactory, config: str | None = None) -> tuple[Client, str]:
    """A daemon with its HTTP front on a free port: its client and the front's /v1 URL."""
    daemon = start_daemon(config, env={HTTP_ENV: "127.0.0.1:0"})
    client = Client(daemon.socket_path)
    url = client.status().supervisor.http
    assert url is not None
    return client, f"{url}/v1"


def api_of(base_url: str, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120, **kwargs)


# --- the request's fields ------------------------------------------------------------


def test_the_ignored_fields_are_one_list_and_the_readme_names_each() -> None:
    assert set(Ignored.__struct_fields__) == set(IGNORED_FIELDS)
    section = README.read_text().split("## Using it from OpenAI clients", 1)[1].split("\n## ")[0]
    ignored = re.search(r"accepted and ignored on purpose: ([^.]+)\.", section)
    assert ignored is not None, "the README's OpenAI section lists the ignored fields"
    assert set(re.findall(r"`(\w+)`", ignored.group(1))) == set(IGNORED_FIELDS)


UNSUPPORTED_CHAT = {
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "verbosity": "low",
    "logit_bias_mode": "x",
    # mlx_lm.server's that we do not take: drafts are a load-time choice here
    # (its "adapters" we take: tests/test_adapters.py).
    "draft_model": "x",
    "num_draft_tokens": 3,
    "role_mapping": {},
    "bogus": 1,
}
UNSUPPORTED_TEXT = {
    "echo": True,
    "suffix": "x",
    "best_of": 2,
    "tools": [WEATHER],
    "response_format": {"type": "json_object"},
    "top_logprobs": 2,
}


def test_unsupported_parameters_are_400s_naming_them(start_daemon: DaemonFactory) -> None:
    """Through the openai client's ``extra_body``, as a client would send
    them; the body is refused before any model is looked for (there is none)."""
    _, base = start(start_daemon)
    api = api_of(base)

    def refused(call: Any, **kwargs: Any) -> dict[str, Any]:
        with pytest.raises(openai.BadRequestError) as caught:
            call(model="nope", max_tokens=4, **kwargs)
        error = caught.value.body
        assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
        return error

    for field, value in UNSUPPORTED_CHAT.items():
        error = refused(api.chat.completions.create, messages=CHAT, extra_body={field: value})
        assert (error["param"], error["message"]) == (field, f"unsupported parameter: {field}")
    for field, value in UNSUPPORTED_TEXT.items():
        error = refused(api.completions.create, prompt="Hi", extra_body={field: value})
        assert (error["param"], error["message"]) == (field, f"unsupported parameter: {field}")
    nested = [{"role": "user", "content": "Hi", "audio": {"id": "a"}}]
    assert refused(api.chat.completions.create, messages=nested)["param"] == "messages[0].audio"

    # Honoured fields with a wrong setting name themselves too.
    chat = api.chat.completions.create
    assert (
        refused(
            chat,
            messages=CHAT,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )["param"]
        == "tool_choice"
    )
    assert refused(chat, messages=CHAT, tool_choice="required")["param"] == "tool_choice"
    custom = {"type": "custom", "custom": {"name": "x"}}
    assert refused(chat, messages=CHAT, tools=[custom])["param"] == "tools[0]"
    assert refused(chat, messages=CHAT, top_logprobs=2)["param"] == "top_logprobs"
    assert refused(chat, messages=CHAT, logprobs=True, top_logprobs=21)["param"] == "top_logprobs"
    assert refused(chat, messages=CHAT, logit_bias={"12": 101})["param"] == "logit_bias"
    assert refused(chat, messages=CHAT, logit_bias={"x": 1})["param"] == "logit_bias"
    assert refused(chat, messages=CHAT, response_format={"type": "yaml"})["param"] == (
        "response_format"
    )
    assert refused(chat, messages=CHAT, presence_penalty=3)["param"] == "presence_penalty"
    assert refused(chat, messages=CHAT, extra_body={"top_k": -1})["param"] == "top_k"
    bad_args = [
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
            ],
        }
    ]
    assert refused(chat, messages=bad_args)["param"] == (
        "messages[0].tool_calls[0].function.arguments"
    )
    assert refused(chat, messages=[{"role": "tool", "content": "x"}])["param"] == (
        "messages[0].tool_call_id"
    )
    assert refused(chat, messages=[{"role": "function", "content": "x"}])["param"] == (
        "messages[0].role"
    )

    # The ignored ones pass the check: the answer is the unknown model's 404.
    ignored = {field: "x" for field in IGNORED_FIELDS} | {"metadata": {"k": "v"}}
    with pytest.raises(openai.NotFoundError, match="no model 'nope'"):
        chat(model="nope", messages=CHAT, extra_body=ignored)


# --- the replies, against scripted runner frames ----------------------------------------


def logprob(token: str, value: float, *others: str) -> TokenLogprob:
    return TokenLogprob(
        token, value, [(token, value)] + [(o, value - 1 - i) for i, o in enumerate(others)]
    )


CALLS = [
    ToolCall("call_1", "get_weather", '{"city": "Paris"}'),
    ToolCall("call_2", "get_weather", '{"city": "Rome"}'),
]
FRAMES: list[TextChunk | GenerationDone] = [
    TextChunk(1, "", 2, reasoning="Weather is ", logprobs=[logprob("We", -0.5, "The")]),
    TextChunk(1, "Let me look.", 4, reasoning="asked.", logprobs=[logprob("Let", -0.25, "I")]),
    TextChunk(1, "", 6, tool_calls=CALLS[:1]),
    TextChunk(1, "", 9, tool_calls=CALLS[1:]),
    done("tool_calls", reasoning_tokens=3),
]


def scripted_api(registry: ScriptedRegistry) -> openai.AsyncOpenAI:
    """The real openai client on the real front, over ASGI, before ``registry``."""
    completions = Completions(cast(Registry, registry), SupervisorConfig(), ApiKey(None))
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", completions.route(chat=True), methods=["POST"]),
            Route("/v1/completions", completions.route(chat=False), methods=["POST"]),
        ]
    )
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    return openai.AsyncOpenAI(
        base_url="http://front/v1", api_key="x", max_retries=0, http_client=http
    )


async def collect(stream: AsyncIterator[Any]) -> list[Any]:
    return [chunk async for chunk in stream]


@pytest.mark.anyio
async def test_reasoning_tool_calls_and_logprobs_reach_the_openai_client() -> None:
    api = scripted_api(ScriptedRegistry(FRAMES))
    whole = await api.chat.completions.create(
        model="tiny", messages=CHAT, tools=[WEATHER], logprobs=True, top_logprobs=1
    )
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.content == "Let me look."
    assert (message.model_extra or {})["reasoning_content"] == "Weather is asked."
    assert message.tool_calls is not None
    assert [
        (c.id, c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls
    ] == [("call_1", "get_weather", {"city": "Paris"}), ("call_2", "get_weather", {"city": "Rome"})]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [(t.token, t.logprob, t.bytes) for t in choice.logprobs.content] == [
        ("We", -0.5, list(b"We")),
        ("Let", -0.25, list(b"Let")),
    ]
    assert [t.token for t in choice.logprobs.content[0].top_logprobs] == ["We", "The"]
    assert whole.usage is not None and whole.usage.completion_tokens_details is not None
    assert whole.usage.completion_tokens_details.reasoning_tokens == 3

    # The answer goes back into the history as the client holds it.
    registry = ScriptedRegistry([TextChunk(1, "Sunny.", 1), done()])
    again = scripted_api(registry)
    answered = [*CHAT, message, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    await again.chat.completions.create(model="tiny", messages=answered, tools=[WEATHER])
    assert registry.requests[0].messages is not None
    assert registry.requests[0].messages[1] == ChatMessage(
        "assistant", "Let me look.", tool_calls=CALLS, reasoning="Weather is asked."
    )

    # Streamed: the SDK's own accumulator rebuilds the same message from the deltas.
    async with api.chat.completions.stream(
        model="tiny", messages=CHAT, tools=[WEATHER], logprobs=True, top_logprobs=1
    ) as stream:
        chunks = [event.chunk async for event in stream if event.type == "chunk"]
        final = await stream.get_final_completion()
    assert final.choices[0].message.content == "Let me look."
    assert [
        (c.id, c.function.name, c.function.arguments)
        for c in final.choices[0].message.tool_calls or []
    ] == [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls]
    assert final.choices[0].finish_reason == "tool_calls"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content", "") for d in deltas) == (
        "Weather is asked."
    )
    assert [tc.index for d in deltas for tc in d.tool_calls or []] == [0, 1]
    streamed = [
        t.token
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content or []
    ]
    assert streamed == ["We", "Let"]

    # Text completions: the legacy API's parallel lists.
    text = await api.completions.create(model="tiny", prompt="Hi", logprobs=2)
    logprobs = text.choices[0].logprobs
    assert logprobs is not None
    assert (logprobs.tokens, logprobs.token_logprobs, logprobs.text_offset) == (
        ["We", "Let"],
        [-0.5, -0.25],
        [0, 2],
    )
    assert logprobs.top_logprobs == [{"We": -0.5, "The": -1.5}, {"Let": -0.25, "I": -1.25}]


@pytest.mark.anyio
async def test_text_top_logprobs_keep_the_likeliest_of_tokens_that_read_the_same() -> None:
    """The legacy API keys alternatives by their text: two tokens that decode
    to the same string (a byte-level BPE has such pairs) are one entry, with
    the higher logprob, whichever order they came in."""
    same = TokenLogprob(" a", -0.5, [(" a", -0.5), ("b", -1.0), (" a", -2.0)])
    later = TokenLogprob("c", -0.1, [("d", -3.0), ("c", -0.1), ("d", -1.5)])
    api = scripted_api(ScriptedRegistry([TextChunk(1, " ac", 2, logprobs=[same, later]), done()]))
    text = await api.completions.create(model="tiny", prompt="Hi", logprobs=3)
    assert text.choices[0].logprobs is not None
    assert text.choices[0].logprobs.top_logprobs == [
        {" a": -0.5, "b": -1.0},
        {"d": -1.5, "c": -0.1},
    ]
    streamed = await collect(
        await api.completions.create(model="tiny", prompt="Hi", logprobs=3, stream=True)
    )
    tops = [
        top for c in streamed if c.choices[0].logprobs for top in c.choices[0].logprobs.top_logprobs
    ]
    assert tops == [{" a": -0.5, "b": -1.0}, {"d": -1.5, "c": -0.1}]


@pytest.mark.anyio
async def test_a_token_that_holds_part_of_a_character_keeps_its_bytes() -> None:
    """ "日" in two tokens: each carries its own bytes (as the runner sends them),
    never the UTF-8 of a replacement character; text offsets count the
    character once it is whole."""
    head = TokenLogprob("\\xe6\\x97", -0.1, [("\\xe6\\x97", -0.1), ("x", -3.0)],
                        bytes=[0xE6, 0x97], top_bytes=[[0xE6, 0x97], None])  # fmt: skip
    tail = TokenLogprob("\\xa5", -0.2, [("\\xa5", -0.2)], bytes=[0xA5], top_bytes=[[0xA5]])
    after = TokenLogprob("!", -0.3, [("!", -0.3)])
    frames = [TextChunk(1, "日!", 3, logprobs=[head, tail, after]), done()]
    api = scripted_api(ScriptedRegistry(frames))
    reply = await api.chat.completions.create(
        model="tiny", messages=CHAT, logprobs=True, top_logprobs=2
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert [c.bytes for c in content] == [[0xE6, 0x97], [0xA5], [0x21]]
    assert bytes(b for c in content for b in c.bytes or []).decode() == "日!"
    assert [t.bytes for t in content[0].top_logprobs] == [[0xE6, 0x97], [ord("x")]]
    api = scripted_api(ScriptedRegistry(frames))
    text = await api.completions.create(model="tiny", prompt="Hi", logprobs=1)
    assert text.choices[0].logprobs is not None
    assert text.choices[0].logprobs.text_offset == [0, 0, 1]


@pytest.mark.anyio
async def test_parallel_tool_calls_false_ends_the_answer_at_its_first_call() -> None:
    """The front stops the generation at the model's first call; what the
    runner sends until the cancel reaches it is not part of the answer."""
    frames = [
        TextChunk(1, "", 3, tool_calls=CALLS),
        TextChunk(1, "more", 4),
        done("cancelled", invalid_tool_call="<tool_call>{"),  # the cancel cut a third call
    ]
    registry = ScriptedRegistry(frames)
    api = scripted_api(registry)
    reply = await api.chat.completions.create(
        model="tiny", messages=CHAT, tools=[WEATHER], parallel_tool_calls=False
    )
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [c.id for c in choice.message.tool_calls or []] == ["call_1"]
    assert registry.cancelled[0], "the generation was stopped after its first call"
    chunks = await collect(
        await api.chat.completions.create(
            model="tiny", messages=CHAT, tools=[WEATHER], parallel_tool_calls=False, stream=True
        )
    )
    calls = [tc.id for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert calls == ["call_1"] and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks)
    # Allowed in parallel (the default), both calls are the answer.
    registry.frames = [TextChunk(1, "", 3, tool_calls=CALLS), done("tool_calls")]
    both = await api.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER])
    assert len(both.choices[0].message.tool_calls or []) == 2


@pytest.mark.anyio
async def test_a_broken_call_after_the_cut_does_not_spoil_the_first_one() -> None:
    """The runner may end before the front's cancel reaches it, with a later
    call broken: that call is past the answer's end, so the answer is the
    first call and a 200, whole or streamed."""
    frames = [
        TextChunk(1, "", 3, tool_calls=CALLS[:1]),
        done("tool_calls", invalid_tool_call="<tool_call>{bad"),
    ]
    api = scripted_api(ScriptedRegistry(frames))
    reply = await api.chat.completions.create(
        model="tiny", messages=CHAT, tools=[WEATHER], parallel_tool_calls=False
    )
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls"
    assert [c.id for c in choice.message.tool_calls or []] == ["call_1"]
    assert "invalid_tool_call" not in (reply.model_extra or {})["supervisor"]
    chunks = await collect(
        await api.chat.completions.create(
            model="tiny", messages=CHAT, tools=[WEATHER], parallel_tool_calls=False, stream=True
        )
    )
    assert [tc.id for c in chunks for tc in c.choices[0].delta.tool_calls or []] == ["call_1"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.anyio
async def test_a_broken_tool_call_is_an_error_and_one_cut_short_ends_with_length() -> None:
    registry = ScriptedRegistry(
        [TextChunk(1, "Sure.", 2), done("stop", invalid_tool_call='<tool_call>{"name": ')]
    )
    api = scripted_api(registry)
    with pytest.raises(openai.InternalServerError, match="tool call that does not parse") as e:
        await api.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER])
    assert isinstance(e.value.body, dict) and e.value.body["code"] == "invalid_tool_call"
    with pytest.raises(openai.APIError, match="tool call that does not parse"):
        await collect(
            await api.chat.completions.create(
                model="tiny", messages=CHAT, tools=[WEATHER], stream=True
            )
        )

    registry.frames = [
        TextChunk(1, "Sure.", 2),
        done("length", invalid_tool_call='<tool_call>{"name": '),
    ]
    cut = await api.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER])
    assert cut.choices[0].finish_reason == "length"
    assert cut.choices[0].message.content == "Sure." and not cut.choices[0].message.tool_calls
    assert (cut.model_extra or {})["supervisor"]["invalid_tool_call"] == '<tool_call>{"name": '


@pytest.mark.anyio
async def test_every_honoured_field_reaches_the_wire() -> None:
    """What the runner is asked for, field by field (the daemon tests below
    show that each one changes the tokens)."""
    registry = ScriptedRegistry([TextChunk(1, "ok", 1), done()])
    api = scripted_api(registry)
    history = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Weather in "},
                {"type": "text", "text": "Paris?"},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Look it up.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
    ]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    await api.chat.completions.create(
        model="tiny",
        messages=history,
        max_completion_tokens=7,
        temperature=0.5,
        top_p=0.9,
        seed=3,
        stop=["\n\n"],
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"12": 5, "7": -100},
        logprobs=True,
        top_logprobs=4,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "A", "schema": schema, "strict": True},
        },
        reasoning_effort="low",
        user="me",
        store=False,
        extra_body={
            "top_k": 5,
            "min_p": 0.1,
            "repetition_penalty": 1.3,
            "repetition_context_size": 40,
            "xtc_probability": 0.5,
            "xtc_threshold": 0.2,
            "max_reasoning_tokens": 64,
            "chat_template_kwargs": {"enable_thinking": True},
        },
    )
    (request,) = registry.requests
    assert request.sampling == SamplingParams(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        seed=3,
        stop=("\n\n",),
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.3,
        repetition_context_size=40,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={12: 5.0, 7: -100.0},
        xtc_probability=0.5,
        xtc_threshold=0.2,
        logprobs=True,
        top_logprobs=4,
        max_reasoning_tokens=64,
    )
    assert request.chat == ChatOptions(
        tools=[WEATHER],
        tool_choice=NamedTool("get_weather"),
        response_format=ResponseFormat("json_schema", schema, "A"),
        chat_template_kwargs={"enable_thinking": True, "reasoning_effort": "low"},
    )
    assert request.messages == [
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Weather in Paris?"),
        ChatMessage(
            "assistant",
            "",
            tool_calls=[ToolCall("c1", "get_weather", '{"city": "Paris"}')],
            reasoning="Look it up.",
        ),
        ChatMessage("tool", "sunny", tool_call_id="c1"),
    ]

    registry.requests.clear()
    await api.chat.completions.create(
        model="tiny",
        messages=CHAT,
        reasoning_effort="none",
        response_format={"type": "json_object"},
    )
    await api.completions.create(
        model="tiny", prompt="Hi", logprobs=0, extra_body={"top_k": 2, "logit_bias": {"3": 1}}
    )
    chat, text = registry.requests
    assert chat.chat.chat_template_kwargs == {"reasoning_effort": "none", "enable_thinking": False}
    assert chat.chat.response_format == ResponseFormat("json_object")
    assert (text.sampling.top_k, text.sampling.logit_bias) == (2, {3: 1.0})
    assert (text.sampling.logprobs, text.sampling.top_logprobs) == (True, 0)
    assert text.chat == ChatOptions()


# --- real daemons: each parameter changes the tokens ---------------------------------------


def tiny_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(ensure_builtin_model("builtin:tiny") / "tokenizer.json"))


def test_each_sampling_parameter_changes_the_tokens(start_daemon: DaemonFactory) -> None:
    client, base = start(start_daemon)
    client.load("builtin:tiny")
    api = api_of(base)

    def answer(**kwargs: Any) -> str:
        extra = {
            k: kwargs.pop(k)
            for k in list(kwargs)
            if k
            not in (
                "temperature",
                "seed",
                "presence_penalty",
                "frequency_penalty",
                "logit_bias",
                "top_p",
            )
        }
        reply = api.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=16, extra_body=extra, **kwargs
        )
        assert reply.choices[0].finish_reason == "length"
        return reply.choices[0].message.content or ""

    greedy = answer()
    sampled = answer(temperature=1.0, seed=7)
    assert sampled != greedy, "the seed's sample is not the greedy answer (else nothing is shown)"
    assert answer(temperature=1.0, seed=7) == sampled  # a seed repeats
    assert answer(temperature=1.0, seed=8) != sampled
    # Samplers that keep only the likeliest token are greedy at any temperature.
    assert answer(temperature=1.0, seed=7, top_k=1) == greedy
    assert answer(temperature=1.0, seed=7, min_p=1.0) == greedy
    assert answer(temperature=1.0, seed=7, top_k=50) != greedy
    # XTC takes out the likeliest tokens (all above the threshold but one).
    assert answer(temperature=1.0, seed=7, xtc_probability=1.0, xtc_threshold=0.01) != sampled
    # logit_bias: OpenAI's token-id strings; +100 makes that token the answer.
    (cat,) = tiny_tokenizer().encode(" cat", add_special_tokens=False).ids
    assert answer(logit_bias={str(cat): 100}).split() == ["cat"] * 16

    # Penalties act on tokens the answer repeats, which a random model seldom
    # does: the smallest bias (to 0.4) that makes " cat" its every token leaves
    # " cat" ahead by less than that at some step, where a penalty turns it.
    def all_cats(bias: float, **kwargs: Any) -> bool:
        return answer(logit_bias={str(cat): bias}, **kwargs).split() == ["cat"] * 16

    low, high = 0.0, 100.0
    while high - low > 0.4:
        low, high = (
            (low, (low + high) / 2) if all_cats((low + high) / 2) else ((low + high) / 2, high)
        )
    assert all_cats(high) and not all_cats(low)
    assert not all_cats(high, presence_penalty=2.0)
    assert not all_cats(high, frequency_penalty=2.0)
    assert not all_cats(high, repetition_penalty=2.0)

    # Over the last token only, " cat" is penalised right after itself, and
    # comes back a token later; over 200 it stays penalised.
    def penalised(penalty: str, context: int) -> str:
        size = penalty.replace("penalty", "context_size")
        return answer(logit_bias={str(cat): high}, **{penalty: 2.0, size: context})

    assert penalised("repetition_penalty", 1).count("cat") > penalised(
        "repetition_penalty", 200
    ).count("cat")
    # The presence and frequency penalties' windows are honoured too: the same
    # penalty over 1 token and over 200 gives other tokens.
    for penalty in ("presence_penalty", "frequency_penalty"):
        assert penalised(penalty, 1) != penalised(penalty, 200), penalty

    # Text completions take the same knobs.
    text = api.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=8, logit_bias={str(cat): 100}
    )
    assert text.choices[0].text.split() == ["cat"] * 8
    top1 = api.completions.create(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=8,
        temperature=1.0,
        seed=7,
        extra_body={"top_k": 1},
    )
    plain = api.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8)
    assert top1.choices[0].text == plain.choices[0].text


def test_logprobs_whole_and_streamed_with_the_top_count_asked(
    start_daemon: DaemonFactory,
) -> None:
    client, base = start(start_daemon)
    client.load("builtin:tiny")
    api = api_of(base)
    reply = api.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=8, logprobs=True, top_logprobs=3
    )
    (choice,) = reply.choices
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert len(entries) == 8
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        # Greedy: the chosen token is the likeliest.
        assert (entry.token, entry.logprob) == (entry.top_logprobs[0].token, values[0])
        assert entry.bytes == entry.top_logprobs[0].bytes
    # The tokens' bytes, end to end, are the answer's text (a token may hold
    # part of a character: its own text is then its bytes escaped); the
    # detokenizer drops the first token's leading space.
    answer = bytes(b for entry in entries for b in entry.bytes or [])
    assert answer.decode("utf-8", errors="replace").removeprefix(" ") == choice.message.content

    chunks = list(
        api.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=8, logprobs=True, top_logprobs=3, stream=True
        )
    )
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    assert [(e.token, e.logprob, len(e.top_logprobs)) for e in streamed] == [
        (e.token, e.logprob, 3) for e in entries
    ]

    bare = api.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, logprobs=True)
    assert bare.choices[0].logprobs is not None and bare.choices[0].logprobs.content is not None
    assert [len(e.top_logprobs) for e in bare.choices[0].logprobs.content] == [0] * 4
    off = api.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4)
    assert off.choices[0].logprobs is None

    text = api.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, logprobs=2)
    logprobs = text.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert logprobs.top_logprobs is not None and logprobs.text_offset is not None
    assert len(logprobs.tokens) == 6
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)
    # Offsets count characters: a whole token adds its text's length, a token
    # that holds part of a character (its text escaped) adds none until the
    # character is whole (test_a_token_that_holds_part_of_a_character_...).
    offsets = logprobs.text_offset
    assert offsets[0] == 0
    for i, token in enumerate(logprobs.tokens[:-1]):
        step = offsets[i + 1] - offsets[i]
        assert step == len(token) if "\\x" not in token else 0 <= step <= 1
    streamed_text = list(
        api.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=6, logprobs=2, stream=True
        )
    )
    assert [
        t
        for c in streamed_text
        if c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens or []
    ] == logprobs.tokens


# A tiny model whose chat template shows tools, tool turns and two template
# arguments, in the Hermes / Qwen2.5 syntax (mlx-lm picks its json_tools parser
# for it: "<tool_call>" and "tool_call.name" in the template).
TOOLS_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}{{- '<|im_start|>system\\nTools:\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    '{{- \'Call one as <tool_call>\\n{"name": <name>, "arguments": <args>}\\n</tool_call>\' }}'
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- if reasoning_effort is defined %}{{- 'Effort: ' + reasoning_effort + '\\n' }}{%- endif %}"
    "{%- if greeting is defined %}{{- greeting + '\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- else %}{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content }}"
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "{%- set tool_call = tool_call.function %}"
    '{{- \'<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \''
    " + (tool_call.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{%- if message.tool_call_id %}{{- ' (' + message.tool_call_id + ')' }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def tools_model(root: Path) -> Path:
    """builtin:tiny with TOOLS_TEMPLATE as its chat template, in ``root``."""
    target = root / "tiny-tools"
    shutil.copytree(ensure_builtin_model("builtin:tiny"), target)
    config_file = target / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    config_file.write_text(json.dumps(config))
    return target


def call_turns(arguments: str, call_id: str) -> list[dict[str, Any]]:
    return [
        *CHAT,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
    ]


def test_tools_tool_turns_and_template_arguments_reach_the_chat_template(
    start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    """Each reaches the template: the prompt grows by what the template
    shows of it (prompt_tokens, in the answer's usage)."""
    client, base = start(start_daemon)
    client.load(str(tools_model(tmp_path)), name="tools")
    api = api_of(base)

    def prompt_tokens(messages: list[dict[str, Any]] = CHAT, **kwargs: Any) -> int:
        reply = api.chat.completions.create(
            model="tools", messages=messages, max_tokens=2, **kwargs
        )
        assert reply.usage is not None
        return reply.usage.prompt_tokens

    bare = prompt_tokens()
    assert prompt_tokens(tools=[WEATHER]) > bare
    assert prompt_tokens(tools=[WEATHER], tool_choice="auto") == prompt_tokens(tools=[WEATHER])
    assert prompt_tokens(tools=[WEATHER], tool_choice="none") > bare
    assert prompt_tokens(extra_body={"chat_template_kwargs": {"greeting": "Hello there"}}) > bare
    assert prompt_tokens(reasoning_effort="high") > bare
    # An assistant's tool calls (their arguments, as JSON) and the tool's answer (its call id).
    short = prompt_tokens(call_turns('{"city": "Rome"}', "c1"))
    assert prompt_tokens(call_turns('{"city": "Rome, in Lazio, Italy"}', "c1")) > short
    assert prompt_tokens(call_turns('{"city": "Rome"}', "call_0123456789abcdef")) > short


def test_langchain_binds_tools_and_sends_tool_turns_back(
    start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    """Its tools reach the template (the prompt grows), and the history it
    writes after a call (the AI turn's tool_calls, a ToolMessage) is taken."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    client, base = start(start_daemon)
    client.load(str(tools_model(tmp_path)), name="tools")

    class GetWeather(BaseModel):
        """The weather in a city."""

        city: str

    chat = ChatOpenAI(base_url=base, api_key="x", model="tools", max_tokens=4, max_retries=0)
    plain = chat.invoke("Weather in Paris?")
    bound = chat.bind_tools([GetWeather]).invoke("Weather in Paris?")
    assert isinstance(bound, AIMessage) and plain.usage_metadata and bound.usage_metadata
    assert bound.usage_metadata["input_tokens"] > plain.usage_metadata["input_tokens"]
    called = AIMessage("", tool_calls=[{"name": "GetWeather", "args": {"city": "Paris"},
                                        "id": "call_1", "type": "tool_call"}])  # fmt: skip
    history = [HumanMessage("Weather in Paris?"), called,
               ToolMessage("sunny", tool_call_id="call_1")]  # fmt: skip
    after = chat.bind_tools([GetWeather]).invoke(history)
    assert after.usage_metadata is not None
    assert after.usage_metadata["input_tokens"] > bound.usage_metadata["input_tokens"]


# --- constrained decoding ------------------------------------------------------------------
# These need the runner's grammar (runner/constrained.py) and output splitter
# (runner/output.py): a random-weight model answers schema-valid JSON, and a
# forced tool call whose arguments follow the tool's schema, only because the
# grammar allows nothing else.


class City(BaseModel):
    name: str = Field(max_length=10)
    population: int = Field(ge=0, le=10_000)
    capital: bool
    kind: Literal["town", "city"]


def test_a_json_schema_answer_follows_the_schema(start_daemon: DaemonFactory) -> None:
    client, base = start(start_daemon)
    client.load("builtin:tiny")
    api = api_of(base)
    schema = City.model_json_schema()
    form = {
        "type": "json_schema",
        "json_schema": {"name": "City", "schema": schema, "strict": True},
    }
    reply = api.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=200, response_format=form
    )
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    City.model_validate(json.loads(reply.choices[0].message.content or ""))
    # Streamed, sampled at temperature 1: the same holds.
    chunks = list(
        api.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=200,
            response_format=form,
            temperature=1.0,
            seed=3,
            stream=True,
        )
    )
    City.model_validate_json("".join(c.choices[0].delta.content or "" for c in chunks))
    # The openai client's own parse helper reads it into the model.
    parsed = api.chat.completions.parse(
        model="tiny", messages=CHAT, max_tokens=200, response_format=City
    )
    assert isinstance(parsed.choices[0].message.parsed, City)

    # A schema the grammar library cannot compile is the caller's 400, naming why.
    bad = {"type": "json_schema", "json_schema": {"name": "Bad", "schema": {"type": "nothing"}}}
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, response_format=bad)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first run fetches builtin:smollm2 (93 MB)
def test_a_json_object_answer_is_one_json_object(
    start_daemon: DaemonFactory, smollm2_dir: Path
) -> None:
    """A real model: JSON with no schema lets a random model write one string
    for ever (the grammar allows it), where a real one closes its object."""
    client, base = start(start_daemon)
    client.load("builtin:smollm2", name="smol")
    ask = [{"role": "user", "content": "The capital of France, as JSON with the key capital."}]
    reply = api_of(base).chat.completions.create(
        model="smol", messages=ask, max_tokens=100, response_format={"type": "json_object"}
    )
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


class WeatherArgs(BaseModel):
    model_config = {"extra": "forbid"}
    city: str = Field(max_length=12)


def test_required_and_named_tool_choice_give_calls_whose_arguments_validate(
    start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    client, base = start(start_daemon)
    client.load(str(tools_model(tmp_path)), name="tools")
    api = api_of(base)
    other = {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    }
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        reply = api.chat.completions.create(
            model="tools", messages=CHAT, max_tokens=200, tools=[other, WEATHER], tool_choice=choice
        )
        (answer,) = reply.choices
        assert answer.finish_reason == "tool_calls", answer.message
        assert answer.message.tool_calls, answer.message
        for call in answer.message.tool_calls:
            arguments = json.loads(call.function.arguments)
            if call.function.name == "get_weather":
                WeatherArgs.model_validate(arguments)
            else:
                assert call.function.name == "get_time" and arguments == {}
            assert call.id
        if isinstance(choice, dict):
            assert {c.function.name for c in answer.message.tool_calls} == {"get_weather"}
    # Streamed: the calls come as deltas with their index.
    chunks = list(
        api.chat.completions.create(
            model="tools",
            messages=CHAT,
            max_tokens=200,
            tools=[WEATHER],
            tool_choice="required",
            stream=True,
        )
    )
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas and [d.index for d in deltas] == list(range(len(deltas)))
    WeatherArgs.model_validate_json(deltas[0].function.arguments or "")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_langchain_structured_output_and_forced_tool_calls(
    start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    from langchain_openai import ChatOpenAI

    client, base = start(start_daemon)
    client.load(str(tools_model(tmp_path)), name="tools")
    chat = ChatOpenAI(base_url=base, api_key="x", model="tools", max_tokens=200, max_retries=0)
    city = chat.with_structured_output(City, method="json_schema").invoke("Name a city.")
    assert isinstance(city, City)

    class GetWeather(BaseModel):
        """The weather in a city."""

        city: str = Field(max_length=12)

    forced = chat.bind_tools([GetWeather], tool_choice="any").invoke("Weather in Paris?")
    assert forced.tool_calls, forced
    (call, *_) = forced.tool_calls
    assert call["name"] == "GetWeather"
    GetWeather.model_validate(call["args"])

"""Tool calls and reasoning end to end: real daemons, builtin:tiny-qwen3-tools
(Qwen3's chat template, its ``<think>`` and ``<tool_call>`` tags single
tokens, so mlx-lm finds its thinking tags and its ``json_tools`` parser as
for a real Qwen3), the unmodified ``openai`` client.

The model's weights are random and its output rows for the tags are zero:
sampling never writes a tag. A tag comes only where something forces it:
the grammar of a forced tool call (``tool_choice`` "required" or named), or
the ``script_text`` fault, which makes every generation of a runner write a
given text through the real decode path (detokenizer, output splitter,
front) and then end (see runner/faults.py). So what these tests check is
the path from the model's tokens to the client's fields, not the model."""

from __future__ import annotations

import base64
import json
from typing import Any

import openai
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from pydantic import BaseModel, ConfigDict, Field

from conftest import DaemonFactory, faults
from runner.builtin import ensure_builtin_model
from supervisor.client import Client
from supervisor.config import HTTP_ENV

MODEL = "builtin:tiny-qwen3-tools"
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]


class WeatherArgs(BaseModel):
    """WEATHER's parameters, as pydantic checks them."""

    model_config = ConfigDict(extra="forbid", strict=True)
    city: str = Field(max_length=12)
    days: int | None = Field(default=None, ge=1, le=7)


class TimeArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    zone: str = Field(pattern="^(UTC|CET)$")


ARGS = {"get_weather": WeatherArgs, "get_time": TimeArgs}

THOUGHT = "The user asks about the weather. I answer kindly."
ANSWER = "It is sunny in Paris."
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'


def start(start_daemon: DaemonFactory) -> tuple[Client, openai.OpenAI]:
    """A daemon with its HTTP front on a free port: its client, and an
    ``openai`` client of the front."""
    daemon = start_daemon(env={HTTP_ENV: "127.0.0.1:0"})
    client = Client(daemon.socket_path)
    url = client.status().supervisor.http
    assert url is not None
    return client, openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


def scripted(text: str, fault: str = "script_text") -> dict[str, str]:
    """A load's env whose runner writes ``text`` in every generation."""
    return faults(f"{fault}={base64.b64encode(text.encode()).decode()}")


def extra(obj: Any, name: str) -> Any:
    """A field OpenAI's types do not have (``reasoning_content``, ``supervisor``)."""
    return (obj.model_extra or {}).get(name)


def calls_of(message: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def streamed(chunks: list[Any]) -> dict[str, Any]:
    """A stream's parts, gathered as a client does: content and reasoning
    each joined, tool calls assembled by index, the finish and the usage."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    finish, usage = None, None
    for chunk in chunks:
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        delta = choice.delta
        content.append(delta.content or "")
        reasoning.append(extra(delta, "reasoning_content") or "")
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            if call.function is not None:
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    return {
        "content": "".join(content),
        "reasoning": "".join(reasoning),
        "calls": [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())],
        "finish": finish,
        "usage": usage,
    }


def tokenizer() -> Any:
    """mlx-lm's tokenizer of the model, as the runner loads it."""
    return load_tokenizer(ensure_builtin_model(MODEL))


# --- forced calls: the grammar writes the tags ------------------------------------------


NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
FORCED_CASES = [
    ("required", NO_THINKING),
    ({"type": "function", "function": {"name": "get_weather"}}, NO_THINKING),
    # Thinking on: the grammar lets a think block come first, and the random model, once
    # in it, never leaves: the reasoning budget ends it, then the call comes.
    ("required", {"max_reasoning_tokens": 8}),
]


@pytest.mark.parametrize(("choice", "body"), FORCED_CASES, ids=["required", "named", "thinking"])
def test_required_and_named_calls_come_from_the_models_tool_call_text(
    start_daemon: DaemonFactory, choice: Any, body: dict[str, Any]
) -> None:
    client, api = start(start_daemon)
    client.load(MODEL, name="tools")
    ask: dict[str, Any] = {"model": "tools", "messages": CHAT, "max_tokens": 300,
                           "tools": TOOLS, "tool_choice": choice, "extra_body": body}  # fmt: skip
    reply = api.chat.completions.create(**ask, logprobs=True)
    (answer,) = reply.choices
    assert answer.finish_reason == "tool_calls", answer.message
    # No answer but the call: at most the newlines the template writes after
    # "</think>" (the reasoning budget forces them, as Qwen3 writes them).
    assert not (answer.message.content or "").strip(), answer.message.content
    calls = calls_of(answer.message)
    assert calls, answer.message
    for name, arguments in calls:
        ARGS[name].model_validate(arguments)  # the tool's schema
    if isinstance(choice, dict):
        assert [name for name, _ in calls] == ["get_weather"]
    assert all(c.id for c in answer.message.tool_calls or [])
    # The calls were read from the model's own tags, as it wrote them.
    assert answer.logprobs is not None and answer.logprobs.content is not None
    tokens = [entry.token for entry in answer.logprobs.content]
    assert tokens.count("<tool_call>") == tokens.count("</tool_call>") == len(calls)
    thinking = extra(answer.message, "reasoning_content")
    if "max_reasoning_tokens" in body:
        assert thinking and tokens[0] == "<think>"
        assert tokens.index("</think>") < tokens.index("<tool_call>")
    else:
        assert not thinking and tokens[0] == "<tool_call>", tokens[:5]

    # Streamed, greedy: the deltas add up to the same calls and thinking.
    chunks = list(api.chat.completions.create(**ask, stream=True,
                                              stream_options={"include_usage": True}))  # fmt: skip
    got = streamed(chunks)
    assert (got["calls"], got["finish"]) == (calls, "tool_calls")
    assert got["content"] == (answer.message.content or "")
    assert got["reasoning"] == (thinking or "")
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [d.index for d in deltas] == list(range(len(calls)))  # one delta per call, whole
    assert reply.usage is not None
    assert got["usage"].completion_tokens == reply.usage.completion_tokens


# --- reasoning ------------------------------------------------------------------------------


def test_scripted_thinking_is_reasoning_content_never_content(
    start_daemon: DaemonFactory,
) -> None:
    script = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
    client, api = start(start_daemon)
    client.load(MODEL, name="thinker", env=scripted(script))
    ask: dict[str, Any] = {"model": "thinker", "messages": CHAT, "max_tokens": 200}
    reply = api.chat.completions.create(**ask, tools=TOOLS)
    (answer,) = reply.choices
    reasoning = extra(answer.message, "reasoning_content")
    assert (reasoning.strip(), (answer.message.content or "").strip()) == (THOUGHT, ANSWER)
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert reply.usage is not None and reply.usage.completion_tokens_details is not None
    # Every token of the script (each tag one), then the end token: the script was the output.
    script_tokens = tokenizer().encode(script, add_special_tokens=False)
    assert reply.usage.completion_tokens == len(script_tokens) + 1
    thought_tokens = reply.usage.completion_tokens_details.reasoning_tokens
    assert thought_tokens is not None
    assert len(tokenizer().encode(THOUGHT, add_special_tokens=False)) <= thought_tokens
    assert thought_tokens < reply.usage.completion_tokens - 5

    chunks = list(api.chat.completions.create(**ask, stream=True,
                                              stream_options={"include_usage": True}))  # fmt: skip
    got = streamed(chunks)
    assert (got["reasoning"], got["content"]) == (reasoning, answer.message.content)
    for chunk in chunks:  # no piece of the thought in a content delta, nor the reverse
        if chunk.choices and chunk.choices[0].delta.content:
            assert not set(chunk.choices[0].delta.content.split()) & set(THOUGHT.split())
    assert got["usage"].completion_tokens_details.reasoning_tokens == thought_tokens


def test_the_reasoning_budget_cuts_a_scripted_and_a_sampled_think_block(
    start_daemon: DaemonFactory,
) -> None:
    budget = 6
    long_thought = " ".join(["step"] * 40)
    client, api = start(start_daemon)
    client.load(
        MODEL, name="scripted", env=scripted(f"<think>\n{long_thought}\n</think>\n\n{ANSWER}")
    )
    # A prefix opens the block; then the random model thinks (it never closes it itself).
    client.load(MODEL, name="sampled", env=scripted("<think>\n", "script_prefix"))

    def ask(model: str, limit: int | None, **kwargs: Any) -> Any:
        body: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": True}}
        if limit is not None:
            body["max_reasoning_tokens"] = limit
        reply = api.chat.completions.create(model=model, messages=CHAT, extra_body=body, **kwargs)
        assert reply.usage is not None and reply.usage.completion_tokens_details is not None
        return reply, reply.usage.completion_tokens_details.reasoning_tokens

    # The script's thought, cut: the answer after its own </think> still comes.
    free, free_tokens = ask("scripted", None, max_tokens=200)
    assert free_tokens > budget + 20
    cut, cut_tokens = ask("scripted", budget, max_tokens=200)
    assert 0 < cut_tokens <= budget + 2
    assert (cut.choices[0].message.content or "").strip() == ANSWER
    thought = extra(cut.choices[0].message, "reasoning_content").strip()
    assert thought and long_thought.startswith(thought) and thought != long_thought

    # Real sampling, with thinking on: the random thought is cut at the budget.
    sample = {"max_tokens": 60, "temperature": 1.0, "seed": 5}
    free, free_tokens = ask("sampled", None, **sample)
    assert free_tokens == free.usage.completion_tokens > budget + 20  # it never ends its thought
    assert not free.choices[0].message.content
    cut, cut_tokens = ask("sampled", budget, **sample)
    assert 0 < cut_tokens <= budget + 2
    assert cut.usage.completion_tokens > cut_tokens + 2  # then it answers
    assert extra(cut.choices[0].message, "reasoning_content")


# --- broken calls ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("script", "stop"),
    [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None),  # never closed
        ("<tool_call>\nget_weather(city='Paris')\n</tool_call>", None),  # closed, not JSON
        # Closed broken, then a stop string ends the answer: the call was in it.
        ("<tool_call>\n{get_weather\n</tool_call>\nhello STOP more", ["STOP"]),
    ],
    ids=["unclosed", "not-json", "then-stop"],
)
def test_a_broken_tool_call_is_an_error_never_content(
    start_daemon: DaemonFactory, script: str, stop: list[str] | None
) -> None:
    client, api = start(start_daemon)
    client.load(MODEL, name="broken", env=scripted(f"Let me see.{script}"))
    ask: dict[str, Any] = {"model": "broken", "messages": CHAT, "max_tokens": 200, "tools": TOOLS,
                           "stop": stop}  # fmt: skip
    with pytest.raises(openai.InternalServerError, match="tool call that does not parse") as err:
        api.chat.completions.create(**ask)
    assert isinstance(err.value.body, dict) and err.value.body["code"] == "invalid_tool_call"
    assert "get_weather" in err.value.body["message"]
    with pytest.raises(openai.APIError, match="tool call that does not parse"):
        for chunk in api.chat.completions.create(**ask, stream=True):
            for choice in chunk.choices:  # what came before the call is content; the call is not
                assert "tool_call" not in (choice.delta.content or "")
                assert "get_weather" not in (choice.delta.content or "")


def test_a_tool_call_cut_by_max_tokens_ends_with_length(start_daemon: DaemonFactory) -> None:
    client, api = start(start_daemon)
    client.load(MODEL, name="caller", env=scripted(f"<tool_call>\n{CALL}\n</tool_call>"))
    reply = api.chat.completions.create(model="caller", messages=CHAT, max_tokens=6, tools=TOOLS)
    (answer,) = reply.choices
    assert answer.finish_reason == "length"
    assert not answer.message.content and not answer.message.tool_calls
    cut = extra(reply, "supervisor")["invalid_tool_call"]
    # The call's text as far as the model got, its tag and all.
    assert len(cut) > len("<tool_call>") and f"<tool_call>\n{CALL}".startswith(cut), cut
    # Streamed: the same end, and no delta carries the call's text.
    chunks = list(api.chat.completions.create(model="caller", messages=CHAT, max_tokens=6,
                                              tools=TOOLS, stream=True))  # fmt: skip
    got = streamed(chunks)
    assert (got["finish"], got["content"], got["calls"]) == ("length", "", [])
    assert extra(chunks[-1], "supervisor")["invalid_tool_call"] == cut


# --- a tool turn, and back --------------------------------------------------------------------


def test_a_call_its_tool_answer_and_the_next_answer(start_daemon: DaemonFactory) -> None:
    client, api = start(start_daemon)
    client.load(MODEL, name="caller", env=scripted(f"<tool_call>\n{CALL}\n</tool_call>"))
    client.load(MODEL, name="plain")
    first = api.chat.completions.create(model="caller", messages=CHAT, max_tokens=100, tools=TOOLS)
    (answer,) = first.choices
    assert answer.finish_reason == "tool_calls"
    assert calls_of(answer.message) == [("get_weather", {"city": "Paris", "days": 2})]
    (call,) = answer.message.tool_calls or []

    # The history as the client sends it back: the answer as it came, then the tool's.
    history = [
        *CHAT,
        answer.message.model_dump(exclude_none=True, exclude={"reasoning_content"}),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    free = api.chat.completions.create(model="plain", messages=history, max_tokens=8, tools=TOOLS)
    assert free.choices[0].finish_reason in ("stop", "length") and free.choices[0].message.content
    reply = api.chat.completions.create(model="caller", messages=history, max_tokens=100,
                                        tools=TOOLS)  # fmt: skip
    assert reply.choices[0].finish_reason == "tool_calls"  # a second call, as scripted
    assert calls_of(reply.choices[0].message) == calls_of(answer.message)
    assert reply.usage is not None and free.usage is not None
    assert reply.usage.prompt_tokens == free.usage.prompt_tokens  # one rendering on both

    # The runner's prompt is the template's rendering of that history, tool response and all.
    wrapper = tokenizer()
    turns = [
        *CHAT,
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": "get_weather",
                                      "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]  # fmt: skip
    expected = wrapper.apply_chat_template(turns, tools=TOOLS, add_generation_prompt=True)
    text = wrapper.decode(expected)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert '"name": "get_weather"' in text  # the call, as the template writes it back
    assert reply.usage.prompt_tokens == len(expected)
    assert first.usage is not None and reply.usage.prompt_tokens > first.usage.prompt_tokens


def test_the_builtins_tags_are_single_tokens_and_its_parser_json_tools() -> None:
    # What the tests above rely on: each tag is one token, the parser json_tools.
    wrapper = tokenizer()
    for tag in ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>"):
        assert len(wrapper.encode(tag, add_special_tokens=False)) == 1, tag
    assert wrapper.tool_parser.__module__ == "mlx_lm.tool_parsers.json_tools"

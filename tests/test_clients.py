"""The two clients, which must offer the same commands with the same options,
and the promise that the daemon side never imports mlx."""

from __future__ import annotations

import base64
import inspect
import json
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from conftest import DaemonFactory, faults, runner
from ipc.messages import ChatOptions, LoadProgress, SamplingParams
from supervisor.client import (
    AsyncClient,
    AsyncGeneration,
    Client,
    ClientError,
    Generation,
    commands,
)
from supervisor.daemon.process import DaemonProcess


def public_methods(cls: type) -> dict[str, inspect.Signature]:
    """The signatures of ``cls``'s public methods, its constructor included."""
    names = [n for n in dir(cls) if n == "__init__" or not n.startswith("_")]
    return {n: inspect.signature(getattr(cls, n)) for n in names if callable(getattr(cls, n))}


def test_both_clients_offer_the_same_methods_with_the_same_parameters() -> None:
    blocking, aio = public_methods(Client), public_methods(AsyncClient)
    assert blocking.keys() == aio.keys()
    for name, signature in blocking.items():
        # Names, kinds, defaults and annotations; only the return types differ.
        assert signature.parameters == aio[name].parameters, name


def test_every_command_is_a_method_of_both_clients_with_its_parameters() -> None:
    built = {
        name: inspect.signature(function)
        for name, function in inspect.getmembers(commands, inspect.isfunction)
        if function.__module__ == commands.__name__
        and str(inspect.signature(function).return_annotation).startswith(
            ("Call[", "GenerateRequest")
        )
    }
    assert {"status", "load", "unload", "shutdown", "clear_cache", "generate"} <= built.keys()
    for name, signature in built.items():
        for cls in (Client, AsyncClient):
            method = inspect.signature(getattr(cls(), name))  # bound: without self
            assert method.parameters == signature.parameters, (cls.__name__, name)
            assert getattr(cls, name).__doc__ == getattr(commands, name).__doc__


def test_async_client_loads_generates_and_unloads(daemon: DaemonProcess) -> None:
    async def main() -> tuple[str, str]:
        client = AsyncClient(daemon.socket_path)
        loaded = await client.load("builtin:tiny")
        pieces = [piece async for piece in client.generate("tiny", "Hi", max_tokens=12)]
        status = await client.status()
        assert [r.name for r in status.runners] == ["tiny"]
        with pytest.raises(ClientError) as excinfo:
            await client.unload("missing")
        assert excinfo.value.code == "unknown_model"
        await client.unload(loaded.name)
        return "".join(pieces), loaded.name

    text, name = anyio.run(main)
    assert name == "tiny"
    # Same text as the sync client gets (greedy, same daemon-side path).
    sync = Client(daemon.socket_path)
    sync.load("builtin:tiny")
    expected, _ = sync.generate_text("tiny", "Hi", max_tokens=12)
    assert text == expected


def test_async_generate_abandoned_midway_leaves_runner_ready(daemon: DaemonProcess) -> None:
    async def main() -> str:
        client = AsyncClient(daemon.socket_path)
        await client.load("builtin:tiny")
        stream = client.generate("tiny", "Hi", max_tokens=100_000)
        async for _ in stream:
            break
        await stream.aclose()
        pieces = [p async for p in client.generate("tiny", "Hi", max_tokens=4)]
        assert 1 <= len(pieces) <= 4  # the first token alone, the rest maybe coalesced
        return "".join(pieces)

    text = anyio.run(main)
    expected, done = Client(daemon.socket_path).generate_text("tiny", "Hi", max_tokens=4)
    assert text == expected and done.generation_tokens == 4


def test_async_load_takes_the_options_of_the_blocking_one(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    progress: list[LoadProgress] = []

    async def main() -> tuple[str, str]:
        client = AsyncClient(daemon.socket_path, timeout_s=60)
        await client.load(
            "builtin:tiny", max_concurrent=2, prefix_cache=False, on_progress=progress.append
        )
        with pytest.raises(ClientError) as excinfo:
            await client.load("builtin:tiny", "pair", hostfile=str(tmp_path / "none.json"))
        assert excinfo.value.code == "bad_request"
        assert "cannot read hostfile" in excinfo.value.message
        async with client.generate("tiny", "Hi", max_tokens=4) as gen:
            text = "".join([piece async for piece in gen])
        assert gen.done is not None and gen.done.generation_tokens == 4
        assert gen.ttft_s is not None and gen.tokens == 4
        again, _ = await client.generate_text("tiny", "Hi", max_tokens=4)
        assert again == text
        return text, (await client.clear_cache("tiny")).name

    text, cleared = anyio.run(main)
    assert progress and {p.name for p in progress} == {"tiny"}
    info = runner(Client(daemon.socket_path), "tiny")
    assert info.max_concurrent == 2 and info.prefix_cache is None
    assert cleared == "tiny"
    assert Client(daemon.socket_path).generate_text("tiny", "Hi", max_tokens=4)[0] == text


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
THOUGHT_AND_CALL = (
    "<think>\nThey ask for the weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def test_both_clients_keep_the_reasoning_tool_calls_and_logprobs(daemon: DaemonProcess) -> None:
    """The parts of an answer that are not its text reach a generation of
    either client: logprobs from builtin:tiny, and a thought and a tool call
    that builtin:tiny-qwen3-tools writes on cue (the ``script_text`` fault)."""
    client = Client(daemon.socket_path)
    client.load("builtin:tiny")
    script = base64.b64encode(THOUGHT_AND_CALL.encode()).decode()
    tools = client.load("builtin:tiny-qwen3-tools", env=faults(f"script_text={script}")).name
    sampling = SamplingParams(max_tokens=6, logprobs=True, top_logprobs=2)
    question = [{"role": "user", "content": "The weather in Paris?"}]
    options = ChatOptions(tools=[WEATHER])

    def check(logprobs: Generation | AsyncGeneration, calls: Generation | AsyncGeneration) -> None:
        assert logprobs.done is not None and logprobs.done.generation_tokens == 6
        assert len(logprobs.logprobs) == 6, "one entry per token"
        assert all(len(entry.top) == 2 for entry in logprobs.logprobs)
        assert not logprobs.reasoning and not logprobs.tool_calls
        assert calls.done is not None and calls.done.finish_reason == "tool_calls"
        # Both as the model wrote them, newlines included, as mlx_lm.server sends them.
        assert calls.reasoning == "\nThey ask for the weather.\n"
        assert [(c.name, json.loads(c.arguments)) for c in calls.tool_calls] == [
            ("get_weather", {"city": "Paris"})
        ]
        assert not calls.logprobs  # not asked for

    with client.generate("tiny", "Hi", sampling=sampling) as with_logprobs:
        "".join(with_logprobs)
    with client.generate(tools, messages=question, options=options) as with_calls:
        text = "".join(with_calls)
    assert text == "\n\n"  # what the model wrote between its thought and its call
    check(with_logprobs, with_calls)

    async def main() -> tuple[AsyncGeneration, AsyncGeneration]:
        aclient = AsyncClient(daemon.socket_path)
        async with aclient.generate("tiny", "Hi", sampling=sampling) as first:
            [piece async for piece in first]
        async with aclient.generate(tools, messages=question, options=options) as second:
            [piece async for piece in second]
        return first, second

    check(*anyio.run(main))


def test_both_clients_give_up_on_a_silent_runner_after_timeout_s(
    start_daemon: DaemonFactory,
) -> None:
    daemon = start_daemon("shutdown_grace_s = 0.5\n")  # the hung runner is unloaded quickly
    Client(daemon.socket_path).load("builtin:tiny", env=faults("hang_at_token=3"))

    async def main() -> str:
        client = AsyncClient(daemon.socket_path, timeout_s=0.5)
        with pytest.raises(ClientError) as excinfo:
            async for _ in client.generate("tiny", "Hi", max_tokens=50):
                pass
        return excinfo.value.code

    assert anyio.run(main) == "timeout"
    blocking = Client(daemon.socket_path, timeout_s=0.5)
    with pytest.raises(ClientError) as excinfo:
        blocking.generate_text("tiny", "Hi", max_tokens=50)
    assert excinfo.value.code == "timeout"
    Client(daemon.socket_path).unload("tiny")  # the hung runner dies of SIGTERM


def test_supervisor_side_never_imports_mlx() -> None:
    code = (
        "import sys\n"
        "import importlib, pkgutil, supervisor\n"
        "for m in pkgutil.walk_packages(supervisor.__path__, 'supervisor.'):\n"
        "    if not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'runner'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

"""The OpenAI-compatible HTTP front: a real daemon, real runners, the real
``openai`` client and raw HTTP (httpx). builtin:tiny writes gibberish, so the
tests check shapes, counts and behaviour, never the words."""

from __future__ import annotations

import base64
import functools
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast, get_args

import anyio
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from conftest import DaemonFactory, faults
from ipc.messages import ErrorCode, GenerateRequest, GenerationDone, TextChunk, ToolCall
from runner.builtin import ensure_builtin_model
from supervisor import __version__
from supervisor.client import Client
from supervisor.config import (
    HTTP_ENV,
    ConfigError,
    ModelConfig,
    SupervisorConfig,
    load_config,
    parse_listen,
    with_http_override,
)
from supervisor.daemon.process import DaemonProcess
from supervisor.fronts.http.completions import Completions
from supervisor.fronts.http.errors import ERROR_STATUS
from supervisor.fronts.http.requests import ApiKey
from supervisor.fronts.http.server import bind_tcp
from supervisor.metrics import Metrics
from supervisor.registry.registry import Registry

PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "Tell me a story."}]
ANY_PORT = {HTTP_ENV: "127.0.0.1:0"}


def start(start_daemon: DaemonFactory, config: str | None = None) -> tuple[DaemonProcess, str]:
    """A daemon with its HTTP front on a free port, and the front's base URL."""
    daemon = start_daemon(config, env=ANY_PORT)
    url = Client(daemon.socket_path).status().supervisor.http
    assert url is not None and url.startswith("http://127.0.0.1:")
    return daemon, url


def openai_client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def sse(response: httpx.Response) -> Iterator[str | dict[str, Any]]:
    """A stream's events: comments as ``": text"``, data as parsed JSON or ``"[DONE]"``."""
    for line in response.iter_lines():
        if line.startswith(":"):
            yield line
        elif line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)


def stream_events(url: str, path: str, body: dict[str, Any]) -> list[str | dict[str, Any]]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(sse(response))


def receive_once(body: bytes) -> Callable[[], Awaitable[dict[str, Any]]]:
    """An ASGI ``receive`` for a client that sends ``body`` whole, then
    neither sends nor leaves."""
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await anyio.Event().wait()
        raise AssertionError

    return receive


def metric(url: str, name: str, **labels: str) -> float:
    """The samples ``name`` of /metrics with these labels, parsed with
    prometheus_client's parser, summed over the labels not given (a request's
    front, say); 0 if absent."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# --- serving -------------------------------------------------------------------


def test_openai_client_lists_models_and_completes_chat_and_text(
    start_daemon: DaemonFactory,
) -> None:
    daemon, url = start(start_daemon, '[[models]]\nname = "other"\nmodel = "builtin:tiny"\n')
    Client(daemon.socket_path).load("builtin:tiny")
    api = openai_client(url)

    models = {model.id: model for model in api.models.list().data}
    assert set(models) == {"tiny", "other"}
    assert models["tiny"].object == "model" and models["tiny"].owned_by == "mlx-supervisor"
    ours = models["tiny"].model_extra or {}
    assert (ours["model"], ours["state"], ours["configured"]) == ("builtin:tiny", "ready", False)
    assert (models["other"].model_extra or {})["state"] == "not_loaded"
    # The context length, from the model's config.json (builtin:tiny's max_position_embeddings).
    tiny_config = json.loads((ensure_builtin_model("builtin:tiny") / "config.json").read_text())
    context = tiny_config["max_position_embeddings"]
    assert (ours["context_length"], ours["max_model_len"]) == (context, context)
    one = api.models.retrieve("other")
    assert one.id == "other" and (one.model_extra or {})["context_length"] == context

    chat = api.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8)  # type: ignore[arg-type]
    assert chat.object == "chat.completion" and chat.model == "tiny"
    (choice,) = chat.choices
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert chat.usage is not None and chat.usage.completion_tokens == 8
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 8 > 8
    # The same prompt again: its prefix comes from the runner's prefix cache.
    again = api.chat.completions.create(
        model="builtin:tiny",
        messages=CHAT,
        max_completion_tokens=8,  # type: ignore[arg-type]
    )
    assert again.choices[0].message.content == choice.message.content
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens > 0

    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me "},
                                          {"type": "text", "text": "a story."}]}]  # fmt: skip
    same = api.chat.completions.create(model="tiny", messages=parts, max_tokens=8)  # type: ignore[arg-type]
    assert same.choices[0].message.content == choice.message.content

    text = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=6)
    assert text.object == "text_completion" and text.choices[0].finish_reason == "length"
    assert text.usage is not None and text.usage.completion_tokens == 6

    chunks = list(api.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=8, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    ))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        choice.message.content
    )
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8

    streamed = list(api.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"

    # Raw: the stream ends with [DONE]; without include_usage there is no usage chunk.
    events = stream_events(url, "/v1/chat/completions",
                           {"model": "tiny", "messages": CHAT, "max_tokens": 4})  # fmt: skip
    assert events[-1] == "[DONE]"
    assert all(isinstance(e, dict) and e["choices"] for e in events[:-1])


def test_stop_string_cuts_the_text_with_finish_reason_stop(start_daemon: DaemonFactory) -> None:
    daemon, url = start(start_daemon)
    Client(daemon.socket_path).load("builtin:tiny")
    api = openai_client(url)
    full = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=40).choices[0].text
    # A stop string from the middle of the text, at its first appearance.
    middle = len(full) // 2
    stop = full[middle : middle + 4]
    cut = full.index(stop)
    assert stop.strip() and cut > 0, full
    stopped = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, stop=[stop])
    assert stopped.choices[0].text == full[:cut]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = list(api.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=40, stop=stop, stream=True
    ))  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == full[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_http_and_socket_clients_share_one_model_at_once(start_daemon: DaemonFactory) -> None:
    daemon, url = start(start_daemon)
    client = Client(daemon.socket_path)
    client.load("builtin:tiny")
    socket_tokens: list[int] = []

    def over_the_socket() -> None:
        _, done = client.generate_text("tiny", PROMPT, max_tokens=300)
        socket_tokens.append(done.generation_tokens)

    thread = threading.Thread(target=over_the_socket)
    thread.start()
    events = stream_events(url, "/v1/completions",
                           {"model": "tiny", "prompt": PROMPT, "max_tokens": 300,
                            "stream_options": {"include_usage": True}})  # fmt: skip
    thread.join(60)
    assert socket_tokens == [300]
    usage = events[-2]
    assert isinstance(usage, dict) and usage["usage"]["completion_tokens"] == 300
    assert metric(url, "mlx_supervisor_requests_total", model="tiny", outcome="ok") == 2
    assert metric(url, "mlx_supervisor_generated_tokens_total", model="tiny") == 600


# --- refusals ------------------------------------------------------------------


def test_bad_requests_get_openai_errors_and_the_daemon_serves_on(
    start_daemon: DaemonFactory,
) -> None:
    daemon, url = start(start_daemon, "max_frame_bytes = 65536\n")
    chat = f"{url}/v1/chat/completions"
    good = {"model": "tiny", "messages": CHAT}

    as_json = {"Content-Type": "application/json"}
    malformed = httpx.post(chat, content=b'{"model": "tiny", "messages": [', headers=as_json,
                           timeout=10)  # fmt: skip
    assert "invalid JSON" in error_of(malformed, 400)["message"]
    wrong_type = error_of(httpx.post(chat, json={**good, "max_tokens": "many"}, timeout=10), 400)
    assert wrong_type["param"] == "max_tokens" and wrong_type["code"] == "bad_request"
    missing = error_of(httpx.post(chat, json={"model": "tiny"}, timeout=10), 400)
    assert missing["param"] == "messages"
    assert error_of(httpx.post(chat, json={**good, "n": 2}, timeout=10), 400)["param"] == "n"
    five = error_of(httpx.post(chat, json={**good, "stop": list("abcde")}, timeout=10), 400)
    assert five["param"] == "stop"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert (
        "image_url"
        in error_of(httpx.post(chat, json={**good, "messages": image}, timeout=10), 400)["message"]
    )
    huge = httpx.post(chat, content=b" " * 70_000, headers=as_json, timeout=10)
    assert "max_frame_bytes" in error_of(huge, 413)["message"]
    assert error_of(httpx.get(f"{url}/v1/nothing", timeout=10), 404)["type"] == "not_found_error"
    error_of(httpx.get(chat, timeout=10), 405)

    # Unknown fields are ignored; an unknown model is a 404 from the openai client too.
    with pytest.raises(openai.NotFoundError, match="no model 'nope'"):
        openai_client(url).chat.completions.create(
            model="nope",
            messages=CHAT,
            logprobs=True,
            user="me",  # type: ignore[arg-type]
        )

    # A client that vanishes mid-body changes nothing either.
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as raw:
        raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                    b"Content-Type: application/json\r\n"
                    b"Content-Length: 1000\r\n\r\n{\"model\"")  # fmt: skip
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert daemon.process is not None and daemon.process.poll() is None
    assert Client(daemon.socket_path).status().runners == []
    assert metric(url, "mlx_supervisor_http_requests_total",
                  route="/v1/chat/completions", status="400") == 6  # fmt: skip


def test_api_key_is_required_when_configured_and_signals_still_work(
    start_daemon: DaemonFactory,
) -> None:
    daemon, url = start(start_daemon, 'api_key = "sekrit"\n')
    assert error_of(httpx.get(f"{url}/v1/models", timeout=10), 401)["code"] == "invalid_api_key"
    wrong = {"Authorization": "Bearer guess"}
    assert httpx.get(f"{url}/v1/models", headers=wrong, timeout=10).status_code == 401
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 401
    assert httpx.post(f"{url}/v1/completions", json={}, timeout=10).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai_client(url, "guess").models.list()
    assert openai_client(url, "sekrit").models.list().data == []
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # probes need no key

    # uvicorn took none of the daemon's signals: SIGHUP reloads the config, SIGINT stops it.
    daemon.process.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    daemon.wait_until(lambda: bool(daemon.events("config_reloaded")), timeout_s=10)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    daemon.process.send_signal(signal.SIGINT)  # type: ignore[union-attr]
    assert daemon.wait(30) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=10)


def test_a_full_queue_answers_429_with_retry_after(start_daemon: DaemonFactory) -> None:
    daemon, url = start(start_daemon, "max_queue = 0\n")
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", max_concurrent=1)
    with client.generate("tiny", PROMPT, max_tokens=100_000) as long_one:
        next(iter(long_one))
        response = httpx.post(f"{url}/v1/completions", timeout=10,
                              json={"model": "tiny", "prompt": PROMPT, "stream": True})  # fmt: skip
        assert error_of(response, 429)["code"] == "busy"
        assert response.headers["retry-after"] == "1"
        with pytest.raises(openai.RateLimitError):
            openai_client(url).completions.create(model="tiny", prompt=PROMPT)
        long_one.cancel()
        list(long_one)
    assert metric(url, "mlx_supervisor_requests_total", model="tiny", outcome="busy") == 2
    assert metric(url, "mlx_supervisor_requests_total", model="tiny", outcome="cancelled") == 1


# --- faults --------------------------------------------------------------------


def test_runner_deaths_end_requests_with_the_signal_then_503_while_restarting(
    start_daemon: DaemonFactory,
) -> None:
    config = (
        "restart_backoff_s = 60\nrestart_backoff_cap_s = 60\n"
        '[[models]]\nname = "broken"\nmodel = "builtin:tiny"\npreload = true\n'
        'env = { MLX_SUPERVISOR_FAULTS = "fail_load=weights unreadable" }\n'
    )
    daemon, url = start(start_daemon, config)
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", env=faults("crash_at_token=4:SIGKILL"))
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 50}

    def state(name: str) -> str:
        return next(r.state for r in client.status().runners if r.name == name)

    # Mid-stream: the stream has begun (200), so the error is its last event.
    events = stream_events(url, "/v1/completions", body)
    assert any(isinstance(e, dict) and e.get("choices") for e in events)
    last = events[-1]
    assert isinstance(last, dict) and last["error"]["code"] == "runner_died"
    assert "SIGKILL" in last["error"]["message"] and "[DONE]" not in events

    # Not streaming (the first restart is immediate): a 500 naming the signal.
    with pytest.raises(openai.InternalServerError, match="SIGKILL"):
        openai_client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=50)

    # The second restart waits out its backoff: 503 and when to come back.
    daemon.wait_until(lambda: state("tiny") == "restarting")
    restarting = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
    assert "tiny is restarting" in error_of(restarting, 503)["message"]
    assert 1 <= int(restarting.headers["retry-after"]) <= 60

    # A model whose load failed: 503 with the cause, without a wait.
    daemon.wait_until(lambda: state("broken") == "failed")
    failed = httpx.post(f"{url}/v1/completions", json={**body, "model": "broken"}, timeout=10)
    assert "weights unreadable" in error_of(failed, 503)["message"]
    assert metric(url, "mlx_supervisor_requests_total", model="tiny", outcome="runner_died") == 2


def test_client_leaving_mid_stream_cancels_the_generation_in_the_runner(
    start_daemon: DaemonFactory,
) -> None:
    daemon, url = start(start_daemon, "shutdown_grace_s = 1.5\n")
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", env=faults("ignore_shutdown"))

    def idle() -> bool:
        (runner,) = client.status().runners
        return runner.state == "ready" and runner.active_requests == 0

    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 100_000, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # held: dropping it would close the connection
        for _ in range(3):
            next(lines)
        assert not idle()
    left_at = time.monotonic()
    daemon.wait_until(idle, timeout_s=10)
    assert time.monotonic() - left_at < 5
    assert metric(url, "mlx_supervisor_requests_total", model="tiny", outcome="cancelled") == 1
    # Stopped soon after the disconnect, not at max_tokens (the 4096 cap). How
    # soon depends on the machine: tiny makes ~100 tokens in 0.2 s on a busy one.
    assert metric(url, "mlx_supervisor_generated_tokens_total", model="tiny") < 1000

    # Not streaming: a client that gives up waiting cancels it too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=1.0)
    daemon.wait_until(idle, timeout_s=10)
    assert metric(url, "mlx_supervisor_requests_total", model="tiny", outcome="cancelled") == 2

    # Shutting down (the runner makes it wait): /health says so with a 503.
    daemon.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    deadline = time.monotonic() + 1.5
    while httpx.get(f"{url}/health", timeout=10).status_code != 503:
        assert time.monotonic() < deadline, "health never said it was shutting down"
        time.sleep(0.05)
    assert httpx.get(f"{url}/health", timeout=10).text == "shutting down\n"
    assert daemon.wait(30) == 0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_a_client_gone_during_background_writes_ends_quietly() -> None:
    """A send that fails as it does once the client left (here anyio's
    BrokenResourceError, as from a memory-stream middleware) while a
    keep-alive comment is written: the request ends as one whose client is
    gone, with no http_request_failed and nothing raised.

    A component test: a real registry loads builtin:tiny on demand in a real
    runner, whose load progress becomes the comments; only the ASGI server is
    the test's, as uvicorn's send never raises once a client is gone (a
    middleware's may)."""
    config = SupervisorConfig(hot_spare=False, http_listen="off",
                              models=[ModelConfig(name="tiny", model="builtin:tiny")])  # fmt: skip
    sent: list[dict[str, Any]] = []
    states_when_sent: list[str] = []
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "stream": True}).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"content-type", b"application/json")], "query_string": b""}  # fmt: skip
    with capture_logs() as logs, anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            registry = Registry(config, tg)
            registry.start_background()

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)
                states_when_sent.append(registry.entries["tiny"].state)
                raise anyio.BrokenResourceError

            completions = Completions(registry, config, ApiKey(None))
            try:
                await completions.serve(scope, receive_once(body), send, completions.text)  # type: ignore[arg-type]
            finally:
                await registry.shutdown()
                tg.cancel_scope.cancel()
    assert not [r for r in logs if r["event"] == "http_request_failed"], logs
    assert len(sent) == 1  # the comment's head, then nothing: the client was gone
    assert states_when_sent[0] in ("starting", "loading")  # a comment: the model was loading


@pytest.mark.anyio
async def test_a_request_waits_for_a_stopped_model_until_the_registry_forgets_it() -> None:
    """A model whose runner has stopped but which the registry has not yet
    forgotten (its unload still has work to do after the stop) is waited for
    until the registry drops it, then loaded again: the front waits on the
    entry's ``forgotten`` event, not for a number of event-loop turns. A real
    registry passes through that state in one scheduling turn, so this one is
    a stand-in that holds it; the registry's side is real in
    test_a_request_for_a_stopping_model_waits_and_loads_it_again."""
    spec = SimpleNamespace(max_tokens=None)
    stopping = SimpleNamespace(name="tiny", state="stopping", spec=spec, failure=None,
                               last_exit=None, stopped=anyio.Event(),
                               forgotten=anyio.Event())  # fmt: skip
    stopping.stopped.set()
    again = SimpleNamespace(name="tiny", state="ready", spec=spec, max_tokens_cap=None)
    sent: list[dict[str, Any]] = []

    class UnloadingRegistry:
        closing = False
        metrics = Metrics()
        entries: dict[str, Any] = {"tiny": stopping}  # noqa: RUF012

        async def ensure_loaded(self, ref: str, on_progress: Any) -> Any:
            return self.entries.get(ref, again)

        async def generate(self, request: GenerateRequest, emit: Any, cancel: anyio.Event,
                           on_queued: Any = None, *, front: str = "socket") -> None:  # fmt: skip
            assert request.name == "tiny"
            await emit(TextChunk(request_id=1, text="hi", generation_tokens=1), None)
            done = GenerationDone(request_id=1, prompt_tokens=2, generation_tokens=1,
                                  prompt_tps=1.0, generation_tps=1.0, ttft_s=0.1,
                                  peak_memory_bytes=0, finish_reason="length")  # fmt: skip
            await emit(done, None)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 1}).encode()
    registry = UnloadingRegistry()
    completions = Completions(cast(Registry, registry), SupervisorConfig(), ApiKey(None))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"content-type", b"application/json")], "query_string": b""}  # fmt: skip
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(completions.serve, scope, receive_once(body), send,
                                            completions.text))  # type: ignore[arg-type]  # fmt: skip
            await anyio.wait_all_tasks_blocked()  # the request waits for the stopping model
            del registry.entries["tiny"]  # the unload's last step: forget it
            stopping.forgotten.set()
    assert sent[0]["type"] == "http.response.start"
    assert sent[0]["status"] == 200, sent
    assert json.loads(sent[1]["body"])["choices"][0]["text"] == "hi"


# --- load on demand, health, metrics -------------------------------------------------


def test_configured_model_loads_on_demand_with_keep_alive_comments(
    start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon, url = start(start_daemon, '[[models]]\nname = "tiny"\nmodel = "builtin:tiny"\n')
    client = Client(daemon.socket_path)
    assert (
        httpx.get(f"{url}/health", timeout=10).text
        == f"ok: mlx-supervisor {__version__}, 0 models\n"
    )

    unconfigured = httpx.post(f"{url}/v1/completions", timeout=10,
                              json={"model": str(tmp_path), "prompt": PROMPT})  # fmt: skip
    assert 'load_on_demand = "any"' in error_of(unconfigured, 404)["message"]
    assert client.status().runners == []

    body = {"model": "builtin:tiny", "messages": CHAT, "max_tokens": 5}
    events = stream_events(url, "/v1/chat/completions", body)
    first_data = next(i for i, e in enumerate(events) if isinstance(e, dict))
    assert any(str(e).startswith(": loading tiny") for e in events[:first_data])
    assert all(isinstance(e, dict) or e == "[DONE]" for e in events[first_data:])
    assert events[-1] == "[DONE]"
    (runner,) = client.status().runners
    assert (runner.name, runner.state) == ("tiny", "ready")
    assert "1 ready" in httpx.get(f"{url}/health", timeout=10).text

    names = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    states = {s.labels["state"]: s.value for s in names["mlx_supervisor_model_state"].samples}
    assert states["ready"] == 1 and sum(states.values()) == 1
    assert next(iter(names["mlx_supervisor_uptime_seconds"].samples)).value > 0
    ttft = names["mlx_supervisor_time_to_first_token_seconds"].samples
    assert any(s.name.endswith("_count") and s.value == 1 for s in ttft)
    assert any(s.value > 0 for s in names["mlx_supervisor_runner_rss_bytes"].samples)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
A_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_an_answer_of_tool_calls_counts_as_ok_and_has_a_first_token_time(
    start_daemon: DaemonFactory,
) -> None:
    """builtin:tiny-qwen3-tools writes a call and nothing else (the
    ``script_text`` fault): a whole answer, with no text in it."""
    daemon, url = start(start_daemon)
    script = base64.b64encode(A_CALL.encode()).decode()
    name = (
        Client(daemon.socket_path)
        .load("builtin:tiny-qwen3-tools", env=faults(f"script_text={script}"))
        .name
    )
    api = openai_client(url)
    answer = api.chat.completions.create(model=name, messages=CHAT, tools=[WEATHER])
    assert answer.choices[0].finish_reason == "tool_calls" and not answer.choices[0].message.content
    assert metric(url, "mlx_supervisor_requests_total", model=name, outcome="ok") == 1
    assert metric(url, "mlx_supervisor_requests_total", model=name, outcome="tool_calls") == 0
    assert metric(url, "mlx_supervisor_time_to_first_token_seconds_count", model=name) == 1


def test_a_generation_cut_at_its_first_tool_call_counts_as_ok() -> None:
    """parallel_tool_calls false: the front cancels the generation at its
    first call, and the runner ends it "cancelled"; the answer was whole.
    A client that leaves before any call is still a cancel."""
    metrics = Metrics()
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    ended = GenerationDone(request_id=1, prompt_tokens=2, generation_tokens=9, prompt_tps=1.0,
                           generation_tps=1.0, ttft_s=0.1, peak_memory_bytes=0,
                           finish_reason="cancelled")  # fmt: skip
    cut = metrics.request("tiny", "openai")
    cut.observe(TextChunk(request_id=1, text="", generation_tokens=8, tool_calls=[call]))
    cut.observe(ended)
    left = metrics.request("tiny", "openai")
    left.observe(TextChunk(request_id=1, text="", generation_tokens=8, reasoning="Hmm"))
    left.observe(ended)

    def sample(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(
            f"mlx_supervisor_{name}", {"model": "tiny", **labels}
        )

    ok = sample("requests_total", front="openai", outcome="ok")
    assert ok == sample("requests_total", front="openai", outcome="cancelled") == 1
    assert sample("time_to_first_token_seconds_count") == 2  # a call, a thought: first outputs


def test_a_request_for_a_stopping_model_waits_and_loads_it_again(
    start_daemon: DaemonFactory,
) -> None:
    """A model whose runner is stopping, and which the registry has not yet
    forgotten, is waited for until the registry drops it, then loaded
    again: the front waits on the entry's ``forgotten`` event, not for a
    number of event-loop turns (the stop here takes 1.5 s)."""
    # The runner ignores its Shutdown message: an unload takes shutdown_grace_s.
    config = ('shutdown_grace_s = 1.5\n[[models]]\nname = "tiny"\nmodel = "builtin:tiny"\n'
              'env = { MLX_SUPERVISOR_FAULTS = "ignore_shutdown" }\n')  # fmt: skip
    daemon, url = start(start_daemon, config)
    client = Client(daemon.socket_path)
    api = openai_client(url)
    before = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)  # loaded on demand
    (first,) = client.status().runners

    unloaded: list[object] = []
    unloading = threading.Thread(
        target=lambda: unloaded.append(Client(daemon.socket_path).unload("tiny"))
    )
    unloading.start()
    try:
        daemon.wait_until(lambda: [r.state for r in client.status().runners] == ["stopping"])
        # Not a 503: it waits for the stop to end, then loads the model again.
        reply = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
        assert reply.usage is not None and reply.usage.completion_tokens == 3
        assert reply.choices[0].text == before.choices[0].text  # the model's own answer, whole
    finally:
        unloading.join(30)
    assert len(unloaded) == 1
    (again,) = client.status().runners
    assert again.state == "ready" and again.pid != first.pid


# --- the listening address -----------------------------------------------------------


def test_port_in_use_is_logged_and_the_socket_serves_on(start_daemon: DaemonFactory) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        daemon = start_daemon(env={HTTP_ENV: f"127.0.0.1:{port}"})
        assert Client(daemon.socket_path).status().supervisor.http is None
        (failure,) = daemon.events("http_listen_failed")
        assert failure["port"] == port and "in use" in str(failure["error"])


def read_response(sock: socket.socket) -> bytes:
    """One HTTP response with a Content-Length, read off a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))  # fmt: skip
    while len(body) < length:
        chunk = sock.recv(4096)
        assert chunk, "closed mid-body"
        body += chunk
    return head + b"\r\n\r\n" + body


def assert_closed_by_server(sock: socket.socket) -> None:
    """The server closed ``sock``: a read sees EOF (within the socket's timeout)."""
    assert sock.recv(4096) == b""


def test_idle_connections_are_closed_and_cannot_shut_out_others(
    start_daemon: DaemonFactory,
) -> None:
    daemon, url = start(start_daemon, "max_connections = 4\nclient_idle_timeout_s = 1\n")
    address = ("127.0.0.1", int(url.rsplit(":", 1)[1]))
    opened = time.monotonic()
    # More connections than max_connections that never send a whole request head.
    idle = [socket.create_connection(address, timeout=10) for _ in range(6)]
    try:
        idle[0].sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")  # half a head
        deadline = time.monotonic() + 15
        while True:  # 503 while the idle ones fill max_connections, until they are closed
            answer = httpx.get(f"{url}/health", timeout=10)
            if answer.status_code == 200:
                break
            assert answer.status_code == 503, answer.text
            assert time.monotonic() < deadline, "idle connections shut the front out"
            time.sleep(0.05)
        for sock in idle:
            assert_closed_by_server(sock)
        assert time.monotonic() - opened >= 0.9  # a deadline, not an instant close

        # A served connection that then sends half of its next head.
        slow = socket.create_connection(address, timeout=10)
        idle.append(slow)
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert read_response(slow).startswith(b"HTTP/1.1 200")
        slow.sendall(b"GET /health HTTP/1.1\r\n")  # keep-alive, then half a head
        assert_closed_by_server(slow)  # uvicorn's keep-alive timer stops at the first byte

        # A whole head, then a body that never comes: the body's own deadline (408).
        with socket.create_connection(address, timeout=10) as body_late:
            body_late.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                              b"Content-Type: application/json\r\n"
                              b"Content-Length: 100\r\n\r\n")  # fmt: skip
            assert read_response(body_late).startswith(b"HTTP/1.1 408")
    finally:
        for sock in idle:
            sock.close()
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert daemon.process is not None and daemon.process.poll() is None


def test_address_reuse_is_asked_for_only_on_linux(monkeypatch: pytest.MonkeyPatch) -> None:
    """SO_REUSEADDR on Linux lets a port in TIME_WAIT be taken again; on macOS
    and the BSDs it would let us bind 127.0.0.1:P while another socket holds
    *:P, hiding a port in use."""
    for platform, reused in (("linux", True), ("darwin", False), ("freebsd14", False)):
        monkeypatch.setattr(sys, "platform", platform)
        with anyio.run(bind_tcp, "127.0.0.1", 0, 8) as sock:
            assert bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)) is reused


def test_serve_refuses_a_bad_http_address(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "supervisor", "serve", "--http", "localhost",
         "--socket", str(tmp_path / "s.sock")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert "--http: 'localhost' is not 'off' nor HOST:PORT" in result.stderr


def test_listen_addresses_and_http_keys_are_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert parse_listen("off") is None
    assert parse_listen("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_listen("[::1]:11480") == ("::1", 11480)
    assert parse_listen("localhost:8081") == ("localhost", 8081)
    for bad in ("", "11480", "::1:80", "[nope]:1", "host:65536", "host:-1", "host:"):
        with pytest.raises(ValueError):
            parse_listen(bad)
    path = tmp_path / "c.toml"
    for text, named in (('http_listen = "nowhere"\n', "http_listen"),
                        ('load_on_demand = "some"\n', "load_on_demand"),
                        ('api_key = ""\n', "api_key")):  # fmt: skip
        path.write_text(text)
        with pytest.raises(ConfigError, match=named):
            load_config(path)
    config = load_config(None)
    assert config.http_listen == "127.0.0.1:11480" and config.load_on_demand is True
    monkeypatch.setenv(HTTP_ENV, "127.0.0.1:9")
    assert with_http_override(config, None).http_listen == "127.0.0.1:9"
    assert with_http_override(config, "off").http_listen == "off"  # the flag wins
    monkeypatch.setenv(HTTP_ENV, "bogus")
    with pytest.raises(ConfigError, match=HTTP_ENV):
        with_http_override(config, None)


def test_every_error_code_has_an_http_status() -> None:
    assert set(ERROR_STATUS) == set(get_args(ErrorCode))


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first run fetches builtin:smollm2 (93 MB)
def test_a_real_model_answers_through_the_openai_client(
    start_daemon: DaemonFactory, smollm2_dir: Path
) -> None:
    config = '[[models]]\nname = "smol"\nmodel = "builtin:smollm2"\n'
    _, url = start(start_daemon, config)  # loaded on demand, by its reference
    reply = openai_client(url).chat.completions.create(
        model="builtin:smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
    )
    choice = reply.choices[0]
    assert choice.message.content is not None and "Paris" in choice.message.content
    assert choice.finish_reason == "stop" and reply.model in ("smol", "builtin:smollm2")

"""Every API of the HTTP front on real daemons and real runners, through the
real, unmodified clients: a real model answers the same greedy question the
same way through each (OpenAI's chat completions, Anthropic's Messages,
OpenAI's Responses, Ollama's chat and generate), and a client that leaves
mid-stream cancels its generation in the runner, whichever API it spoke.

The shapes of each API, against scripted runner frames, are in
test_http_anthropic.py, test_http_responses.py and test_http_ollama.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import DaemonFactory
from supervisor.client import Client
from supervisor.config import HTTP_ENV
from supervisor.daemon.process import DaemonProcess

QUESTION = "What is the capital of France?"
STORY = "Tell me a long story about a lighthouse keeper."


def start(start_daemon: DaemonFactory, config: str) -> tuple[DaemonProcess, Client, str]:
    """A daemon with its HTTP front on a free port: the daemon, its client and base URL."""
    daemon = start_daemon(config, env={HTTP_ENV: "127.0.0.1:0"})
    client = Client(daemon.socket_path)
    url = client.status().supervisor.http
    assert url is not None
    return daemon, client, url


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


def clients(url: str) -> tuple[openai.OpenAI, anthropic.Anthropic, ollama.Client]:
    return (
        openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120),
        anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120),
        ollama.Client(host=url, timeout=120),
    )


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first run fetches builtin:smollm2 (93 MB)
def test_a_real_model_answers_paris_through_every_front(
    start_daemon: DaemonFactory, smollm2_dir: Path
) -> None:
    _, _, url = start(start_daemon, '[[models]]\nname = "smol"\nmodel = "builtin:smollm2"\n')
    chat_api, messages_api, ollama_api = clients(url)
    user = [{"role": "user", "content": QUESTION}]
    answers: dict[str, str] = {}

    chat = chat_api.chat.completions.create(model="smol", messages=user, max_tokens=24)
    answers["openai chat"] = chat.choices[0].message.content or ""

    message = messages_api.messages.create(model="smol", messages=user, max_tokens=24)
    answers["anthropic"] = "".join(b.text for b in message.content if b.type == "text")
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) > 0

    response = chat_api.responses.create(model="smol", input=QUESTION, max_output_tokens=24)
    answers["responses"] = response.output_text

    ollama_chat = ollama_api.chat(model="smol", messages=user, options={"num_predict": 24})
    answers["ollama chat"] = ollama_chat.message.content or ""
    generated = ollama_api.generate(model="smol", prompt=QUESTION, options={"num_predict": 24})
    answers["ollama generate"] = generated.response

    for front, text in answers.items():
        assert "Paris" in text, f"{front}: {text!r}"
    # Greedy, the same chat template: one answer, whichever API asked.
    assert len(set(answers.values())) == 1, answers


def stream_openai_chat(url: str) -> Iterator[Any]:
    api = clients(url)[0]
    with api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": STORY}], max_tokens=100_000,
        stream=True,
    ) as stream:  # fmt: skip
        yield from stream


def stream_anthropic(url: str) -> Iterator[Any]:
    api = clients(url)[1]
    with api.messages.stream(
        model="tiny", messages=[{"role": "user", "content": STORY}], max_tokens=100_000
    ) as stream:
        yield from stream.text_stream


def stream_responses(url: str) -> Iterator[Any]:
    api = clients(url)[0]
    with api.responses.create(
        model="tiny", input=STORY, max_output_tokens=100_000, stream=True
    ) as stream:
        yield from stream


def stream_ollama_chat(url: str) -> Iterator[Any]:
    api = clients(url)[2]
    yield from api.chat(
        model="tiny", messages=[{"role": "user", "content": STORY}], stream=True,
        options={"num_predict": 100_000},
    )  # fmt: skip


def stream_ollama_generate(url: str) -> Iterator[Any]:
    api = clients(url)[2]
    yield from api.generate(
        model="tiny", prompt=STORY, stream=True, options={"num_predict": 100_000}
    )


STREAMS: dict[str, Callable[[str], Iterator[Any]]] = {
    "openai chat": stream_openai_chat,
    "anthropic": stream_anthropic,
    "responses": stream_responses,
    "ollama chat": stream_ollama_chat,
    "ollama generate": stream_ollama_generate,
}


def test_a_client_leaving_mid_stream_cancels_the_generation_on_every_front(
    start_daemon: DaemonFactory,
) -> None:
    """Each real client reads a few events of a stream that would run to the
    model's cap, then closes it: the runner is idle again soon after, the
    request counted as cancelled, long before the cap's tokens."""
    daemon, client, url = start(start_daemon, "")
    client.load("builtin:tiny")

    def idle() -> bool:
        (runner,) = client.status().runners
        return runner.state == "ready" and runner.active_requests == 0

    for count, (front, stream) in enumerate(STREAMS.items(), start=1):
        events = stream(url)
        for _ in range(3):
            next(events)
        assert not idle(), f"{front}: the runner is not generating"
        events.close()  # the client's with-block ends: the connection closes
        daemon.wait_until(idle, timeout_s=10)
        cancelled = metric(url, "mlx_supervisor_requests_total", model="tiny", outcome="cancelled")
        assert cancelled == count, f"{front}: {cancelled} cancelled requests, not {count}"
    # Each stopped soon after its client left, not at the cap (4096 tokens each).
    assert metric(url, "mlx_supervisor_generated_tokens_total", model="tiny") < 1000 * len(STREAMS)

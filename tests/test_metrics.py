"""Per-model metrics in ``GET /metrics``, scraped from a live daemon and parsed
with prometheus_client's own parser: requests through the socket and every
HTTP API (one cancelled on each side), a runner SIGKILLed and restarted, a
model evicted and one refused; the counters must equal what was done, the
histograms' counts what was served, and every family must follow
Prometheus' naming conventions. builtin:tiny writes gibberish, so the tests
check counts, never the words."""

from __future__ import annotations

import json
import os
import signal
from typing import get_args

import anthropic
import httpx
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from conftest import DaemonFactory, runner
from ipc.messages import CauseClass, GenerationDone
from supervisor.client import Client, ClientError
from supervisor.config import HTTP_ENV
from supervisor.daemon.process import DaemonProcess
from supervisor.metrics import DEATH_CLASSES

PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "Tell me a story."}]
M = "mlx_supervisor_"

# Every family the issue asks for, by the name its samples carry, with the
# model label: time to first token and between tokens, tokens, requests by
# outcome and front, queue, memory, restarts and deaths, prefix cache, refusals
# and evictions.
PER_MODEL = (
    "time_to_first_token_seconds_count",
    "inter_token_latency_seconds_count",
    "prompt_tokens_total",
    "cached_prompt_tokens_total",
    "generated_tokens_total",
    "requests_total",
    "model_queue_depth",
    "runner_rss_bytes",
    "mlx_active_bytes",
    "mlx_peak_bytes",
    "memory_budget_bytes",
    "model_restarts_total",
    "runner_deaths_total",
    "prefix_cache_lookups_total",
    "prefix_cache_hits_total",
    "prefix_cache_bytes",
    "prefix_cache_disk_bytes",
    "model_admission_refusals_total",
    "model_evictions_total",
)

# Families whose figure is a count or a state, with no unit to name.
UNITLESS = frozenset(
    M + name
    for name in (
        "requests", "prompt_tokens", "cached_prompt_tokens", "generated_tokens", "http_requests",
        "model_state", "model_restarts", "model_queue_depth", "model_active_requests",
        "runner_deaths", "model_evictions", "model_admission_refusals", "events",
        "prefix_cache_lookups", "prefix_cache_hits", "prefix_cache_evictions",
        "prefix_cache_entries", "prefix_cache_disk_hits",
    )
)  # fmt: skip
BASE_UNITS = ("_seconds", "_bytes")
NOT_BASE_UNITS = ("_milliseconds", "_ms", "_kb", "_mb", "_gb", "_kib", "_mib", "_percent", "_us")


def start(start_daemon: DaemonFactory, config: str | None = None) -> tuple[DaemonProcess, str]:
    """A daemon with its HTTP front on a free port, and the front's base URL."""
    daemon = start_daemon(config, env={HTTP_ENV: "127.0.0.1:0"})
    url = Client(daemon.socket_path).status().supervisor.http
    assert url is not None
    return daemon, url


class Scrape:
    """One ``GET /metrics``, parsed."""

    def __init__(self, url: str) -> None:
        response = httpx.get(f"{url}/metrics", timeout=10)
        assert response.status_code == 200, response.text
        self.text = response.text
        self.families = list(text_string_to_metric_families(self.text))
        self.samples = [sample for family in self.families for sample in family.samples]

    def matching(self, name: str, **labels: str) -> list[Sample]:
        return [
            s
            for s in self.samples
            if s.name == M + name and all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples ``name`` with these labels (0 if none)."""
        return sum(float(s.value) for s in self.matching(name, **labels))


def socket_request(
    client: Client, max_tokens: int, cancel: bool = False
) -> tuple[int, GenerationDone]:
    """One generation through the socket: the tokens its first frame brought,
    and its end (``cancel``: cancelled after that first frame)."""
    with client.generate("tiny", PROMPT, max_tokens=max_tokens) as gen:
        next(gen)
        assert gen.chunk is not None
        first = gen.chunk.generation_tokens
        if cancel:
            gen.cancel()
        list(gen)
    assert gen.done is not None
    return first, gen.done


def test_requests_tokens_and_latencies_count_per_model_and_front(
    start_daemon: DaemonFactory,
) -> None:
    daemon, url = start(start_daemon)
    client = Client(daemon.socket_path)
    client.load("builtin:tiny")

    # The socket: two answers (the second's prompt comes from the prefix
    # cache), and one cancelled after its first frame.
    served = [socket_request(client, 24), socket_request(client, 24)]
    cancelled = socket_request(client, 100_000, cancel=True)
    assert [done.finish_reason for _, done in served] != ["cancelled"] * 2
    assert cancelled[1].finish_reason == "cancelled"
    dones = [done for _, done in [*served, cancelled]]
    first = Scrape(url)
    assert first.value("requests_total", model="tiny", front="socket", outcome="ok") == 2
    assert first.value("requests_total", model="tiny", front="socket", outcome="cancelled") == 1
    assert first.value("requests_total", model="tiny") == 3
    assert first.value("prompt_tokens_total", model="tiny") == sum(d.prompt_tokens for d in dones)
    assert first.value("cached_prompt_tokens_total", model="tiny") == sum(
        d.cached_tokens for d in dones
    )
    assert dones[1].cached_tokens > 0  # the same prompt again: the cache gave some of it
    generated = sum(d.generation_tokens for d in dones)
    assert first.value("generated_tokens_total", model="tiny") == generated
    assert first.value("time_to_first_token_seconds_count", model="tiny") == 3
    # One gap per token after each request's first frame.
    after_first = sum(done.generation_tokens - tokens for tokens, done in [*served, cancelled])
    assert after_first > 0
    assert first.value("inter_token_latency_seconds_count", model="tiny") == after_first
    assert first.value("inter_token_latency_seconds_sum", model="tiny") > 0

    # Every HTTP API, once each, and OpenAI's text completion streamed.
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    chat = api.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8)
    streamed = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, stream=True,
                                      stream_options={"include_usage": True})  # fmt: skip
    usages = [chunk.usage for chunk in streamed if chunk.usage is not None]
    response = api.responses.create(model="tiny", input=PROMPT, max_output_tokens=8)
    message = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0).messages.create(
        model="tiny", max_tokens=8, messages=CHAT
    )
    ollama_chat = ollama.Client(host=url).chat(
        model="tiny", messages=CHAT, options={"num_predict": 8}
    )
    assert chat.usage is not None and len(usages) == 1 and response.usage is not None
    http_generated = (
        chat.usage.completion_tokens + usages[0].completion_tokens
        + response.usage.output_tokens + message.usage.output_tokens
        + (ollama_chat.eval_count or 0)
    )  # fmt: skip
    second = Scrape(url)
    for front, count in (("openai", 2), ("responses", 1), ("anthropic", 1), ("ollama", 1)):
        assert second.value("requests_total", model="tiny", front=front, outcome="ok") == count
        assert second.value("requests_total", model="tiny", front=front) == count
    assert second.value("requests_total", model="tiny", front="socket") == 3
    assert second.value("generated_tokens_total", model="tiny") == generated + http_generated
    assert (
        second.value("prompt_tokens_total", model="tiny")
        - first.value("prompt_tokens_total", model="tiny")
        >= chat.usage.prompt_tokens + usages[0].prompt_tokens
    )
    assert second.value("time_to_first_token_seconds_count", model="tiny") == 3 + 5
    assert (
        after_first
        <= second.value("inter_token_latency_seconds_count", model="tiny")
        <= (after_first + http_generated - 5)
    )
    # A histogram's buckets are cumulative: the +Inf one is the count.
    (inf,) = second.matching("inter_token_latency_seconds_bucket", model="tiny", le="+Inf")
    assert inf.value == second.value("inter_token_latency_seconds_count", model="tiny")

    # An HTTP client that leaves mid-stream: cancelled, under its front.
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 100_000, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get(
                "content"
            ):
                break  # the first words came: leave
    cancelled_labels = {"model": "tiny", "front": "openai", "outcome": "cancelled"}
    daemon.wait_until(lambda: Scrape(url).value("requests_total", **cancelled_labels) == 1)
    assert Scrape(url).value("requests_total", model="tiny", front="openai") == 3

    # The gauges and the prefix cache, as the status has them.
    daemon.wait_until(
        lambda: (cache := runner(client, "tiny").prefix_cache) is not None and cache.hits > 0
    )
    scrape = Scrape(url)
    info = runner(client, "tiny")
    stats = info.prefix_cache
    assert stats is not None and stats.disk is not None
    for name in PER_MODEL:
        assert scrape.matching(name, model="tiny"), f"no {M}{name} for tiny"
    assert scrape.value("prefix_cache_lookups_total", model="tiny") == stats.hits + stats.misses
    assert scrape.value("prefix_cache_hits_total", model="tiny") == stats.hits > 0
    assert scrape.value("prefix_cache_bytes", model="tiny") == stats.bytes > 0
    assert scrape.value("prefix_cache_disk_bytes", model="tiny") == stats.disk.bytes
    assert scrape.value("model_queue_depth", model="tiny") == 0
    assert scrape.value("runner_rss_bytes", model="tiny") > 0
    assert scrape.value("memory_budget_bytes", model="tiny") == info.memory_budget_bytes
    assert scrape.value("runner_deaths_total", model="tiny") == 0
    assert {s.labels["cause_class"] for s in scrape.matching("runner_deaths_total")} == set(
        DEATH_CLASSES
    )
    check_conventions(scrape)


def test_a_killed_runner_counts_a_death_of_its_class_and_a_restart(
    start_daemon: DaemonFactory,
) -> None:
    daemon, url = start(start_daemon)
    client = Client(daemon.socket_path)
    loaded = client.load("builtin:tiny")
    os.kill(loaded.pid, signal.SIGKILL)

    def restarted() -> bool:
        info = runner(client, "tiny")
        return info.state == "ready" and info.pid not in (None, loaded.pid)

    daemon.wait_until(restarted)
    info = runner(client, "tiny")
    assert info.restarts == 1
    assert info.last_exit is not None and info.last_exit.signal == "SIGKILL"
    cause_class = info.last_exit.cause_class  # unknown, or oom_killed under memory pressure
    assert cause_class in get_args(CauseClass)

    scrape = Scrape(url)
    assert scrape.value("runner_deaths_total", model="tiny", cause_class=cause_class) == 1
    assert scrape.value("runner_deaths_total", model="tiny") == 1  # no other class
    assert scrape.value("model_restarts_total", model="tiny") == 1
    assert scrape.value("events_total", event=f"deaths_{cause_class}") == 1
    # It serves again, and its requests count on.
    client.generate_text("tiny", PROMPT, max_tokens=4)
    assert Scrape(url).value("requests_total", model="tiny", front="socket", outcome="ok") == 1


def test_evictions_and_admission_refusals_count_per_model(start_daemon: DaemonFactory) -> None:
    """max_loaded_models = 1: loading ``pinned`` evicts ``idle``; loading
    ``refused`` then finds nothing it may unload. The evicted model and the
    refused one are gone from status, and their counts stay."""
    daemon, url = start(start_daemon, "max_loaded_models = 1\n")
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", "idle")
    client.load("builtin:tiny", "pinned", pinned=True)
    with pytest.raises(ClientError) as refused:
        client.load("builtin:tiny", "refused")
    assert refused.value.code == "insufficient_memory"
    assert [r.name for r in client.status().runners] == ["pinned"]

    scrape = Scrape(url)
    assert scrape.value("model_evictions_total", model="idle") == 1
    assert scrape.value("model_evictions_total", model="pinned") == 0
    assert scrape.value("model_evictions_total", model="refused") == 0
    assert scrape.value("model_admission_refusals_total", model="refused") == 1
    assert scrape.value("model_admission_refusals_total", model="idle") == 0
    assert scrape.value("model_admission_refusals_total", model="pinned") == 0
    assert scrape.value("events_total", event="evicted") == 1
    assert scrape.value("events_total", event="admission_refused") == 1
    assert scrape.value("runner_deaths_total") == 0  # an eviction is no death
    check_conventions(scrape)


def check_conventions(scrape: Scrape) -> None:
    """Prometheus' naming conventions, on every family of a scrape: our
    prefix; one family per name; counters' samples end in ``_total`` (and
    no name carries it twice); base units in the name where there is a
    unit; histograms whole (buckets up to +Inf equal to the count)."""
    names = [family.name for family in scrape.families]
    assert len(names) == len(set(names)), "a family twice"
    assert "_created" not in scrape.text
    for family in scrape.families:
        name = family.name
        assert name.startswith(M), name
        assert not name.endswith("_total"), f"{name}: _total is a counter's sample suffix"
        assert not any("_total_total" in s.name for s in family.samples), name
        assert not any(unit in name for unit in NOT_BASE_UNITS), f"{name}: not a base unit"
        assert name.endswith(BASE_UNITS) or name in UNITLESS, f"{name}: unit not named"
        if family.type == "counter":
            assert all(s.name == f"{name}_total" for s in family.samples), family.samples
        elif family.type == "gauge":
            assert all(s.name == name for s in family.samples), family.samples
        elif family.type == "histogram":
            assert name.endswith("_seconds"), name
            counts = {frozenset(s.labels.items()): s.value
                      for s in family.samples if s.name == f"{name}_count"}  # fmt: skip
            for s in family.samples:
                assert s.name in (f"{name}_bucket", f"{name}_sum", f"{name}_count"), s
                if s.name == f"{name}_bucket" and s.labels["le"] == "+Inf":
                    rest = frozenset((k, v) for k, v in s.labels.items() if k != "le")
                    assert s.value == counts[rest], s
        else:
            raise AssertionError(f"{name}: unexpected type {family.type}")

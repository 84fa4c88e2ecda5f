"""The daemon's Prometheus metrics, in a CollectorRegistry of its own.

Requests are recorded where every request passes, the registry's generate
path, so the socket and the HTTP front count alike. Gauges (model states,
memory, queue depth) and the registry's event counters are read from the
daemon's status when scraped, never kept twice.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ipc.messages import GenerationDone, RunnerState, StatusReply, TextChunk
from supervisor.system import process_rss

PREFIX = "mlx_supervisor"
UNKNOWN_MODEL = "(unknown)"  # requests naming no model we have: never a client's string
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
RUNNER_STATES: tuple[RunnerState, ...] = get_args(RunnerState)
OK_FINISHES = frozenset({"stop", "length", "tool_calls"})  # a whole answer, as the model ended it


class Metrics:
    """Request counters and the time-to-first-token histogram, plus the
    collector that turns the daemon's status into gauges at scrape time."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Generate requests by how they ended: ok (tool calls included), cancelled, "
            "memory_pressure, or the error code.",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests.", ["model"],
            registry=self.registry,
        )  # fmt: skip
        self.cached_tokens = Counter(
            f"{PREFIX}_cached_prompt_tokens",
            "Prompt tokens taken from the prefix cache instead of computed.",
            ["model"],
            registry=self.registry,
        )
        self.generated_tokens = Counter(
            f"{PREFIX}_generated_tokens", "Tokens generated.", ["model"], registry=self.registry
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "From a request reaching the registry to its first output (text, reasoning or a "
            "tool call), waiting in line included.",
            ["model"],
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )
        self.http_requests = Counter(
            f"{PREFIX}_http_requests",
            "HTTP requests by route and status code.",
            ["route", "status"],
            registry=self.registry,
        )

    def request(self, model: str | None) -> RequestRecord:
        """Start recording one generate request to ``model`` (None: no such model)."""
        return RequestRecord(self, model or UNKNOWN_MODEL)

    def watch_status(self, status: Callable[[], StatusReply]) -> None:
        """Read ``status()`` at each scrape for the gauges (call it once)."""
        self.registry.register(StatusCollector(status))

    def exposition(self) -> bytes:
        """Everything, in Prometheus' text format."""
        return generate_latest(self.registry)


class RequestRecord:
    """One request's way through the registry: its first output, its end.

    A generation cancelled after a tool call counts as ok: the OpenAI front
    cancels it there itself when ``parallel_tool_calls`` is false (and
    answers ``finish_reason`` "tool_calls"), so the answer was whole; the
    registry cannot tell that cancel from a client leaving after a call,
    which is counted ok too."""

    def __init__(self, metrics: Metrics, model: str) -> None:
        self.metrics = metrics
        self.model = model
        self.started = time.monotonic()
        self.first_output_seen = False
        self.called_tools = False
        self.outcome: str | None = None

    def observe(self, event: TextChunk | GenerationDone) -> None:
        """Note a frame on its way to the client."""
        if isinstance(event, TextChunk):
            self.called_tools = self.called_tools or bool(event.tool_calls)
            if not self.first_output_seen and (event.text or event.reasoning or event.tool_calls):
                self.first_output_seen = True
                elapsed = time.monotonic() - self.started
                self.metrics.ttft.labels(self.model).observe(elapsed)
            return
        model = self.model
        self.metrics.prompt_tokens.labels(model).inc(event.prompt_tokens)
        self.metrics.cached_tokens.labels(model).inc(event.cached_tokens)
        self.metrics.generated_tokens.labels(model).inc(event.generation_tokens)
        reason = event.finish_reason
        whole = reason in OK_FINISHES or (reason == "cancelled" and self.called_tools)
        self.finish("ok" if whole else reason)

    def finish(self, outcome: str) -> None:
        """Count the request once, under ``outcome`` (later calls are ignored)."""
        if self.outcome is None:
            self.outcome = outcome
            self.metrics.requests.labels(self.model, outcome).inc()

    def close(self) -> None:
        """The request is over; one that ended without a word was cancelled."""
        self.finish("cancelled")


class StatusCollector:
    """Gauges from the daemon's status, read when scraped."""

    def __init__(self, status: Callable[[], StatusReply]) -> None:
        self.status = status

    def collect(self) -> Iterable[Metric]:
        reply = self.status()
        yield GaugeMetricFamily(
            f"{PREFIX}_uptime_seconds", "Seconds since the daemon started.",
            value=reply.supervisor.uptime_s,
        )  # fmt: skip
        daemon_rss = process_rss(os.getpid())
        if daemon_rss is not None:
            yield GaugeMetricFamily(
                f"{PREFIX}_daemon_rss_bytes", "The daemon's own resident memory.", value=daemon_rss
            )
        system = reply.system
        yield GaugeMetricFamily(
            f"{PREFIX}_system_memory_total_bytes", "The machine's memory as the daemon sees it.",
            value=system.memory_total_bytes,
        )  # fmt: skip
        yield GaugeMetricFamily(
            f"{PREFIX}_system_memory_available_bytes", "Memory available on the machine.",
            value=system.memory_available_bytes,
        )  # fmt: skip
        yield GaugeMetricFamily(
            f"{PREFIX}_runners_bytes", "What all runners (the spare too) hold.",
            value=system.runners_bytes,
        )  # fmt: skip
        yield from self._models(reply)
        events = CounterMetricFamily(
            f"{PREFIX}_events",
            "The registry's counters: restarts, deaths by class, refusals, retries, ...",
            labels=["event"],
        )
        for name, count in sorted(reply.counters.items()):
            events.add_metric([name], count)
        yield events

    def _models(self, reply: StatusReply) -> Iterable[Metric]:
        def gauge(name: str, text: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_{name}", text, labels=["model"])

        state = GaugeMetricFamily(
            f"{PREFIX}_model_state", "1 for the state each model is in.", labels=["model", "state"]
        )
        restarts = CounterMetricFamily(
            f"{PREFIX}_model_restarts", "Restarts of each model since it was loaded.",
            labels=["model"],
        )  # fmt: skip
        queue = gauge("model_queue_depth", "Requests waiting for their turn on each model.")
        active = gauge("model_active_requests", "Requests each model is generating now.")
        rss = gauge("runner_rss_bytes", "Resident memory of each model's runner.")
        mlx_active = gauge("mlx_active_bytes", "MLX active memory of each model's runner.")
        mlx_cache = gauge("mlx_cache_bytes", "MLX buffer cache of each model's runner.")
        mlx_peak = gauge("mlx_peak_bytes", "MLX peak memory of each model's runner.")
        budget = gauge("memory_budget_bytes", "The memory admission granted each model.")
        for runner in reply.runners:
            name = runner.name
            for value in RUNNER_STATES:
                state.add_metric([name, value], 1.0 if runner.state == value else 0.0)
            restarts.add_metric([name], runner.restarts)
            queue.add_metric([name], runner.queue_depth)
            active.add_metric([name], runner.active_requests)
            for family, figure in (
                (rss, runner.rss_bytes),
                (mlx_active, runner.mlx_active_bytes),
                (mlx_cache, runner.mlx_cache_bytes),
                (mlx_peak, runner.mlx_peak_bytes),
                (budget, runner.memory_budget_bytes),
            ):
                if figure is not None:
                    family.add_metric([name], figure)
        yield from (state, restarts, queue, active, rss, mlx_active, mlx_cache, mlx_peak, budget)

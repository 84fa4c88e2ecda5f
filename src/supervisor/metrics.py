"""The daemon's Prometheus metrics, in a CollectorRegistry of its own.

Requests are recorded where every request passes, the registry's generate
path, so every front counts alike; each request carries the name of the
front it came in by. What happens to models (deaths by cause class,
evictions, admission refusals) is recorded where the registry decides it,
per model, since the daemon's status keeps those only summed. Gauges (model
states, memory, queue depth) and the counters the status already has (the
registry's, restarts, the runners' prefix caches) are read from the
daemon's status when scraped, never kept twice.

Names follow Prometheus' conventions: base units in the name (``_seconds``,
``_bytes``), counters end in ``_total`` (the client library adds it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Literal, get_args

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ipc.messages import (
    CauseClass,
    GenerationDone,
    RunnerInfo,
    RunnerState,
    StatusReply,
    TextChunk,
)
from supervisor.system import process_rss

PREFIX = "mlx_supervisor"
UNKNOWN_MODEL = "(unknown)"  # requests naming no model we have: never a client's string
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)
RUNNER_STATES: tuple[RunnerState, ...] = get_args(RunnerState)
OK_FINISHES = frozenset({"stop", "length", "tool_calls"})  # a whole answer, as the model ended it

Front = Literal["socket", "openai", "anthropic", "responses", "ollama"]
"""Where a request came in: the control socket (CLI, Python client) or an API
of the HTTP front (OpenAI's chat and text completions are both ``openai``,
Ollama's chat and generate both ``ollama``)."""

DEATH_CLASSES: tuple[CauseClass, ...] = tuple(c for c in get_args(CauseClass) if c != "requested")
"""The cause classes a death can have (an exit we asked for is no death)."""


class Metrics:
    """Request counters and latency histograms, what happened to each model,
    plus the collector that turns the daemon's status into gauges at scrape
    time."""

    def __init__(self) -> None:
        # A `_created` gauge beside every counter and histogram doubles the
        # series for a timestamp no dashboard reads.
        disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped upstream
        self.registry = CollectorRegistry()
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Generate requests by the front they came in by (socket, openai, anthropic, "
            "responses, ollama) and how they ended: ok (tool calls included), cancelled, "
            "memory_pressure, or the error code.",
            ["model", "front", "outcome"],
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
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Time per generated token after a request's first frame of tokens, as the "
            "registry relays the frames. The runner sends a frame at most every "
            "stream_interval_ms (and a client that reads slowly gets the frames that piled "
            "up as one), so a frame's gap since the previous one is divided evenly among the "
            "tokens it brings and observed once per token: the count is those tokens, the "
            "sum their time (sum/count is the exact mean), but the spread within one frame "
            "is not seen.",
            ["model"],
            buckets=ITL_BUCKETS_S,
            registry=self.registry,
        )
        self.http_requests = Counter(
            f"{PREFIX}_http_requests",
            "HTTP requests by route and status code.",
            ["route", "status"],
            registry=self.registry,
        )
        self.deaths = Counter(
            f"{PREFIX}_runner_deaths",
            "Deaths of each model's runner that no one asked for, by cause class (the "
            "first load's included); since the daemon started.",
            ["model", "cause_class"],
            registry=self.registry,
        )
        self.evictions = Counter(
            f"{PREFIX}_model_evictions",
            "Times admission unloaded the model to make room for another; since the daemon "
            "started.",
            ["model"],
            registry=self.registry,
        )
        self.admission_refusals = Counter(
            f"{PREFIX}_model_admission_refusals",
            "Runners of the model admission refused (not enough memory, or max_loaded_models "
            "with nothing idle to unload); since the daemon started.",
            ["model"],
            registry=self.registry,
        )

    def request(self, model: str | None, front: Front) -> RequestRecord:
        """Start recording one generate request to ``model`` (None: no such
        model) that came in by ``front``."""
        return RequestRecord(self, model or UNKNOWN_MODEL, front)

    def model_seen(self, model: str) -> None:
        """A runner of ``model`` goes to admission: its per-model counters
        show from now on, at 0 until something happens (Prometheus' advice:
        a series that appears only with its first event hides that event
        from ``increase()``)."""
        self.evictions.labels(model)
        self.admission_refusals.labels(model)
        for cause_class in DEATH_CLASSES:
            self.deaths.labels(model, cause_class)

    def runner_died(self, model: str, cause_class: CauseClass) -> None:
        """``model``'s runner died on its own, of ``cause_class``."""
        self.deaths.labels(model, cause_class).inc()

    def evicted(self, model: str) -> None:
        """Admission unloads ``model`` to make room."""
        self.evictions.labels(model).inc()

    def admission_refused(self, model: str) -> None:
        """Admission refused a runner of ``model``."""
        self.admission_refusals.labels(model).inc()

    def watch_status(self, status: Callable[[], StatusReply]) -> None:
        """Read ``status()`` at each scrape for the gauges (call it once)."""
        self.registry.register(StatusCollector(status))

    def exposition(self) -> bytes:
        """Everything, in Prometheus' text format."""
        return generate_latest(self.registry)


class RequestRecord:
    """One request's way through the registry: its first output, the gaps
    between its tokens, its end.

    A generation cancelled after a tool call counts as ok: the OpenAI front
    cancels it there itself when ``parallel_tool_calls`` is false (and
    answers ``finish_reason`` "tool_calls"), so the answer was whole; the
    registry cannot tell that cancel from a client leaving after a call,
    which is counted ok too."""

    def __init__(self, metrics: Metrics, model: str, front: Front) -> None:
        self.metrics = metrics
        self.model = model
        self.front = front
        self.started = time.monotonic()
        self.first_output_seen = False
        self.called_tools = False
        self.outcome: str | None = None
        self.tokens_seen = 0  # generation_tokens of the last frame that brought some
        self.tokens_seen_at: float | None = None  # when that frame came

    def observe(self, event: TextChunk | GenerationDone) -> None:
        """Note a frame on its way to the client."""
        now = time.monotonic()
        self._observe_tokens(event.generation_tokens, now)
        if isinstance(event, TextChunk):
            self.called_tools = self.called_tools or bool(event.tool_calls)
            if not self.first_output_seen and (event.text or event.reasoning or event.tool_calls):
                self.first_output_seen = True
                self.metrics.ttft.labels(self.model).observe(now - self.started)
            return
        model = self.model
        self.metrics.prompt_tokens.labels(model).inc(event.prompt_tokens)
        self.metrics.cached_tokens.labels(model).inc(event.cached_tokens)
        self.metrics.generated_tokens.labels(model).inc(event.generation_tokens)
        reason = event.finish_reason
        whole = reason in OK_FINISHES or (reason == "cancelled" and self.called_tools)
        self.finish("ok" if whole else reason)

    def _observe_tokens(self, tokens: int, now: float) -> None:
        """A frame that says ``tokens`` were generated so far: the ones new
        since the last frame share its gap evenly (see ``Metrics.itl``)."""
        new = tokens - self.tokens_seen
        if new <= 0:
            return
        if self.tokens_seen_at is not None:
            gap = (now - self.tokens_seen_at) / new
            itl = self.metrics.itl.labels(self.model)
            for _ in range(new):
                itl.observe(gap)
        self.tokens_seen, self.tokens_seen_at = tokens, now

    def finish(self, outcome: str) -> None:
        """Count the request once, under ``outcome`` (later calls are ignored)."""
        if self.outcome is None:
            self.outcome = outcome
            self.metrics.requests.labels(self.model, self.front, outcome).inc()

    def close(self) -> None:
        """The request is over; one that ended without a word was cancelled."""
        self.finish("cancelled")


class StatusCollector:
    """Gauges, and the counters the status keeps, from the daemon's status,
    read when scraped."""

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
        yield from self._prefix_caches(reply.runners)
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

    def _prefix_caches(self, runners: list[RunnerInfo]) -> Iterable[Metric]:
        """Each loaded model's KV prefix cache, as its runner last reported it.
        Its counters start again with each runner (a counter reset, which
        ``rate()`` and ``increase()`` allow for)."""

        def counter(name: str, text: str) -> CounterMetricFamily:
            since = " Since the runner started."
            return CounterMetricFamily(f"{PREFIX}_{name}", text + since, labels=["model"])

        def gauge(name: str, text: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_{name}", text, labels=["model"])

        lookups = counter("prefix_cache_lookups", "Lookups of a prompt in the RAM prefix cache.")
        hits = counter(
            "prefix_cache_hits",
            "Lookups the RAM prefix cache served (at least one token reused): hits / lookups "
            "is its hit ratio.",
        )
        evictions = counter("prefix_cache_evictions", "Entries the RAM prefix cache dropped.")
        entries = gauge("prefix_cache_entries", "Entries in the RAM prefix cache.")
        held = gauge("prefix_cache_bytes", "What the RAM prefix cache holds.")
        budget = gauge("prefix_cache_budget_bytes", "The RAM prefix cache's budget.")
        disk_hits = counter(
            "prefix_cache_disk_hits",
            "Prompts the disk tier served with more of them than RAM held (its blocks are "
            "read into RAM: when RAM keeps them, the RAM lookup that follows is a hit too).",
        )
        disk_held = gauge("prefix_cache_disk_bytes", "What the prefix cache's disk tier holds.")
        disk_budget = gauge("prefix_cache_disk_budget_bytes", "The disk tier's budget.")
        for runner in runners:
            stats = runner.prefix_cache
            if stats is None:  # not loaded, or no prefix cache for this model
                continue
            name = [runner.name]
            lookups.add_metric(name, stats.hits + stats.misses)
            hits.add_metric(name, stats.hits)
            evictions.add_metric(name, stats.evictions)
            entries.add_metric(name, stats.entries)
            held.add_metric(name, stats.bytes)
            budget.add_metric(name, stats.budget_bytes)
            disk = stats.disk
            if disk is not None and disk.reason is None:  # a reason: the tier is off
                disk_hits.add_metric(name, disk.hits)
                disk_held.add_metric(name, disk.bytes)
                disk_budget.add_metric(name, disk.budget_bytes)
        yield from (lookups, hits, evictions, entries, held, budget)
        yield from (disk_hits, disk_held, disk_budget)

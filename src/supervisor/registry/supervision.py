"""Supervision of each model: a task that owns the model's runners one after
another (admitted, started, loaded, watched) and, when one dies on its own,
restarts it per the model's restart strategy and intensity (OTP's words; the
policy is :mod:`supervisor.registry.restart`'s), or leaves the model failed."""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable

import anyio

from ipc.messages import (
    FAULTS_ENV,
    MEMORY_CAUSES,
    ExitInfo,
    Loaded,
    LoadFailed,
    LoadModel,
    LoadProgress,
    Ready,
)
from supervisor.config import ModelConfig, SupervisorConfig
from supervisor.events import EventHub
from supervisor.memory.admission import AdmissionRefused
from supervisor.memory.monitor import MemoryMonitor
from supervisor.metrics import Metrics
from supervisor.registry.admitting import Admitter
from supervisor.registry.entries import ModelEntry
from supervisor.registry.processes import RunnerProcesses
from supervisor.registry.restart import RestartIntensity, RestartTracker
from supervisor.registry.specs import engine_settings
from supervisor.runners.exits import classify_exit
from supervisor.runners.group import RunnerGroup
from supervisor.runners.handle import RunnerStartError
from supervisor.runners.protocol import Runner
from supervisor.runners.requests import RunnerGone
from supervisor.waiting import wait_unless


def restart_tracker(config: SupervisorConfig, spec: ModelConfig) -> RestartTracker:
    """The restart policy of the model ``spec``: its own strategy, else the
    daemon's, with the daemon's restart intensity and backoff."""
    intensity = RestartIntensity(
        max_restarts=config.max_restarts,
        window_s=config.restart_window_s,
        backoff_s=config.restart_backoff_s,
        backoff_cap_s=config.restart_backoff_cap_s,
    )
    return RestartTracker(spec.restart or config.restart, intensity)


class Supervision:
    """Runs each model's supervising task.

    Args:
        config: the daemon config.
        processes: where runners come from.
        admitter: admits each runner (or refuses it).
        monitor: the memory monitor (a death under pressure is a memory death).
        counters: the registry's counters.
        on_change: called after a change worth persisting.
        idle_changed: called when a model becomes ready (keep-alive counts from then).
        metrics: where each model's runner deaths count, by cause class.
        events: where loads, deaths and restarts are published.
    """

    def __init__(
        self,
        config: SupervisorConfig,
        processes: RunnerProcesses,
        admitter: Admitter,
        monitor: MemoryMonitor,
        counters: Counter[str],
        on_change: Callable[[], None],
        idle_changed: Callable[[], None],
        metrics: Metrics,
        events: EventHub,
    ) -> None:
        self.config = config
        self.processes = processes
        self.admitter = admitter
        self.monitor = monitor
        self.counters = counters
        self.on_change = on_change
        self.idle_changed = idle_changed
        self.metrics = metrics
        self.events = events

    async def supervise(self, entry: ModelEntry) -> None:
        """Own the model's runners, one after another, until it is unloaded or
        its restarts are exhausted. A fault boundary: a bug in here marks this
        model failed with the cause and ends its runner, never the daemon."""
        try:
            await self._supervise_runners(entry)
        except Exception as exc:
            entry.log.exception("supervision_failed")
            entry.failure = f"internal error: {exc!r}"
            entry.load_error = entry.load_error or entry.failure
            handle = entry.handle
            if handle is not None and handle.alive:
                with anyio.CancelScope(shield=True):
                    await handle.escalate(entry.failure, first="sigkill")
            if entry.state != "stopping":
                entry.move("failed", force=True)
            self.counters["failed"] += 1
            self.on_change()
        finally:
            entry.loaded.set()
            entry.stopped.set()

    async def _supervise_runners(self, entry: ModelEntry) -> None:
        reason = "load"
        floor_bytes = 0  # after a memory death: what the dead runner reached
        while True:
            entry.take_next_spec()  # a reload's kv_bits, reference, ... from this load on
            try:  # an unload meanwhile cuts the wait for admission short
                await wait_unless(
                    entry.stop_requested,
                    functools.partial(self.admitter.admit, entry, reason, floor_bytes),
                )
            except AdmissionRefused as refused:
                self.admitter.refuse(entry, refused.message)
                return
            if entry.stop_requested.is_set() or not entry.admitted:
                entry.admitted = False
                return
            try:
                exit_info = await self._run_runner(entry)
            finally:
                entry.admitted = False
                if entry.handle is not None:
                    entry.footprint_at_exit = entry.handle.footprint_bytes
            exit_info.cause_class = classify_exit(
                exit_info,
                requested=entry.stop_requested.is_set(),
                # A runner we killed ourselves (a stall) is no OOM kill.
                under_pressure=self.monitor.under_pressure
                and not (entry.handle is not None and entry.handle.kill_cause),
            )
            entry.last_exit = exit_info
            if entry.stop_requested.is_set():
                return
            if entry.handle is None:  # no runner started: no death, no pid
                entry.log.warning("runner_start_failed", error=exit_info.cause)
                self.events.publish("runner_start_failed", entry.name, pid=None,
                                    error=exit_info.cause)  # fmt: skip
            else:
                entry.log.warning("runner_died", cause=exit_info.cause,
                                  cause_class=exit_info.cause_class)  # fmt: skip
                self.counters[f"deaths_{exit_info.cause_class}"] += 1
                self.metrics.runner_died(entry.name, exit_info.cause_class)
                self.events.publish("runner_died", entry.name, pid=entry.handle.pid,
                                    cause=exit_info.cause, cause_class=exit_info.cause_class,
                                    code=exit_info.code, signal=exit_info.signal,
                                    rank=exit_info.rank)  # fmt: skip
            reason = f"restart after {exit_info.cause_class}"
            if exit_info.cause_class in MEMORY_CAUSES:  # never restart into the same wall
                audit = exit_info.audit
                reached = max(entry.footprint_at_exit, audit.peak_bytes if audit else 0)
                floor_bytes = max(floor_bytes, reached)
            entry.move("crashed")
            if not entry.loaded.is_set():  # the first load failed: no restarts
                if entry.keep_if_first_load_fails:
                    entry.failure = f"load failed: {entry.load_error}"
                    entry.move("failed")
                return
            decision = entry.tracker.decide(exit_info, time.monotonic())
            if decision.delay_s is None:
                entry.log.error("restart_refused", reason=decision.reason)
                self.events.publish("restart_refused", entry.name, reason=decision.reason)
                if decision.budget_spent:
                    entry.failure = decision.reason
                    entry.move("failed")
                    self.counters["failed"] += 1
                return
            entry.log.warning("restart_scheduled", reason=decision.reason)
            self.events.publish("restart_scheduled", entry.name, reason=decision.reason,
                                delay_s=decision.delay_s, restarts=entry.restarts)  # fmt: skip
            entry.next_restart_at = time.time() + decision.delay_s
            entry.move("restarting")
            with anyio.move_on_after(decision.delay_s):  # the backoff, cut short by unload
                await entry.stop_requested.wait()
            entry.next_restart_at = None
            if entry.stop_requested.is_set():
                return
            entry.restarts += 1
            self.counters["restarts"] += 1
            entry.move("starting")

    async def _run_runner(self, entry: ModelEntry) -> ExitInfo:
        """Start a runner for the entry, load the model, and wait for its end."""
        entry.handle = None  # the last runner's is gone: none until this one starts
        try:
            handle = await self.processes.obtain(entry.spec)
        except RunnerStartError as exc:
            entry.load_error = str(exc)
            return ExitInfo(code=None, signal=None, cause=str(exc))
        entry.handle = handle
        if isinstance(handle, RunnerGroup):
            handle.rank_need_bytes = entry.rank_need_bytes
        if entry.stop_requested.is_set():  # unloaded while we were starting it
            await handle.escalate("unload")
        else:
            try:
                entry.move("loading")
                await self._load_model(entry, handle)
            except RunnerGone:
                pass
        await handle.exited.wait()
        assert handle.exit_info is not None
        if not entry.loaded.is_set():
            entry.load_error = (
                entry.load_error or f"runner died while loading: {handle.exit_info.cause}"
            )
        return handle.exit_info

    async def _load_model(self, entry: ModelEntry, handle: Runner) -> None:
        """Have ``handle`` load the entry's model, passing its progress on, until
        it is ready (the entry's first load is then decided). Raises RunnerGone."""
        spec = entry.spec
        faults = spec.env.get(FAULTS_ENV, "")
        max_tokens = spec.max_tokens or self.config.max_tokens
        entry.max_tokens_cap = max_tokens
        engine = engine_settings(self.config, spec)
        entry.slots.total_tokens = engine.max_concurrent
        await handle.send(LoadModel(spec.name, spec.model, max_tokens, faults, entry.plan, engine))
        while True:
            event = await handle.next_event()
            if isinstance(event, LoadProgress):
                self.events.publish("model_loading", spec.name, pid=handle.pid, phase=event.phase,
                                    done=event.done, total=event.total,
                                    active_bytes=event.active_bytes, rank=event.rank)  # fmt: skip
                for listener in entry.progress_listeners:
                    listener(event)  # never blocks: the connection writes it
            elif isinstance(event, Ready):
                # What the runner can do: 1 at a time when its model cannot batch.
                entry.slots.total_tokens = max(1, event.engine.max_concurrent)
                entry.param_bytes = event.param_bytes
                entry.load_result = Loaded(
                    name=spec.name,
                    model=spec.model,
                    pid=handle.pid or 0,
                    param_bytes=event.param_bytes,
                    active_bytes=event.active_bytes,
                    peak_bytes=event.peak_bytes,
                    load_s=event.load_s,
                )
                entry.progress_listeners.clear()
                if entry.state == "loading":
                    entry.touch()
                    entry.move("ready")
                    entry.log.info("model_ready", restarts=entry.restarts)
                    self.events.publish("model_ready", spec.name, pid=handle.pid,
                                        restarts=entry.restarts, load_s=event.load_s,
                                        param_bytes=event.param_bytes)  # fmt: skip
                    self.idle_changed()
                entry.loaded.set()
                return
            elif isinstance(event, LoadFailed):
                entry.load_error = event.error
            else:
                entry.log.warning("unexpected_event", event_type=type(event).__name__)

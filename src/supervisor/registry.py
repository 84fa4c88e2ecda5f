"""All supervised models, their runners and states, and the requests they serve.

Each model has a :class:`ModelEntry` and a supervising task (in the
registry's task group) that owns its runners one after another: start (from
the hot spare when it can), load, serve, and when the runner dies on its own,
restart per the model's restart strategy and intensity. Requests to one model
run one at a time, in arrival order (a fair lock); models serve in parallel.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

import anyio
import msgspec
import structlog
from anyio.abc import TaskGroup, TaskStatus

from ipc import ChannelClosed
from ipc.messages import (
    FAULTS_ENV,
    MEMORY_CAUSES,
    CacheCleared,
    ClearCache,
    EngineSettings,
    ErrorCode,
    ExitInfo,
    Generate,
    GenerateRequest,
    GenerationDone,
    GenerationFailed,
    Loaded,
    LoadFailed,
    LoadModel,
    LoadProgress,
    LoadRequest,
    MemoryPlan,
    Ready,
    RunnerInfo,
    RunnerState,
    SystemInfo,
    TextChunk,
    UnkillableRunner,
    Unloaded,
)
from ipc.messages import Cancel as CancelCommand
from supervisor.boundary import contained, keep_running
from supervisor.config import ModelConfig, SupervisorConfig
from supervisor.memory.admission import Admission, AdmissionRefused
from supervisor.memory.classify import classify_exit, ended_by_failed_step
from supervisor.memory.estimate import Estimate, estimate_reference
from supervisor.memory.monitor import MemoryMonitor, override_mb
from supervisor.metrics import Metrics
from supervisor.restart import RestartIntensity, RestartTracker
from supervisor.runner_group import Place, RunnerGroup, group_estimate, group_places, is_group
from supervisor.runner_handle import RequestEvent, RunnerGone, RunnerHandle, RunnerStartError
from supervisor.security import env_problem, model_name_problem, model_reference_problem
from supervisor.spare import HotSpare, spare_fits
from supervisor.system import process_rss
from supervisor.waiting import first_of, wait_unless

log = structlog.get_logger("supervisor.registry")

Runner = RunnerHandle | RunnerGroup
"""What serves a model: one runner process, or a group of ranks."""

# The moves a model's state may make (see ARCHITECTURE.md's lifecycle).
ALLOWED_MOVES: dict[RunnerState, set[RunnerState]] = {
    "starting": {"loading", "crashed", "failed", "stopping"},  # failed: admission refused
    "loading": {"ready", "crashed", "stopping"},
    "ready": {"busy", "crashed", "stopping"},
    "busy": {"ready", "crashed", "stopping"},
    "crashed": {"restarting", "failed", "stopping"},
    "restarting": {"starting", "stopping"},
    "failed": {"stopping"},
    "stopping": set(),
}

Emit = Callable[[TextChunk | GenerationDone, bytes | None], Awaitable[None]]
"""Passes one frame of a generation to its client: the event, and the body
of the runner's frame when it can be written as it is (None: encode it)."""
ProgressListener = Callable[[LoadProgress], None]
"""Told of load progress; must not block (a connection's mailbox)."""
QueueListener = Callable[[int], None]
"""Told a waiting request's place in line (1 = next); must not block."""


MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_STOP_CHARS = 256


class RequestError(Exception):
    """A client request failed; ``code`` and the message go back to the client."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.message = message


def derive_name(model: str) -> str:
    """Default model name: ``builtin:tiny`` -> ``tiny``; a path or repo id -> its
    last part (``.../qwen.Q4_K.gguf`` -> ``qwen.Q4_K``)."""
    if model.startswith("builtin:"):
        return model.removeprefix("builtin:")
    last = PurePath(model.rstrip("/"))
    if last.suffix.lower() == ".gguf" and last.stem:
        return last.stem
    return last.name or model


@dataclass(eq=False)
class Waiter:
    """A request waiting for its turn on a model."""

    on_queued: QueueListener | None

    def tell(self, position: int) -> None:
        if self.on_queued is not None:
            self.on_queued(position)


@dataclass(eq=False)
class ModelEntry:
    """One model: its settings, its current runner and what has happened to it."""

    spec: ModelConfig
    tracker: RestartTracker
    state: RunnerState = "starting"
    handle: Runner | None = None
    restarts: int = 0
    last_exit: ExitInfo | None = None
    failure: str | None = None
    next_restart_at: float | None = None
    param_bytes: int | None = None
    keep_if_first_load_fails: bool = False  # restored at start: stay, failed, for status
    waiters: list[Waiter] = field(default_factory=list)  # in arrival order
    # A slot per request the runner serves at once: sized by max_concurrent,
    # then by what the runner says it can do (1 when it cannot batch).
    slots: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(1))
    active_requests: int = 0  # holding a slot and sent to the runner
    loaded: anyio.Event = field(default_factory=anyio.Event)  # first load decided
    stop_requested: anyio.Event = field(default_factory=anyio.Event)
    stopped: anyio.Event = field(default_factory=anyio.Event)  # supervising task ended
    forgotten: anyio.Event = field(default_factory=anyio.Event)  # dropped from the registry
    state_changed: anyio.Event = field(default_factory=anyio.Event)
    load_result: Loaded | None = None
    load_error: str | None = None
    load_error_code: ErrorCode = "load_failed"
    progress_listeners: list[ProgressListener] = field(default_factory=list)
    keep_alive_s: float = 0.0  # idle this long: unloaded (0: never)
    estimate: Estimate | None = None
    rank_need_bytes: int | None = None  # a group: what one rank needs (the estimate's)
    plan: MemoryPlan | None = None  # what admission granted the current runner
    admitted: bool = False  # from admission until that runner is gone
    footprint_at_exit: int = 0  # what its last runner held when it died
    last_used: float = field(default_factory=time.monotonic)  # end of the last request

    @property
    def evictable(self) -> bool:
        """Idle and not pinned: admission may unload it to make room."""
        return (
            not self.spec.pinned
            and self.state == "ready"
            and self.slots.borrowed_tokens == 0
            and not self.waiters
            and not self.stop_requested.is_set()
        )

    @property
    def holds_runner(self) -> bool:
        """Counts against max_loaded_models and holds its budget: admitted,
        and its runner not gone yet."""
        return self.admitted and not self.stop_requested.is_set()

    @property
    def wired_limit_bytes(self) -> int | None:
        return self.plan.wired_limit_bytes if self.plan is not None else None

    @property
    def budget_bytes(self) -> int | None:
        return self.plan.budget_bytes if self.plan is not None else None

    @property
    def footprint_bytes(self) -> int:
        handle = self.handle
        return handle.footprint_bytes if handle is not None and handle.alive else 0

    def expires_at(self) -> float | None:
        """When keep-alive unloads this model if it stays idle (monotonic), or None."""
        if self.spec.pinned or self.keep_alive_s <= 0 or not self.evictable:
            return None
        return self.last_used + self.keep_alive_s

    def touch(self) -> None:
        """Note a use: keep-alive and LRU eviction count from here."""
        self.last_used = time.monotonic()

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def log(self) -> Any:
        """A logger bound to the model and, once there is one, its runner's pid."""
        if self.handle is not None:
            return self.handle.log
        return log.bind(model=self.name)

    def move(self, new: RunnerState, *, force: bool = False) -> None:
        """Change state, refusing moves the lifecycle does not allow (unless
        ``force``: a fault boundary marking the model failed from anywhere)."""
        if new == self.state:
            return
        if new not in ALLOWED_MOVES[self.state] and not force:
            raise RuntimeError(f"{self.name}: illegal state move {self.state} -> {new}")
        # ready <-> busy happens on every request: not worth an info line each time.
        level = self.log.debug if {self.state, new} == {"ready", "busy"} else self.log.info
        level("model_state", old=self.state, new=new)
        self.state = new
        self.state_changed.set()
        self.state_changed = anyio.Event()

    @property
    def serving(self) -> bool:
        """Loaded and taking requests (ready, or busy with others)."""
        return self.state in ("ready", "busy")

    def request_started(self) -> None:
        """Busy from the first request in flight."""
        self.active_requests += 1
        if self.state == "ready":
            self.move("busy")

    def request_finished(self) -> None:
        """Back to ready after the last request in flight, unless the runner
        died or is stopping."""
        self.active_requests -= 1
        if self.active_requests == 0 and self.state == "busy":
            self.move("ready")

    async def wait_ready(self) -> Runner:
        """The runner once the model is ready (waiting through loads and restarts).

        Raises:
            RequestError: the model is crashed, failed or being unloaded.
        """
        while True:
            if self.serving and self.handle is not None:
                return self.handle
            if self.state in ("crashed", "failed", "stopping"):
                why = self.failure or (self.last_exit.cause if self.last_exit else None)
                detail = f": {why}" if why else ""
                code: ErrorCode = "not_ready" if self.state == "stopping" else "runner_died"
                if self.state == "failed" and self.load_error_code == "insufficient_memory":
                    code = "insufficient_memory"
                raise RequestError(code, f"{self.name} is {self.state}{detail}")
            await self.state_changed.wait()

    def leave_queue(self, waiter: Waiter) -> None:
        """Take ``waiter`` out of line and tell those behind it their new place."""
        index = self.waiters.index(waiter)
        del self.waiters[index]
        for position, behind in enumerate(self.waiters[index:], start=index + 1):
            behind.tell(position)

    def info(self) -> RunnerInfo:
        handle = self.handle
        pid = handle.pid if handle is not None and handle.alive else None
        rss = process_rss(pid) if pid is not None else None
        if isinstance(handle, RunnerGroup) and pid is not None:
            rss = handle.measure_rss()  # every local rank
        memory = handle.memory if pid is not None and handle is not None else None
        engine = handle.engine_stats if pid is not None and handle is not None else None
        return RunnerInfo(
            name=self.name,
            model=self.spec.model,
            pid=pid,
            state=self.state,
            rss_bytes=rss,
            started_at=handle.started_at if handle is not None else None,
            restarts=self.restarts,
            last_exit=self.last_exit,
            param_bytes=self.param_bytes,
            queue_depth=len(self.waiters),
            next_restart_at=self.next_restart_at,
            failure=self.failure,
            mlx_active_bytes=memory.active_bytes if memory is not None else None,
            mlx_cache_bytes=memory.cache_bytes if memory is not None else None,
            mlx_peak_bytes=memory.peak_bytes if memory is not None else None,
            memory_budget_bytes=self.plan.budget_bytes if self.plan is not None else None,
            estimate_bytes=self.estimate.total_bytes if self.estimate is not None else None,
            pinned=self.spec.pinned,
            keep_alive_s=self.keep_alive_s,
            last_used_at=time.time() - (time.monotonic() - self.last_used),
            active_requests=self.active_requests,
            max_concurrent=int(self.slots.total_tokens),
            batching=engine.batching if engine is not None else None,
            batching_reason=engine.batching_reason if engine is not None else None,
            prefix_cache=engine.prefix_cache if engine is not None else None,
            next_turn=engine.next_turn if engine is not None else None,
            ranks=handle.rank_info() if isinstance(handle, RunnerGroup) else [],
        )


class Registry:
    """The models the daemon supervises, by name.

    Args:
        config: the daemon config.
        task_group: where supervising tasks and runner processes live.
        on_change: called after any change worth persisting (runners, models).
    """

    def __init__(
        self,
        config: SupervisorConfig,
        task_group: TaskGroup,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.config = config
        self.task_group = task_group
        self.on_change = on_change
        self.entries: dict[str, ModelEntry] = {}
        self.closing = False
        self.counters: Counter[str] = Counter()
        self.spare = HotSpare(config, self.spawn)
        self.live_handles: set[RunnerHandle] = set()
        self._request_ids = itertools.count(1)
        self.monitor = MemoryMonitor(
            override_mb=override_mb(config.memory_override_mb),
            threshold_pct=config.pressure_threshold_pct,
            poll_s=config.memory_poll_s,
            footprint=self.runners_footprint,
        )
        self.admission = Admission(config, self.monitor, self.counters)
        self._idle_changed = anyio.Event()
        self.metrics = Metrics()  # every request, from the socket or HTTP, counts here

    def start_background(self) -> None:
        """Start the registry's own background work: the hot spare, the memory
        monitor and keep-alive expiry."""
        if self.config.hot_spare:
            self.task_group.start_soon(self.spare.keep, name="hot spare")
        tg = self.task_group
        tg.start_soon(keep_running, "memory monitor", self.monitor.run, name="memory monitor")
        tg.start_soon(keep_running, "keep-alive expiry", self._expire_idle,
                      name="keep-alive expiry")  # fmt: skip

    def runners_footprint(self) -> int:
        """What our runner processes (the spare too) hold now, in bytes."""
        total = 0
        for handle in list(self.live_handles):
            handle.measure_rss()
            total += handle.footprint_bytes
        return total

    def idle_changed(self) -> None:
        """A model became idle or busy: keep-alive recomputes its deadline."""
        self._idle_changed.set()

    def get(self, name: str) -> ModelEntry:
        """The entry called ``name``. Raises RequestError(unknown_model)."""
        entry = self.entries.get(name)
        if entry is None:
            known = ", ".join(sorted(self.entries)) or "none loaded"
            raise RequestError("unknown_model", f"no model named {name!r} (loaded: {known})")
        return entry

    def status(self) -> list[RunnerInfo]:
        return [entry.info() for entry in list(self.entries.values())]

    def unkillable(self) -> list[UnkillableRunner]:
        """Runner processes SIGKILL has not ended yet (see RunnerHandle.escalate)."""
        return [
            UnkillableRunner(handle.spec.name, handle.pid, handle.rss_bytes)
            for handle in list(self.live_handles)
            if handle.unkillable and handle.pid is not None
        ]

    def system_info(self) -> SystemInfo:
        """The machine's memory as the monitor saw it last (override applied)."""
        snapshot = self.monitor.latest
        return SystemInfo(
            memory_total_bytes=snapshot.total_bytes,
            memory_available_bytes=snapshot.available_bytes,
            pressure_pct=round(snapshot.pressure_pct, 1),
            threshold_pct=snapshot.threshold_pct,
            override_mb=snapshot.override_mb,
            runners_bytes=snapshot.runners_bytes,
        )

    # --- runner processes ----------------------------------------------------

    async def spawn(self, handle: RunnerHandle) -> None:
        """Start ``handle``'s process in a task that owns it until it is reaped.

        Raises:
            RunnerStartError: it failed to start or to shake hands.
        """
        error: RunnerStartError | None = await self.task_group.start(self._own_process, handle)
        if error is not None:
            raise error

    async def _own_process(
        self, handle: RunnerHandle, *, task_status: TaskStatus[RunnerStartError | None]
    ) -> None:
        """A fault boundary: whatever fails here ends this runner, not the daemon."""
        started = False
        try:
            async with anyio.create_task_group() as runner_tasks:
                try:
                    await handle.start(runner_tasks)
                except RunnerStartError as exc:
                    started = True  # reported: whatever happens next, never again
                    task_status.started(exc)
                    return
                self.live_handles.add(handle)
                started = True
                task_status.started(None)
                self.on_change()
                try:
                    await handle.exited.wait()
                    if handle.unkillable:
                        self.counters["unkillable"] += 1
                    await handle.reaped.wait()  # counted as holding memory until it is gone
                finally:
                    self.live_handles.discard(handle)
                    self.admission.note_departure(
                        handle.spec.name, handle.footprint_bytes, handle.started_monotonic
                    )
                    self.on_change()
        except Exception as exc:
            handle.log.exception("runner_task_failed")
            cause = f"supervisor error: {exc!r}"
            handle.mark_exited(None, cause)  # the task group has killed and reaped it
            if not started:
                task_status.started(RunnerStartError(cause))

    async def _obtain_runner(self, spec: ModelConfig) -> Runner:
        """A runner for ``spec``: a group of ranks when it is sharded; else the
        hot spare if it fits, else a new process."""
        if is_group(spec):
            try:
                group = RunnerGroup(spec, self.config)
            except ValueError as exc:  # its hostfile changed since it was checked
                raise RunnerStartError(str(exc)) from None
            await group.start(self.spawn, self.task_group)
            return group
        spare = self.spare.take(spec)
        if spare is not None:
            self.counters["spare_used"] += 1
            return spare
        handle = RunnerHandle(spec, self.config)
        await self.spawn(handle)
        return handle

    # --- load ----------------------------------------------------------------

    def spec_for(self, request: LoadRequest) -> ModelConfig:
        """Merge a load request with the config's settings for that name.

        Raises:
            RequestError: a value out of the config's ranges (bad_request); the
                spec is checked as a config file's would be, so that nothing a
                request stores can make the state file unreadable.
        """
        name = request.name or derive_name(request.model)
        configured = self.config.model_config(name)
        env = {**(configured.env if configured else {}), **request.env}
        fields: dict[str, Any] = msgspec.to_builtins(configured) if configured else {}
        fields.pop("preload", None)
        fields.update(name=name, model=request.model, env=env)
        keys = ("max_tokens", "restart", "keep_alive_s", "pinned", "context_tokens",
                "max_concurrent", "prefix_cache", "ranks", "hostfile")  # fmt: skip
        for key in keys:
            value = getattr(request, key)
            if value is not None:
                fields[key] = value
        try:
            spec = msgspec.convert(fields, ModelConfig)
            group_places(spec)  # a hostfile that cannot serve is refused here
        except msgspec.ValidationError as exc:
            raise RequestError("bad_request", f"bad load request: {exc}") from None
        except ValueError as exc:
            raise RequestError("bad_request", str(exc)) from None
        return spec

    async def load(self, spec: ModelConfig, on_progress: ProgressListener | None = None) -> Loaded:
        """Start supervising ``spec`` and wait until its model is ready.

        Raises:
            RequestError: the name is taken by a live model, the daemon is
                closing, or the first load failed (the message says why; a
                model whose first load fails is not restarted).
        """
        old = self.entries.get(spec.name)
        if old is not None and old.state in ("crashed", "failed"):
            await self.unload(spec.name, reason="replaced by a new load")
        entry = self.register(spec, on_progress)
        return await self.wait_loaded(entry)

    def register(
        self,
        spec: ModelConfig,
        on_progress: ProgressListener | None = None,
        *,
        keep_if_first_load_fails: bool = False,
    ) -> ModelEntry:
        """Add ``spec`` and start its supervising task; returns at once.

        ``keep_if_first_load_fails`` (models restored at start): a failed
        first load leaves the model ``failed`` with the reason, in status and
        in the desired state, until an unload or a new load.

        Raises:
            RequestError: bad name, name taken, or the daemon is closing.
        """
        if self.closing:
            raise RequestError("shutting_down", "the daemon is shutting down")
        problem = (
            model_name_problem(spec.name)
            or model_reference_problem(spec.model)
            or env_problem(spec.env)
        )
        if problem:
            raise RequestError("bad_request", problem)
        old = self.entries.get(spec.name)
        if old is not None:
            raise RequestError("already_loaded", f"{spec.name} is already loaded ({old.state})")
        intensity = RestartIntensity(
            max_restarts=self.config.max_restarts,
            window_s=self.config.restart_window_s,
            backoff_s=self.config.restart_backoff_s,
            backoff_cap_s=self.config.restart_backoff_cap_s,
        )
        entry = ModelEntry(spec, RestartTracker(spec.restart or self.config.restart, intensity))
        entry.keep_if_first_load_fails = keep_if_first_load_fails
        entry.keep_alive_s = (
            spec.keep_alive_s if spec.keep_alive_s is not None else self.config.keep_alive_s
        )
        if on_progress is not None:
            entry.progress_listeners.append(on_progress)
        self.entries[spec.name] = entry
        self.task_group.start_soon(self._supervise, entry, name=f"supervise {spec.name}")
        return entry

    def find(self, ref: str) -> ModelEntry | None:
        """The model named ``ref``, else the one model loaded from reference ``ref``."""
        entry = self.entries.get(ref)
        if entry is not None:
            return entry
        matches = [e for e in list(self.entries.values()) if e.spec.model == ref]
        return matches[0] if len(matches) == 1 else None

    async def ensure_loaded(
        self, ref: str, on_progress: ProgressListener | None = None
    ) -> ModelEntry:
        """The model a client names by ``ref``, loaded on demand if need be.

        ``ref`` is a model's name, or the reference (``builtin:tiny``, a path,
        a repo id) of a loaded or configured model. A configured model that
        is not loaded is loaded (``load_on_demand``, on by default); any other
        reference only with ``load_on_demand = "any"``. The load is a normal
        one (admission, eviction, progress to ``on_progress``, the same
        errors); requests for a model that is loading wait for the same load.
        Returns once the model's first load is decided: a model that is
        restarting or failed is returned as it is.

        Raises:
            RequestError: unknown_model (not loaded and not to be loaded on
                demand), or the load's own error (load_failed,
                insufficient_memory, shutting_down, bad_request, ...).
        """
        entry = self.find(ref)
        if entry is not None and self._first_load_failed_unheard(entry):
            # Everyone who waited for it left before it failed (a client's
            # timeout during a long load): forget it, and load afresh.
            entry.log.info("load_on_demand_retried", failure=entry.load_error or entry.failure)
            await self.unload(entry.name, reason="replaced by a load on demand")
            entry = None
        if entry is None:
            entry = self._load_on_demand(ref)
        if not entry.loaded.is_set():
            if on_progress is not None:
                entry.progress_listeners.append(on_progress)
            try:
                await self.wait_loaded(entry)
            finally:
                if on_progress in entry.progress_listeners:
                    entry.progress_listeners.remove(on_progress)
        return entry

    def _first_load_failed_unheard(self, entry: ModelEntry) -> bool:
        """Whether ``entry``'s first load failed and no one was left to hear it
        (the one who would have forgotten it, :meth:`wait_loaded`, had gone)."""
        return (
            entry.loaded.is_set()
            and entry.load_result is None
            and not entry.keep_if_first_load_fails
            and self.entries.get(entry.name) is entry
        )

    def _load_on_demand(self, ref: str) -> ModelEntry:
        """Register the model ``ref`` names, if load_on_demand allows it.
        Raises RequestError."""
        mode = self.config.load_on_demand
        configured = self.config.model_config(ref) or next(
            (m for m in self.config.models if m.model == ref), None
        )
        if configured is not None and mode:
            spec = self.spec_for(LoadRequest(model=configured.model, name=configured.name))
        elif configured is None and mode == "any":
            spec = self.spec_for(LoadRequest(model=ref))
        else:
            loaded = ", ".join(sorted(self.entries)) or "none"
            names = ", ".join(m.name for m in self.config.models) or "none"
            why = (
                "load_on_demand is off"
                if not mode
                else 'only configured models load on demand (load_on_demand = "any": any model)'
            )
            raise RequestError(
                "unknown_model",
                f"no model {ref!r} is loaded (loaded: {loaded}; configured: {names}); {why}",
            )
        entry = self.register(spec)
        log.info("load_on_demand", model=spec.name, source=spec.model)
        return entry

    async def wait_loaded(self, entry: ModelEntry) -> Loaded:
        """Wait for the entry's first load. Raises RequestError(load_failed)."""
        await entry.loaded.wait()
        if entry.load_result is None:
            if self.entries.get(entry.name) is entry and not entry.keep_if_first_load_fails:
                del self.entries[entry.name]
                entry.forgotten.set()
                self.on_change()
            message = entry.load_error or entry.failure or "load failed"
            raise RequestError(entry.load_error_code, message)
        self.on_change()
        return entry.load_result

    async def _supervise(self, entry: ModelEntry) -> None:
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
            try:  # an unload meanwhile cuts the wait for admission short
                await wait_unless(
                    entry.stop_requested,
                    functools.partial(self._admit, entry, reason, floor_bytes),
                )
            except AdmissionRefused as refused:
                self._refuse(entry, refused.message)
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
            entry.log.warning("runner_died", cause=exit_info.cause,
                              cause_class=exit_info.cause_class)  # fmt: skip
            self.counters[f"deaths_{exit_info.cause_class}"] += 1
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
                if decision.budget_spent:
                    entry.failure = decision.reason
                    entry.move("failed")
                    self.counters["failed"] += 1
                return
            entry.log.warning("restart_scheduled", reason=decision.reason)
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

    async def _admit(self, entry: ModelEntry, reason: str, floor_bytes: int) -> None:
        """Admission for the entry's next runner. The model is estimated afresh each
        time (a hub model is on disk only once a runner fetched it), with the runtime
        this daemon measured: its warm spare, else a runner at its start (see
        :meth:`_measure_runtime`). On success ``entry.plan`` is set and
        ``entry.admitted`` true.

        Raises:
            AdmissionRefused: it does not fit, even after evicting idle models.
        """
        estimate = None
        try:
            estimate = await anyio.to_thread.run_sync(
                estimate_reference, entry.spec.model, entry.spec.context_tokens
            )
        except (OSError, ValueError) as exc:  # unreadable or corrupt files: the load will say
            entry.log.warning("estimate_failed", error=str(exc))
        baseline = self.admission.baseline
        baseline.observe(self.spare.warm_footprint_bytes(), "spare")
        if estimate is not None:
            estimate = baseline.apply(estimate)
            try:
                places = group_places(entry.spec)
            except ValueError:  # the runner's start says so
                places = [Place(None, "")]
            here = sum(place.host is None for place in places)
            if len(places) > 1:
                one = group_estimate(estimate, len(places), local=1)
                entry.rank_need_bytes = one.total_bytes
            entry.estimate = group_estimate(estimate, len(places), here)
            entry.log.info("model_estimate", **msgspec.structs.asdict(entry.estimate))

        def spare_bytes() -> int:
            takes_spare = spare_fits(entry.spec) and not is_group(entry.spec)
            return self.spare.warm_footprint_bytes() if takes_spare else 0

        def grant(plan: MemoryPlan) -> None:  # under the admission lock
            entry.plan = plan
            entry.admitted = True

        await self.admission.admit(
            entry.name,
            entry.estimate,
            reason=reason,
            others=lambda: [e for e in list(self.entries.values()) if e is not entry],
            evict=self._evict,
            grant=grant,
            spare_bytes=spare_bytes,
            floor_bytes=floor_bytes,
        )
        if not baseline.measured and not is_group(entry.spec):
            self.task_group.start_soon(contained, f"measure runtime {entry.name}",
                                       self._measure_runtime, entry)  # fmt: skip

    async def _measure_runtime(self, entry: ModelEntry) -> None:
        """Until a spare has been measured: the footprint of the entry's admitted runner
        as soon as it has imported mlx, before its weights, is the runtime every later
        estimate plans."""
        while entry.state == "starting":  # admitted: its runner is on its way
            await entry.state_changed.wait()
        handle = entry.handle
        if entry.state != "loading" or not isinstance(handle, RunnerHandle):
            return  # it failed to start, or was unloaded meanwhile
        await first_of(handle.warm, handle.exited)
        if handle.host is None:  # as it started, before its weights
            self.admission.baseline.observe(handle.runtime_bytes, "runner")

    def _refuse(self, entry: ModelEntry, message: str) -> None:
        """Admission refused the entry's runner: a first load fails with
        insufficient_memory; a restart leaves the model failed, not looping."""
        entry.log.error("admission_refused", reason=message)
        entry.load_error = message
        entry.load_error_code = "insufficient_memory"
        entry.failure = f"insufficient memory: {message}"
        entry.plan = None
        if entry.state != "stopping":
            entry.move("failed")  # wakes requests waiting for it
        if entry.loaded.is_set() or entry.keep_if_first_load_fails:
            self.counters["failed"] += 1

    async def _evict(self, name: str, reason: str) -> None:
        with contextlib.suppress(RequestError):  # it went away meanwhile
            await self.unload(name, reason=reason)

    async def _expire_idle(self) -> None:
        """Unload models idle longer than their keep-alive (never pinned ones).

        Sleeps until the earliest deadline; a request starting or ending, or a
        model becoming ready, wakes it to recompute.
        """
        while True:
            self._idle_changed = anyio.Event()  # before the scan: no change is missed
            now = time.monotonic()
            next_deadline = math.inf
            for entry in list(self.entries.values()):
                deadline = entry.expires_at()
                if deadline is None:
                    continue
                if deadline <= now:
                    self.task_group.start_soon(contained, f"expire {entry.name}", self._expire,
                                               entry, name=f"expire {entry.name}")  # fmt: skip
                else:
                    next_deadline = min(next_deadline, deadline)
            with anyio.move_on_after(max(next_deadline - time.monotonic(), 0.0)):
                await self._idle_changed.wait()

    async def _expire(self, entry: ModelEntry) -> None:
        """Unload ``entry`` if it is still expired: a request may have come first."""
        now = time.monotonic()
        deadline = entry.expires_at()
        if deadline is None or deadline > now or self.entries.get(entry.name) is not entry:
            return
        # From the check to unload()'s stop_requested nothing yields: no request gets in.
        self.counters["expired"] += 1
        idle_s = round(now - entry.last_used, 1)
        await self._evict(entry.name, f"expired: idle {idle_s}s (keep_alive "
                                      f"{entry.keep_alive_s:g}s)")  # fmt: skip

    async def _run_runner(self, entry: ModelEntry) -> ExitInfo:
        """Start a runner for the entry, load the model, and wait for its end."""
        try:
            handle = await self._obtain_runner(entry.spec)
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
        spec = entry.spec
        faults = spec.env.get(FAULTS_ENV, "")
        max_tokens = spec.max_tokens or self.config.max_tokens
        engine = self.engine_settings(spec)
        entry.slots.total_tokens = engine.max_concurrent
        await handle.send(LoadModel(spec.name, spec.model, max_tokens, faults, entry.plan, engine))
        while True:
            event = await handle.next_event()
            if isinstance(event, LoadProgress):
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
                    self.idle_changed()
                entry.loaded.set()
                return
            elif isinstance(event, LoadFailed):
                entry.load_error = event.error
            else:
                entry.log.warning("unexpected_event", event_type=type(event).__name__)

    def engine_settings(self, spec: ModelConfig) -> EngineSettings:
        """The runner's engine settings for ``spec``: its own, else the daemon's."""
        config = self.config
        return EngineSettings(
            max_concurrent=spec.max_concurrent or config.max_concurrent,
            prefix_cache=spec.prefix_cache if spec.prefix_cache is not None
            else config.prefix_cache,
            prefix_cache_bytes=spec.prefix_cache_bytes,
            prefix_cache_entries=config.prefix_cache_entries,
            stream_interval_s=config.stream_interval_ms / 1000,
            batch_wait_share=config.batch_wait_share,
            next_turn_prefill=spec.next_turn_prefill if spec.next_turn_prefill is not None
            else config.next_turn_prefill,
            prefill_chunk_s=config.prefill_chunk_s,
        )  # fmt: skip

    async def clear_cache(self, name: str) -> CacheCleared:
        """Drop the named model's prefix cache; its runner stays loaded.

        Raises:
            RequestError: unknown model, or no runner ready to ask.
        """
        entry = self.get(name)
        handle = entry.handle
        if handle is None or not handle.alive or entry.state not in ("ready", "busy"):
            raise RequestError("not_ready", f"{name} is {entry.state}: it holds no cache")
        waiter = handle.expect(CacheCleared)
        try:
            await handle.send(ClearCache())
            with anyio.fail_after(self.config.decode_stall_s):
                event = await waiter.wait()
        except TimeoutError:
            raise RequestError("not_ready", f"{name} did not answer in time") from None
        except RunnerGone as gone:
            raise RequestError("runner_died", f"runner of {name} died: {gone.exit.cause}") from None
        finally:
            waiter.cancel()
        assert isinstance(event, CacheCleared)
        entry.log.info("prefix_cache_cleared", entries=event.entries, bytes=event.bytes)
        return event

    # --- generate ------------------------------------------------------------

    async def generate(
        self,
        request: GenerateRequest,
        emit: Emit,
        cancel: anyio.Event,
        on_queued: QueueListener | None = None,
    ) -> None:
        """Run one generation on the named model (see :meth:`_generate`), and
        count it in ``metrics``: its outcome, tokens and time to first text.

        Raises:
            RequestError: unknown model, timed out, runner died, or failed.
        """
        record = self.metrics.request(request.name if request.name in self.entries else None)

        async def emit_recorded(event: TextChunk | GenerationDone, body: bytes | None) -> None:
            record.observe(event)
            await emit(event, body)

        try:
            await self._generate(request, emit_recorded, cancel, on_queued)
        except RequestError as exc:
            record.finish(exc.code)
            raise
        finally:
            record.close()  # no end seen: it was cancelled

    async def _generate(
        self,
        request: GenerateRequest,
        emit: Emit,
        cancel: anyio.Event,
        on_queued: QueueListener | None = None,
    ) -> None:
        """Run one generation on the named model, passing each frame to ``emit``.

        Waits its turn behind earlier requests to the same model, and through
        a load or restart, up to ``queue_timeout_s``; ``on_queued`` hears its
        place in line while it waits. More than ``max_queue`` waiting: error
        ``busy`` at once. Setting ``cancel`` stops
        it within a few tokens. If the runner dies before the first token the
        request is retried once on the restarted runner (``retry_unstarted``);
        after that it fails with the cause. If ``emit`` fails (the client
        vanished) the generation is cancelled and drained.

        Raises:
            RequestError: unknown model, timed out, runner died, or failed.
        """
        if (request.prompt is None) == (request.messages is None):
            raise RequestError("bad_request", "give exactly one of prompt and messages")
        if request.sampling.max_tokens < 1:
            raise RequestError("bad_request", "max_tokens must be at least 1")
        stop = request.sampling.stop
        if len(stop) > MAX_STOP_STRINGS or not all(0 < len(s) <= MAX_STOP_CHARS for s in stop):
            raise RequestError("bad_request", f"stop takes up to {MAX_STOP_STRINGS} strings "
                               f"of 1 to {MAX_STOP_CHARS} characters")  # fmt: skip
        entry = self.get(request.name)
        try:
            await self._generate_with_retry(entry, request, emit, cancel, on_queued)
        finally:
            self.idle_changed()  # its turn and its place in line are given up

    async def _generate_with_retry(
        self,
        entry: ModelEntry,
        request: GenerateRequest,
        emit: Emit,
        cancel: anyio.Event,
        on_queued: QueueListener | None,
    ) -> None:
        streamed = [False]
        for attempt in (1, 2):
            try:
                await self._generate_once(entry, request, emit, cancel, streamed, on_queued)
                return
            except RunnerGone as gone:
                can_retry = (
                    attempt == 1
                    and self.config.retry_unstarted
                    and not streamed[0]
                    and not cancel.is_set()
                    # A group's step that raised ended the group: the same
                    # request would end it again (and spend its restarts).
                    and not ended_by_failed_step(gone.exit)
                )
                if not can_retry:
                    self.counters["requests_failed_runner_died"] += 1
                    raise RequestError(
                        "runner_died",
                        f"runner of {entry.name} died mid-request: {gone.exit.cause}",
                    ) from None
                self.counters["requests_retried"] += 1
                entry.log.warning("request_retried", cause=gone.exit.cause)

    async def _generate_once(
        self,
        entry: ModelEntry,
        request: GenerateRequest,
        emit: Emit,
        cancel: anyio.Event,
        streamed: list[bool],
        on_queued: QueueListener | None,
    ) -> None:
        deadline = anyio.current_time() + self.config.queue_timeout_s
        no_slot = entry.slots.borrowed_tokens >= entry.slots.total_tokens
        must_wait = no_slot or not entry.serving
        if must_wait and len(entry.waiters) >= self.config.max_queue:
            self.counters["requests_refused_busy"] += 1
            raise RequestError(
                "busy", f"{entry.name} has {len(entry.waiters)} requests waiting (max_queue)"
            )
        waiter = Waiter(on_queued)
        entry.waiters.append(waiter)
        if must_wait:
            entry.log.info("request_waiting", state=entry.state, position=len(entry.waiters))
            waiter.tell(len(entry.waiters))
        acquired = False

        async def take_turn() -> None:
            nonlocal acquired
            await entry.slots.acquire_on_behalf_of(waiter)
            acquired = True

        try:
            with anyio.move_on_at(deadline):
                await wait_unless(cancel, take_turn)
        except BaseException:
            if acquired:
                entry.slots.release_on_behalf_of(waiter)
            entry.leave_queue(waiter)
            raise
        if not acquired or cancel.is_set():
            if acquired:  # its turn came just as it was cancelled
                entry.slots.release_on_behalf_of(waiter)
            entry.leave_queue(waiter)
            if cancel.is_set():  # the client cancelled or left while in line
                entry.log.info("request_left_queue", waiting=len(entry.waiters))
                await self._end_cancelled_in_line(emit)
                return
            raise RequestError("not_ready", self._timeout_message(entry))
        try:
            ready: list[Runner] = []

            async def wait_ready() -> None:
                ready.append(await entry.wait_ready())

            try:
                with anyio.move_on_at(deadline):
                    while True:
                        ready.clear()
                        await wait_unless(cancel, wait_ready)
                        # Leaving wait_unless yields: an unload may have come in between.
                        if not ready or (entry.serving and entry.handle is ready[0]):
                            break
            finally:
                entry.leave_queue(waiter)
            if not ready:
                if cancel.is_set():  # the client cancelled or left while the model loads
                    await self._end_cancelled_in_line(emit)
                    return
                raise RequestError("not_ready", self._timeout_message(entry))
            handle = ready[0]
            await self._run_request(entry, handle, request, emit, cancel, streamed)
        finally:
            entry.slots.release_on_behalf_of(waiter)

    async def _end_cancelled_in_line(self, emit: Emit) -> None:
        with contextlib.suppress(ChannelClosed):
            await emit(GenerationDone(0, 0, 0, 0.0, 0.0, 0.0, 0, "cancelled"), None)

    def _timeout_message(self, entry: ModelEntry) -> str:
        return (
            f"timed out after {self.config.queue_timeout_s:g}s waiting for {entry.name} "
            f"({entry.state})"
        )

    async def _run_request(
        self,
        entry: ModelEntry,
        handle: Runner,
        request: GenerateRequest,
        emit: Emit,
        cancel: anyio.Event,
        streamed: list[bool],
    ) -> None:
        request_id = next(self._request_ids)
        entry.request_started()
        entry.touch()
        self.idle_changed()
        failure: RunnerGone | RequestError | None = None

        async def forward_cancel() -> None:
            await cancel.wait()
            with contextlib.suppress(RunnerGone):
                await handle.send(CancelCommand(request_id))

        ended = False
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(forward_cancel)
                try:
                    await self._stream(entry, handle, request, request_id, emit, cancel, streamed)
                    ended = True
                except (RunnerGone, RequestError) as exc:
                    ended, failure = True, exc
                finally:
                    tg.cancel_scope.cancel()
        finally:
            if not ended:  # we were cancelled mid-request: stop the runner working for no one
                with anyio.CancelScope(shield=True), contextlib.suppress(RunnerGone):
                    await handle.send(CancelCommand(request_id))
            entry.request_finished()
            entry.touch()
            self.idle_changed()
        if failure is not None:
            raise failure

    async def _stream(
        self,
        entry: ModelEntry,
        handle: Runner,
        request: GenerateRequest,
        request_id: int,
        emit: Emit,
        cancel: anyio.Event,
        streamed: list[bool],
    ) -> None:
        """Send the request and pass its frames on until it is done.

        Chunks go out as the runner framed them (no decoding and encoding
        again); when the client falls behind, the chunks that piled up go
        out as one.
        """
        stream = handle.open_request(request_id)
        try:
            command = Generate(
                request_id, request.prompt, request.messages, request.sampling, request.cache
            )
            await handle.send(command)
            client_gone = False
            held: tuple[RequestEvent, bytes] | None = None
            while True:
                event, body = held if held is not None else await stream.next()
                held = None
                if isinstance(event, GenerationFailed):
                    bad = event.invalid_request  # the request could not run: the caller's fault
                    raise RequestError("bad_request" if bad else "generation_failed", event.error)
                streamed[0] = True
                relayed: bytes | None = body
                if isinstance(event, TextChunk):
                    chunks = [event]
                    while (item := stream.next_nowait()) is not None:
                        if not isinstance(item[0], TextChunk):
                            held = item
                            break
                        chunks.append(item[0])
                    if len(chunks) > 1:  # the client fell behind: one frame for them all
                        text = "".join(chunk.text for chunk in chunks)
                        event = TextChunk(request_id, text, chunks[-1].generation_tokens)
                        relayed = None
                if not client_gone:
                    try:
                        await emit(event, relayed)
                    except (ChannelClosed, anyio.BrokenResourceError, OSError):
                        client_gone = True
                        cancel.set()
                        entry.log.info("client_gone", request_id=request_id)
                if isinstance(event, GenerationDone):
                    return
        finally:
            stream.close()

    # --- unload and shutdown -------------------------------------------------

    async def unload(self, name: str, reason: str = "unload") -> Unloaded:
        """Stop the named model's runner (escalating) and forget the model.

        Works in every state: a restart waiting in backoff is called off. Once
        begun it is not cut short (every step of the ladder is bounded), and
        the model is forgotten however it ends.

        Raises:
            RequestError: no such model.
        """
        entry = self.get(name)
        started = time.perf_counter()
        entry.stop_requested.set()
        entry.move("stopping")
        handle = entry.handle
        steps: list[str] = []
        try:
            with anyio.CancelScope(shield=True):
                if handle is not None and handle.alive:
                    with contextlib.suppress(Exception):  # a fresh "before" for the gate's log
                        await self.monitor.sample_async()
                    steps = await handle.escalate(reason)
                await entry.stopped.wait()
        finally:
            if not entry.stopped.is_set() and handle is not None:
                handle.signal(signal.SIGKILL)  # a bug cut the ladder short: no runner outlives it
            if self.entries.get(name) is entry:
                del self.entries[name]
                entry.forgotten.set()
            self.on_change()
        last_exit = entry.last_exit or ExitInfo(code=None, signal=None, cause="never started")
        pid = handle.pid if handle is not None and handle.pid is not None else 0
        elapsed_s = time.perf_counter() - started
        log.info("model_unloaded", model=name, runner_pid=pid, steps=steps, reason=reason,
                 elapsed_s=round(elapsed_s, 3))  # fmt: skip
        return Unloaded(name=name, pid=pid, steps=steps, elapsed_s=elapsed_s, exit=last_exit)

    async def shutdown(self) -> int:
        """Unload every model and stop the spare, in parallel. Returns the model count."""
        self.closing = True
        names = list(self.entries)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.spare.stop)
            for name in names:
                tg.start_soon(self._unload_quietly, name)
        return len(names)

    async def _unload_quietly(self, name: str) -> None:
        with contextlib.suppress(RequestError):  # it went away on its own meanwhile
            await self.unload(name, reason="daemon shutdown")

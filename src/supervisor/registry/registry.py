"""All supervised models, their runners and states, and the requests they serve.

Each model has a :class:`ModelEntry` and a supervising task (in the
registry's task group) that owns its runners one after another: start (from
the hot spare when it can), load, serve, and when the runner dies on its own,
restart per the model's restart strategy and intensity. Requests to one model
run one at a time, in arrival order (a fair lock); models serve in parallel.

:class:`Registry` is the face the fronts and the daemon see; the work is done
beside it: ``entries`` (a model's state and legal moves), ``processes``
(runner processes and the hot spare), ``admitting`` (admission, eviction,
keep-alive), ``supervision`` (runners one after another, restarts),
``requests`` (the queue and the relay) and ``specs`` (load requests merged
with the config, load on demand).
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections import Counter
from collections.abc import Callable

import anyio
import msgspec
import structlog
from anyio.abc import TaskGroup

from ipc.messages import (
    CacheCleared,
    ChatMessage,
    ChatOptions,
    Embeddings,
    EngineSettings,
    ExitInfo,
    GenerateRequest,
    Loaded,
    LoadRequest,
    RunnerInfo,
    SystemInfo,
    UnkillableRunner,
    Unloaded,
)
from supervisor.boundary import keep_running
from supervisor.config import ModelConfig, SupervisorConfig, spec_problem
from supervisor.events import EventHub
from supervisor.memory.admission import Admission
from supervisor.memory.monitor import MemoryMonitor, override_mb
from supervisor.metrics import Front, Metrics
from supervisor.registry.admitting import Admitter
from supervisor.registry.entries import (
    ModelEntry,
    ProgressListener,
    QueueListener,
    RequestError,
    entry_named,
    find_entry,
    refuse_if_removed,
)
from supervisor.registry.processes import RunnerProcesses
from supervisor.registry.requests import MAX_STOP_CHARS, MAX_STOP_STRINGS, Emit, RequestRelay
from supervisor.registry.specs import derive_name, engine_settings, merge_spec, on_demand_spec
from supervisor.registry.supervision import Supervision, restart_tracker
from supervisor.runners.handle import RunnerHandle

__all__ = [
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "ModelEntry",
    "Registry",
    "RequestError",
    "derive_name",
]

log = structlog.get_logger("supervisor.registry.registry")


class Registry:
    """The models the daemon supervises, by name.

    Args:
        config: the daemon config.
        task_group: where supervising tasks and runner processes live.
        on_change: called after any change worth persisting (runners, models).
        events: where what happens to the models is published (the daemon's
            hub; by default one of the registry's own).
    """

    def __init__(
        self,
        config: SupervisorConfig,
        task_group: TaskGroup,
        on_change: Callable[[], None] = lambda: None,
        events: EventHub | None = None,
    ) -> None:
        self.config = config
        self.events = events if events is not None else EventHub()
        self.task_group = task_group
        self.on_change = on_change
        self.entries: dict[str, ModelEntry] = {}
        self.closing = False
        self.counters: Counter[str] = Counter()
        self.live_handles: set[RunnerHandle] = set()
        self.monitor = MemoryMonitor(
            override_mb=override_mb(config.memory_override_mb),
            threshold_pct=config.pressure_threshold_pct,
            poll_s=config.memory_poll_s,
            footprint=self.runners_footprint,
            events=self.events,
        )
        self.admission = Admission(config, self.monitor, self.counters)
        self.processes = RunnerProcesses(
            config, task_group, self.live_handles, self.admission, self.counters, on_change
        )
        self.spare = self.processes.spare
        self.metrics = Metrics()  # every request, from the socket or HTTP, counts here
        self.admitter = Admitter(
            self.admission,
            self.spare,
            self.entries,
            task_group,
            self.counters,
            self._evict,
            metrics=self.metrics,
            events=self.events,
        )
        idle_changed = self.admitter.idle_changed
        self.supervision = Supervision(
            config,
            self.processes,
            self.admitter,
            self.monitor,
            self.counters,
            on_change=on_change,
            idle_changed=idle_changed,
            metrics=self.metrics,
            events=self.events,
        )
        self.requests = RequestRelay(
            config, self.entries, self.counters, self.metrics, idle_changed=idle_changed
        )

    def start_background(self) -> None:
        """Start the registry's own background work: the hot spare, the memory
        monitor and keep-alive expiry."""
        if self.config.hot_spare:
            self.task_group.start_soon(self.spare.keep, name="hot spare")
        tg = self.task_group
        tg.start_soon(keep_running, "memory monitor", self.monitor.run, name="memory monitor")
        tg.start_soon(keep_running, "keep-alive expiry", self.admitter.expire_idle,
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
        self.admitter.idle_changed()

    def get(self, name: str) -> ModelEntry:
        """The entry called ``name``. Raises RequestError(unknown_model)."""
        return entry_named(self.entries, name)

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

    async def spawn(self, handle: RunnerHandle) -> None:
        """Start ``handle``'s process in a task that owns it until it is reaped.

        Raises:
            RunnerStartError: it failed to start or to shake hands.
        """
        await self.processes.spawn(handle)

    def engine_settings(self, spec: ModelConfig) -> EngineSettings:
        """The runner's engine settings for ``spec``: its own, else the daemon's."""
        return engine_settings(self.config, spec)

    # --- load ----------------------------------------------------------------

    def spec_for(self, request: LoadRequest) -> ModelConfig:
        """Merge a load request with the config's settings for that name.

        Raises:
            RequestError: a value out of the config's ranges (bad_request); the
                spec is decoded as a config file's would be, so that nothing a
                request stores can make the state file unreadable (and checked
                as one when it is registered).
        """
        return merge_spec(self.config, request)

    async def load(self, spec: ModelConfig, on_progress: ProgressListener | None = None) -> Loaded:
        """Start supervising ``spec`` and wait until its model is ready.

        ``on_progress`` hears the load's progress until this call ends
        (a caller that leaves takes its listener with it).

        Raises:
            RequestError: the name is taken by a live model, the daemon is
                closing, or the first load failed (the message says why; a
                model whose first load fails is not restarted).
        """
        # Before the unload: a refused load changes nothing. In a worker thread:
        # a hostfile is read (on a slow disk too).
        problem = await anyio.to_thread.run_sync(spec_problem, spec)
        if problem:
            raise RequestError("bad_request", problem)
        old = self.entries.get(spec.name)
        if old is not None and old.state in ("crashed", "failed"):
            await self.unload(spec.name, reason="replaced by a new load")
        entry = self.register(spec, on_progress, places_checked=True)
        try:
            return await self.wait_loaded(entry)
        finally:
            if on_progress in entry.progress_listeners:
                entry.progress_listeners.remove(on_progress)

    def register(
        self,
        spec: ModelConfig,
        on_progress: ProgressListener | None = None,
        *,
        keep_if_first_load_fails: bool = False,
        places_checked: bool = False,
    ) -> ModelEntry:
        """Add ``spec`` and start its supervising task; returns at once.

        ``keep_if_first_load_fails`` (models restored at start): a failed
        first load leaves the model ``failed`` with the reason, in status and
        in the desired state, until an unload or a new load.
        ``places_checked``: the caller has checked the spec's hostfile just
        now (off the event loop): it is not read again here.

        Raises:
            RequestError: a spec :func:`spec_problem` refuses (bad_request), the
                name taken, or the daemon is closing.
        """
        if self.closing:
            raise RequestError("shutting_down", "the daemon is shutting down")
        # A restored model's hostfile may be missing for a moment at boot: its
        # load then fails and keeps it in status, failed with the reason.
        problem = spec_problem(spec, places=not (keep_if_first_load_fails or places_checked))
        if problem:
            raise RequestError("bad_request", problem)
        old = self.entries.get(spec.name)
        if old is not None:
            raise RequestError("already_loaded", f"{spec.name} is already loaded ({old.state})")
        entry = ModelEntry(spec, restart_tracker(self.config, spec), events=self.events)
        self.events.publish("model_state", spec.name, old=None, new=entry.state, pid=None)
        entry.keep_if_first_load_fails = keep_if_first_load_fails
        entry.keep_alive_s = (
            spec.keep_alive_s if spec.keep_alive_s is not None else self.config.keep_alive_s
        )
        if on_progress is not None:
            entry.progress_listeners.append(on_progress)
        self.entries[spec.name] = entry
        self.task_group.start_soon(self.supervision.supervise, entry, name=f"supervise {spec.name}")
        return entry

    def find(self, ref: str) -> ModelEntry | None:
        """The model named ``ref`` (by its name or an alias, its own or the
        config's), else the one model loaded from reference ``ref``."""
        entry = find_entry(self.entries, ref)
        if entry is not None:
            return entry
        configured = self.config.model_config(ref)
        if configured is not None and configured.name in self.entries:
            return self.entries[configured.name]
        matches = [e for e in list(self.entries.values()) if e.spec.model == ref]
        return matches[0] if len(matches) == 1 else None

    async def ensure_loaded(
        self, ref: str, on_progress: ProgressListener | None = None
    ) -> ModelEntry:
        """The model a client names by ``ref``, loaded on demand if need be.

        ``ref`` is a model's name or alias, or the reference (``builtin:tiny``, a
        path, a repo id) of a loaded or configured model. A configured model that
        is not loaded is loaded (``load_on_demand``, on by default); any other
        reference only with ``load_on_demand = "any"``. The load is a normal
        one (admission, eviction, progress to ``on_progress``, the same
        errors); requests for a model that is loading wait for the same load.
        Returns once the model's first load is decided: a model that is
        restarting or failed is returned as it is.

        Raises:
            RequestError: unknown_model (not loaded and not to be loaded on
                demand, or removed from the config by a reload), or the load's
                own error (load_failed, insufficient_memory, shutting_down,
                bad_request, ...).
        """
        entry = self.find(ref)
        if entry is not None:
            refuse_if_removed(entry)
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
        spec = on_demand_spec(self.config, ref, list(self.entries))
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

    async def clear_cache(self, name: str, disk_only: bool = False) -> CacheCleared:
        """Drop the named model's prefix cache, both tiers (``disk_only``: only
        the blocks on disk); its runner stays loaded.

        Raises:
            RequestError: unknown model, or no runner ready to ask.
        """
        return await self.requests.clear_cache(name, disk_only)

    def set_pinned(self, name: str, pinned: bool) -> ModelEntry:
        """Pin the named model (never evicted to make room, never expired) or
        unpin it. Its spec carries the pin, so the desired state keeps it
        across a daemon restart (until an unload, or a reload that sets it).

        Raises:
            RequestError: unknown model, or one being unloaded (not_ready).
        """
        entry = self.get(name)
        if entry.state == "stopping":
            raise RequestError("not_ready", f"{entry.name} is being unloaded")
        if entry.spec.pinned != pinned:
            entry.spec = msgspec.structs.replace(entry.spec, pinned=pinned)
            if entry.next_spec is not None:  # a reload's settings for its next load
                entry.next_spec = msgspec.structs.replace(entry.next_spec, pinned=pinned)
            entry.log.info("model_pinned" if pinned else "model_unpinned")
            self.events.publish("model_pinned" if pinned else "model_unpinned", entry.name)
            self.on_change()
            self.idle_changed()  # keep-alive: its deadline came or went
        return entry

    # --- generate ------------------------------------------------------------

    async def count_tokens(
        self,
        entry: ModelEntry,
        messages: list[ChatMessage] | None,
        prompt: str | None = None,
        chat: ChatOptions = ChatOptions(),  # noqa: B008 - frozen
    ) -> int:
        """How many prompt tokens these fields make on ``entry``'s model
        (see :meth:`RequestRelay.count_tokens`). Raises RequestError."""
        return await self.requests.count_tokens(entry, messages, prompt, chat)

    async def embed(
        self,
        entry: ModelEntry,
        inputs: list[str | list[int]],
        dimensions: int | None = None,
        truncate: bool = False,
    ) -> Embeddings:
        """The vectors of ``inputs`` from ``entry``'s embedding model (see
        :meth:`RequestRelay.embed`). Raises RequestError."""
        return await self.requests.embed(entry, inputs, dimensions, truncate)

    async def generate(
        self,
        request: GenerateRequest,
        emit: Emit,
        cancel: anyio.Event,
        on_queued: QueueListener | None = None,
        *,
        front: Front = "socket",
    ) -> None:
        """Run one generation on the named model, passing each frame to ``emit``
        (see :meth:`RequestRelay.generate`), and count it in ``metrics`` under
        ``front``, where it came in.

        Raises:
            RequestError: unknown model, timed out, runner died, or failed.
        """
        await self.requests.generate(request, emit, cancel, on_queued, front=front)

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
        name = entry.name  # ``name`` may be an alias
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
        self.events.publish("model_unloaded", name, pid=pid, steps=steps, reason=reason,
                            elapsed_s=round(elapsed_s, 3))  # fmt: skip
        return Unloaded(name=name, pid=pid, steps=steps, elapsed_s=elapsed_s, exit=last_exit)

    async def shutdown(self) -> int:
        """Unload every model and stop the spare, in parallel. Returns the model count."""
        self.closing = True
        self.spare.closing = True  # now, before its task can start a spare we would wait for
        names = list(self.entries)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.spare.stop)
            for name in names:
                tg.start_soon(self._unload_quietly, name)
        return len(names)

    async def _unload_quietly(self, name: str) -> None:
        with contextlib.suppress(RequestError):  # it went away on its own meanwhile
            await self.unload(name, reason="daemon shutdown")

    async def _evict(self, name: str, reason: str) -> bool:
        """Unload ``name`` to make room, or once it has expired; False when it
        had gone meanwhile (nothing was unloaded)."""
        try:
            await self.unload(name, reason=reason)
        except RequestError:  # it went away meanwhile
            return False
        return True

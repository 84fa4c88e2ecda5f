"""A supervised model's entry: its settings, its runner, its state and the
moves the lifecycle allows it, and the line of requests waiting for it.

The registry keeps one :class:`ModelEntry` per model, by name. Its state
changes only through :meth:`ModelEntry.move`, which refuses a move the
lifecycle does not allow (:data:`ALLOWED_MOVES`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog

from ipc.messages import (
    DraftStats,
    EngineStats,
    ErrorCode,
    ExitInfo,
    Loaded,
    LoadProgress,
    MemoryPlan,
    RunnerInfo,
    RunnerState,
)
from supervisor.adapters import adapter_list
from supervisor.config import ModelConfig
from supervisor.events import EventHub
from supervisor.memory.estimate import Estimate
from supervisor.registry.restart import RestartTracker
from supervisor.runners.group import RunnerGroup
from supervisor.runners.protocol import Runner
from supervisor.system import process_rss

log = structlog.get_logger("supervisor.registry.entries")

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

ProgressListener = Callable[[LoadProgress], None]
"""Told of load progress; must not block (a connection's mailbox)."""
QueueListener = Callable[[int], None]
"""Told a waiting request's place in line (1 = next); must not block."""


class RequestError(Exception):
    """A client request failed; ``code`` and the message go back to the client."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.message = message


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
    # The runner's own max_tokens cap, as it was loaded: a reload's new cap
    # (the model's or the daemon's) waits for the next load.
    max_tokens_cap: int | None = None
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
    # A reload's settings that wait for the model's next load (its runner's
    # shape: kv_bits, the reference, ...): they replace ``spec`` then.
    next_spec: ModelConfig | None = None
    # Dropped from the config by a reload: takes no new request, and is
    # unloaded once none is in flight or in line (keep-alive expiry does it).
    removed: bool = False
    events: EventHub = field(default_factory=EventHub)  # the registry's: each move is published

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
        """When keep-alive unloads this model if it stays idle (monotonic), or
        None. A model a reload removed expires as soon as no request is in
        flight or in line, whatever its state, pin and keep-alive."""
        if self.removed:
            in_use = self.slots.borrowed_tokens > 0 or self.waiters
            return None if in_use or self.stop_requested.is_set() else self.last_used
        if self.spec.pinned or self.keep_alive_s <= 0 or not self.evictable:
            return None
        return self.last_used + self.keep_alive_s

    def take_next_spec(self) -> None:
        """Before a load: the settings a reload left for it take effect."""
        if self.next_spec is not None:
            self.spec, self.next_spec = self.next_spec, None
            self.log.info("settings_applied_at_load")

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
        pid = self.handle.pid if self.handle is not None else None
        self.events.publish("model_state", self.name, old=self.state, new=new, pid=pid)
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
        kv_bits, kv_group_size = self._kv_quantization(engine)
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
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
            ranks=handle.rank_info() if isinstance(handle, RunnerGroup) else [],
            adapters=adapter_list(self.spec.adapters) if engine is None else list(engine.adapters),
            adapter_switches=engine.adapter_switches if engine is not None else 0,
            draft=self._draft(engine),
        )

    def _draft(self, engine: EngineStats | None) -> DraftStats | None:
        """The draft model as the runner reports it, else (no runner loaded) as the spec
        asks, with no counts yet; None without one."""
        if engine is not None:
            return engine.draft
        if self.spec.draft_model is None:
            return None
        return DraftStats(self.spec.draft_model, self.spec.num_draft_tokens)

    def _kv_quantization(self, engine: EngineStats | None) -> tuple[int | None, int | None]:
        """The KV cache's bits and group size: as the runner reports them, else (no runner
        loaded) as the spec asks; (None, None) for a cache in the model's dtype."""
        if engine is not None:
            return engine.kv_bits, engine.kv_group_size
        if self.spec.kv_bits is None:
            return None, None
        return self.spec.kv_bits, self.spec.kv_group_size


def find_entry(entries: dict[str, ModelEntry], name: str) -> ModelEntry | None:
    """The entry called ``name`` in ``entries``, by its name, else by one of
    its aliases; None if there is none. A model a reload removed keeps its
    name until it is unloaded, not its aliases: the new config may have
    given one to another model."""
    entry = entries.get(name)
    if entry is not None:
        return entry
    return next(
        (e for e in list(entries.values()) if not e.removed and name in e.spec.aliases), None
    )


def refuse_if_removed(entry: ModelEntry) -> None:
    """Refuse a new request for a model a reload removed from the config.

    Raises:
        RequestError: unknown_model, when ``entry`` is removed.
    """
    if entry.removed:
        raise RequestError("unknown_model", f"{entry.name} was removed from the config: it "
                           "takes no new requests, and unloads once its last ends")  # fmt: skip


def entry_named(entries: dict[str, ModelEntry], name: str) -> ModelEntry:
    """The entry called ``name`` (or aliased so) in ``entries``. Raises
    RequestError(unknown_model)."""
    entry = find_entry(entries, name)
    if entry is None:
        known = ", ".join(sorted(entries)) or "none loaded"
        raise RequestError("unknown_model", f"no model named {name!r} (loaded: {known})")
    return entry

"""All loaded models, their runners and states, and the requests they serve.

Each model has a :class:`ModelEntry`; its runner's tasks live in a task group
owned by the entry's supervising task, inside the registry's task group.
Requests to one model run one at a time, in arrival order (a fair lock);
different models serve in parallel.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import PurePath

import anyio
import structlog
from anyio.abc import TaskGroup

from ipc import ChannelClosed
from ipc.messages import Cancel as CancelCommand
from ipc.messages import (
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
    Ready,
    RunnerInfo,
    RunnerState,
    TextChunk,
    Unloaded,
)
from supervisor.config import ModelConfig, SupervisorConfig
from supervisor.runner_handle import RunnerGone, RunnerHandle, RunnerStartError
from supervisor.system import process_rss

log = structlog.get_logger("supervisor.registry")

# The moves a model's state may make (see ARCHITECTURE.md's lifecycle).
ALLOWED_MOVES: dict[RunnerState, set[RunnerState]] = {
    "starting": {"loading", "crashed", "stopping"},
    "loading": {"ready", "crashed", "stopping"},
    "ready": {"busy", "crashed", "stopping"},
    "busy": {"ready", "crashed", "stopping"},
    "stopping": set(),
    "crashed": {"stopping", "restarting"},
    "restarting": {"starting", "stopping", "failed"},
    "failed": {"stopping"},
}


class RequestError(Exception):
    """A client request failed; ``code`` and the message go back to the client."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.message = message


def derive_name(model: str) -> str:
    """Default model name: ``builtin:tiny`` -> ``tiny``; a path or repo id -> its last part."""
    if model.startswith("builtin:"):
        return model.removeprefix("builtin:")
    return PurePath(model.rstrip("/")).name or model


@dataclass(eq=False)
class ModelEntry:
    """One model: its settings, its current runner and what has happened to it."""

    spec: ModelConfig
    state: RunnerState = "starting"
    handle: RunnerHandle | None = None
    restarts: int = 0
    last_exit: ExitInfo | None = None
    param_bytes: int | None = None
    queued: int = 0
    request_lock: anyio.Lock = field(default_factory=anyio.Lock)
    loaded: anyio.Event = field(default_factory=anyio.Event)
    stopped: anyio.Event = field(default_factory=anyio.Event)
    load_result: Loaded | None = None
    load_error: str | None = None
    progress_listeners: list[Callable[[LoadProgress], Awaitable[None]]] = field(
        default_factory=list
    )

    @property
    def name(self) -> str:
        return self.spec.name

    def move(self, new: RunnerState) -> None:
        """Change state, refusing moves the lifecycle does not allow."""
        if new != self.state and new not in ALLOWED_MOVES[self.state]:
            raise RuntimeError(f"{self.name}: illegal state move {self.state} -> {new}")
        if new != self.state:
            log.debug("state", model=self.name, old=self.state, new=new)
            self.state = new

    def request_finished(self) -> None:
        """Back to ready after a request, unless the runner died or is stopping."""
        if self.state == "busy":
            self.move("ready")

    def info(self) -> RunnerInfo:
        handle = self.handle
        pid = handle.pid if handle is not None and handle.alive else None
        return RunnerInfo(
            name=self.name,
            model=self.spec.model,
            pid=pid,
            state=self.state,
            rss_bytes=process_rss(pid) if pid is not None else None,
            started_at=handle.started_at if handle is not None else None,
            restarts=self.restarts,
            last_exit=self.last_exit,
            param_bytes=self.param_bytes,
            queued=self.queued,
        )


class Registry:
    """The models the daemon supervises, by name.

    Args:
        config: the daemon config.
        task_group: where each model's supervising task runs.
    """

    def __init__(self, config: SupervisorConfig, task_group: TaskGroup) -> None:
        self.config = config
        self.task_group = task_group
        self.entries: dict[str, ModelEntry] = {}
        self.closing = False
        self._request_ids = itertools.count(1)

    def get(self, name: str) -> ModelEntry:
        """The entry called ``name``. Raises RequestError(unknown_model)."""
        entry = self.entries.get(name)
        if entry is None:
            known = ", ".join(sorted(self.entries)) or "none loaded"
            raise RequestError("unknown_model", f"no model named {name!r} (loaded: {known})")
        return entry

    def status(self) -> list[RunnerInfo]:
        return [entry.info() for entry in list(self.entries.values())]

    # --- load ----------------------------------------------------------------

    def spec_for(self, request: LoadRequest) -> ModelConfig:
        """Merge a load request with the config's settings for that name."""
        name = request.name or derive_name(request.model)
        configured = self.config.model_config(name)
        env = {**(configured.env if configured else {}), **request.env}
        max_tokens = request.max_tokens or (configured.max_tokens if configured else None)
        return ModelConfig(name=name, model=request.model, max_tokens=max_tokens, env=env)

    async def load(
        self,
        spec: ModelConfig,
        on_progress: Callable[[LoadProgress], Awaitable[None]] | None = None,
    ) -> Loaded:
        """Start a runner for ``spec`` and wait until its model is ready.

        Raises:
            RequestError: the name is taken by a live model, the daemon is
                closing, or the load failed (the message says why).
        """
        if self.closing:
            raise RequestError("shutting_down", "the daemon is shutting down")
        if not spec.name or "/" in spec.name:
            raise RequestError("bad_request", f"invalid model name {spec.name!r}")
        old = self.entries.get(spec.name)
        if old is not None:
            if old.state not in ("crashed", "failed"):
                raise RequestError("already_loaded", f"{spec.name} is already loaded ({old.state})")
            await self.unload(spec.name)
        entry = ModelEntry(spec=spec)
        if on_progress is not None:
            entry.progress_listeners.append(on_progress)
        self.entries[spec.name] = entry
        self.task_group.start_soon(self._supervise, entry, name=f"supervise {spec.name}")
        await entry.loaded.wait()
        if entry.load_result is None:
            if self.entries.get(spec.name) is entry:
                del self.entries[spec.name]
            raise RequestError("load_failed", entry.load_error or "load failed")
        return entry.load_result

    async def _supervise(self, entry: ModelEntry) -> None:
        """Own one runner from spawn to reap; record how it ended."""
        handle = RunnerHandle(entry.spec, self.config)
        entry.handle = handle
        try:
            async with anyio.create_task_group() as runner_tasks:
                try:
                    await handle.start(runner_tasks)
                    entry.move("loading")
                    await self._load_model(entry, handle)
                except RunnerStartError as exc:
                    entry.load_error = str(exc)
                except RunnerGone as gone:
                    entry.load_error = entry.load_error or f"runner died while loading: {gone}"
                finally:
                    entry.loaded.set()
                await handle.exited.wait()
        finally:
            entry.last_exit = handle.exit_info
            if entry.state != "stopping":
                entry.move("crashed")
            entry.stopped.set()

    async def _load_model(self, entry: ModelEntry, handle: RunnerHandle) -> None:
        spec = entry.spec
        await handle.send(LoadModel(spec.name, spec.model, spec.max_tokens))
        while True:
            event = await handle.next_event()
            if isinstance(event, LoadProgress):
                for listener in list(entry.progress_listeners):
                    try:
                        await listener(event)
                    except Exception:  # a vanished client must not stop the load
                        entry.progress_listeners.remove(listener)
            elif isinstance(event, Ready):
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
                    entry.move("ready")
                return
            elif isinstance(event, LoadFailed):
                entry.load_error = event.error
            else:
                log.warning("unexpected_event", model=spec.name, event=type(event).__name__)

    # --- generate ------------------------------------------------------------

    async def generate(
        self,
        request: GenerateRequest,
        emit: Callable[[TextChunk | GenerationDone], Awaitable[None]],
        cancel: anyio.Event,
    ) -> None:
        """Run one generation on the named model, passing each frame to ``emit``.

        Waits its turn behind earlier requests to the same model. Setting
        ``cancel`` stops it within a few tokens. If ``emit`` fails (the client
        vanished) the generation is cancelled and drained, so the runner is
        clean for the next request.

        Raises:
            RequestError: unknown model, not ready, runner died, or failed.
        """
        if (request.prompt is None) == (request.messages is None):
            raise RequestError("bad_request", "give exactly one of prompt and messages")
        if request.sampling.max_tokens < 1:
            raise RequestError("bad_request", "max_tokens must be at least 1")
        entry = self.get(request.name)
        entry.queued += 1
        try:
            await entry.request_lock.acquire()
        finally:
            entry.queued -= 1
        try:
            await self._generate_locked(entry, request, emit, cancel)
        finally:
            entry.request_lock.release()

    async def _generate_locked(
        self,
        entry: ModelEntry,
        request: GenerateRequest,
        emit: Callable[[TextChunk | GenerationDone], Awaitable[None]],
        cancel: anyio.Event,
    ) -> None:
        handle = entry.handle
        if entry.state != "ready" or handle is None:
            if entry.state in ("crashed", "failed") and entry.last_exit is not None:
                raise RequestError(
                    "runner_died", f"{entry.name} is {entry.state}: {entry.last_exit.cause}"
                )
            raise RequestError("not_ready", f"{entry.name} is {entry.state}")
        request_id = next(self._request_ids)
        entry.move("busy")
        failure: RunnerGone | RequestError | None = None

        async def forward_cancel() -> None:
            await cancel.wait()
            with contextlib.suppress(RunnerGone):
                await handle.send(CancelCommand(request_id))

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(forward_cancel)
                try:
                    await self._stream(entry, handle, request, request_id, emit, cancel)
                except (RunnerGone, RequestError) as exc:
                    failure = exc
                finally:
                    tg.cancel_scope.cancel()
        finally:
            entry.request_finished()
        if isinstance(failure, RunnerGone):
            raise RequestError(
                "runner_died", f"runner of {entry.name} died mid-request: {failure.exit.cause}"
            )
        if failure is not None:
            raise failure

    async def _stream(
        self,
        entry: ModelEntry,
        handle: RunnerHandle,
        request: GenerateRequest,
        request_id: int,
        emit: Callable[[TextChunk | GenerationDone], Awaitable[None]],
        cancel: anyio.Event,
    ) -> None:
        """Send the request and pass its frames on until it is done."""
        await handle.send(Generate(request_id, request.prompt, request.messages, request.sampling))
        client_gone = False
        while True:
            event = await handle.next_event()
            if isinstance(event, TextChunk | GenerationDone):
                if event.request_id != request_id:
                    continue  # a late frame of an earlier, abandoned request
                if not client_gone:
                    try:
                        await emit(event)
                    except (ChannelClosed, anyio.BrokenResourceError, OSError):
                        client_gone = True
                        cancel.set()
                        log.info("client_gone", model=entry.name, request_id=request_id)
                if isinstance(event, GenerationDone):
                    return
            elif isinstance(event, GenerationFailed) and event.request_id == request_id:
                raise RequestError("generation_failed", event.error)

    # --- unload and shutdown -------------------------------------------------

    async def unload(self, name: str, reason: str = "unload") -> Unloaded:
        """Stop the named model's runner (escalating) and forget the model.

        Raises:
            RequestError: no such model.
        """
        entry = self.get(name)
        handle = entry.handle
        started = time.perf_counter()
        if entry.state != "stopping":
            entry.move("stopping")
        steps: list[str] = []
        if handle is not None:
            steps = await handle.escalate_shutdown(reason)
            await entry.stopped.wait()
        if self.entries.get(name) is entry:
            del self.entries[name]
        last_exit = entry.last_exit or ExitInfo(code=None, signal=None, cause="never started")
        log.info(
            "model_unloaded",
            model=name,
            runner_pid=handle.pid if handle else None,
            steps=steps,
            elapsed_s=round(time.perf_counter() - started, 3),
        )
        return Unloaded(
            name=name,
            pid=(handle.pid or 0) if handle else 0,
            steps=steps,
            elapsed_s=time.perf_counter() - started,
            exit=last_exit,
        )

    async def shutdown(self) -> int:
        """Unload every model in parallel. Returns how many there were."""
        self.closing = True
        names = list(self.entries)
        async with anyio.create_task_group() as tg:
            for name in names:
                tg.start_soon(self._unload_quietly, name)
        return len(names)

    async def _unload_quietly(self, name: str) -> None:
        with contextlib.suppress(RequestError):  # it went away on its own meanwhile
            await self.unload(name, reason="daemon shutdown")

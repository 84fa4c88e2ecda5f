"""One runner child process: spawn, pipes, events, exit status, escalation.

The handle notices death at once: the pipe from the runner reaches EOF and
the process wait returns, both driven by the event loop, never by a poll.
Every path out of a handle's tasks reaps the child.

What it is made of lives beside it: the command line and pipes
(:mod:`~supervisor.runners.spawn`), the output relay
(:mod:`~supervisor.runners.relay`), the stall watchdog and pings
(:mod:`~supervisor.runners.watchdog`), request streams
(:mod:`~supervisor.runners.requests`), the kill ladder
(:mod:`~supervisor.runners.escalation`) and what an exit says
(:mod:`~supervisor.runners.exits`).
"""

from __future__ import annotations

import contextlib
import math
import select
import signal
import subprocess
import time
from collections import deque
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

import anyio
import msgspec
import structlog
from anyio.abc import Process, TaskGroup

from ipc import ChannelClosed, Codec, ProtocolError
from ipc.aio import AsyncChannel, FdStream
from ipc.messages import (
    CacheCleared,
    Embeddings,
    EngineReport,
    EngineStats,
    Environment,
    ExitAudit,
    ExitInfo,
    Heartbeat,
    LoadModel,
    LoadProgress,
    MemoryFigures,
    Pong,
    Ready,
    RunnerCommand,
    RunnerEvent,
    Shutdown,
    Started,
    TextChunk,
    TokenCount,
)
from supervisor import __version__
from supervisor.config import ModelConfig, SupervisorConfig
from supervisor.runners.escalation import Rung, Unwatched, escalate, signal_process
from supervisor.runners.exits import describe_exit
from supervisor.runners.relay import relay_output
from supervisor.runners.requests import (
    EventQueue,
    EventWaiter,
    RequestEvent,
    RequestRoutes,
    RequestStream,
    raise_gone,
)
from supervisor.runners.spawn import spawn_runner
from supervisor.runners.watchdog import StallWatchdog
from supervisor.system import process_create_time, process_rss, process_state

__all__ = ["RUNNER_LOGS", "RunnerHandle", "RunnerLogLine", "RunnerLogs", "RunnerStartError"]

RUNNER_LOG_LINES = 200  # lines the dashboard keeps of each model's runners
RUNNER_LOG_MODELS = 64  # models whose lines are kept (the one heard from longest ago goes first)


class RunnerStartError(Exception):
    """The runner could not be started or failed its handshake."""


class RunnerLogLine(msgspec.Struct, frozen=True):
    """One line a runner wrote on stderr: ``seq`` grows by one per line of the
    daemon (any model's), ``ts`` is unix time when the daemon read it."""

    seq: int
    ts: float
    model: str
    line: str


class RunnerLogs:
    """The last lines each model's runners wrote on stderr, by model name, for
    the dashboard. Unlike a handle's ``stderr_tail`` they outlive the runner:
    a restart keeps what the runner before it said. Each line also goes to the
    listeners (called on the event loop's thread: they must not block).

    Args:
        lines_per_model: lines kept of each model.
        models: models whose lines are kept; past it, the model heard from
            longest ago is forgotten.
        clock: unix time now.
    """

    def __init__(
        self,
        lines_per_model: int = RUNNER_LOG_LINES,
        models: int = RUNNER_LOG_MODELS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._lines_per_model = lines_per_model
        self._models = models
        self._clock = clock
        self._by_model: dict[str, deque[RunnerLogLine]] = {}
        self._recent: deque[RunnerLogLine] = deque(maxlen=lines_per_model * 4)
        self._listeners: list[Callable[[], None]] = []
        self.last_seq = 0

    def add(self, model: str, line: str) -> None:
        """Keep ``line`` as model ``model``'s latest, and tell the listeners."""
        self.last_seq += 1
        entry = RunnerLogLine(self.last_seq, self._clock(), model, line)
        lines = self._by_model.pop(model, None)  # re-inserted last: the most recently heard
        if lines is None:
            lines = deque(maxlen=self._lines_per_model)
            if len(self._by_model) >= self._models:
                del self._by_model[next(iter(self._by_model))]
        lines.append(entry)
        self._by_model[model] = lines
        self._recent.append(entry)
        for listener in list(self._listeners):
            try:
                listener()
            except Exception:  # a reader's fault is its own: never the runner's relay
                structlog.get_logger("supervisor.runner").exception("runner_log_listener_failed")
                self._listeners.remove(listener)

    def tail(self, model: str) -> list[RunnerLogLine]:
        """Model ``model``'s kept lines, oldest first (none for a model not heard from)."""
        return list(self._by_model.get(model, ()))

    def after(self, seq: int) -> tuple[list[RunnerLogLine], int]:
        """Every model's lines after ``seq``, oldest first, as far as the
        recent ones reach; and how many after ``seq`` are no longer held."""
        newer: list[RunnerLogLine] = []
        for entry in reversed(self._recent):
            if entry.seq <= seq:
                break
            newer.append(entry)
        newer.reverse()
        first = newer[0].seq if newer else self.last_seq + 1
        return newer, max(0, first - seq - 1)

    def listen(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener`` after each new line; returns what stops it."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None


RUNNER_LOGS: ContextVar[RunnerLogs | None] = ContextVar("runner_logs", default=None)
"""Where the handles made in this context record their runners' lines (the
daemon sets it before its task group starts, so every task it starts sees
it; unset, as in a registry made by a test, nothing is recorded)."""


class LoggedTail(deque[str]):
    """A handle's ``stderr_tail`` that also hands each line to ``record``."""

    def __init__(self, maxlen: int, record: Callable[[str], None]) -> None:
        super().__init__(maxlen=maxlen)
        self._record = record

    def append(self, line: str, /) -> None:
        super().append(line)
        self._record(line)


class RunnerHandle:
    """The supervisor's view of one runner process.

    Args:
        spec: the model this runner serves (name, model, env, caps).
        config: the daemon config (graces, frame limit, timeouts).
        rank: its rank, when it is one of a distributed group's processes.
        host: the machine to run it on through ssh (None: this one).
    """

    def __init__(
        self,
        spec: ModelConfig,
        config: SupervisorConfig,
        rank: int | None = None,
        host: str | None = None,
    ) -> None:
        self.spec = spec
        self.config = config
        self.process: Process | None = None
        self.channel: AsyncChannel[RunnerEvent] | None = None
        self.started_at: float | None = None
        self.started_monotonic = math.inf  # when spawned (time.monotonic())
        self.exited = anyio.Event()  # it ended, or SIGKILL could not end it (unkillable)
        self.reaped = anyio.Event()  # the process is gone: its memory is back
        self.unkillable = False  # SIGKILL did not end it in sigkill_wait_s
        self.exit_info: ExitInfo | None = None
        self.audit: ExitAudit | None = None
        self.stop_requested = False
        self.create_time: float | None = None
        self.warm = anyio.Event()  # mlx and mlx_lm imported (Started received)
        self.ready = anyio.Event()  # a model is loaded (Ready received)
        self.claimed = anyio.Event()  # a spare was handed a model
        self.kill_cause: str | None = None
        # What the runner is doing and when it last showed progress.
        self.watchdog = StallWatchdog(self, config)
        self._event_fd: int | None = None
        self.stderr_tail: deque[str] = deque(maxlen=config.runner_stderr_lines)
        logs = RUNNER_LOGS.get()
        if logs is not None:  # the daemon's dashboard keeps more, under the model's name
            self.stderr_tail = LoggedTail(config.runner_stderr_lines,
                                          lambda line: logs.add(self.spec.name, line))  # fmt: skip
        # Memory as last reported (pongs, heartbeats, load progress) and measured.
        self.memory = MemoryFigures()
        self.rss_bytes: int | None = None
        self.runtime_bytes = 0  # its footprint when it had imported mlx, before any model
        self._events = EventQueue(self)
        self._requests = RequestRoutes()  # in flight: the watchdog's phase follows from them
        self.engine_stats: EngineStats | None = None  # the runner's latest report
        self._waiters: list[EventWaiter] = []
        self.rank = rank
        self.host = host
        self.runner_pid: int | None = None  # as the runner's Hello said
        self.machine_memory = (0, 0)  # its machine's total and available bytes, once warm
        self.log: Any = structlog.get_logger("supervisor.runner").bind(model=spec.name)
        if rank is not None:
            self.log = self.log.bind(rank=rank)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def alive(self) -> bool:
        return self.process is not None and not self.exited.is_set()

    # --- start ---------------------------------------------------------------

    async def start(self, task_group: TaskGroup) -> None:
        """Spawn the runner, start its watcher tasks in ``task_group``, shake hands.

        Raises:
            RunnerStartError: the process could not start or failed the
                handshake (it is then killed and reaped).
        """
        try:
            spawned = await spawn_runner(self.spec, self.config, self.host)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            raise RunnerStartError(f"cannot start runner: {exc}") from exc
        self.process = spawned.process
        self.started_at = time.time()
        self.started_monotonic = time.monotonic()
        self.create_time = process_create_time(self.process.pid)
        self.log = self.log.bind(runner_pid=self.process.pid)
        self.log.info("runner_spawned", argv=spawned.argv[1:3], host=self.host)
        self.channel = AsyncChannel(
            FdStream(spawned.event_fd, spawned.command_fd),
            Codec(RunnerEvent, self.config.max_frame_bytes),
        )
        self._event_fd = spawned.event_fd
        assert self.process.stderr is not None
        self._start_guarded(task_group, relay_output, self, self.process.stderr, "stderr")
        if self.process.stdout is not None:
            self._start_guarded(task_group, relay_output, self, self.process.stdout, "stdout")
        task_group.start_soon(self._watch_exit)  # never raises: it must always report the exit
        try:
            with anyio.fail_after(self.config.handshake_timeout_s):
                if self.host is not None:  # its environment first, never on ssh's command line
                    await self.channel.send(Environment(dict(self.spec.env)))
                hello = await self.channel.handshake("supervisor", "runner", __version__)
        except (ProtocolError, ChannelClosed, TimeoutError) as exc:
            reason = str(exc) or type(exc).__name__
            with anyio.CancelScope(shield=True):
                await self.escalate(f"handshake failed: {reason}", first="sigkill")
                await self.channel.aclose()
            self._events.close()
            exit_info = self.exit_info
            detail = f" ({exit_info.cause})" if exit_info is not None else ""
            raise RunnerStartError(f"runner handshake failed: {reason}{detail}") from exc
        self.runner_pid = hello.pid  # over ssh: the remote process, not our ssh client
        self.watchdog.note_alive()
        self._start_guarded(task_group, self._pump_events)
        self._start_guarded(task_group, self.watchdog.watch_stalls)
        self._start_guarded(task_group, self.watchdog.watch_liveness)

    def _start_guarded(
        self, task_group: TaskGroup, func: Callable[..., Awaitable[None]], *args: Any
    ) -> None:
        """Start one of the handle's tasks as a fault boundary: a bug in it
        kills this runner (restart policy applies), never the daemon."""

        async def guarded() -> None:
            try:
                await func(*args)
            except Exception as exc:
                self.log.exception("runner_task_failed", task=func.__name__)
                self.kill_cause = self.kill_cause or f"supervisor error in {func.__name__}: {exc!r}"
                await self.escalate(self.kill_cause, first="sigkill")

        task_group.start_soon(guarded, name=f"{func.__name__} {self.spec.name}")

    def adopt(self, spec: ModelConfig) -> None:
        """Hand this (spare) runner to the model ``spec``."""
        self.spec = spec
        self.log = self.log.bind(model=spec.name)
        self.log.info("spare_adopted")
        self.claimed.set()

    # --- watching ------------------------------------------------------------

    async def _watch_exit(self) -> None:
        assert self.process is not None
        try:
            returncode = await self.process.wait()
        finally:
            if self.process.returncode is None:  # we are being cancelled: never leave it
                with anyio.CancelScope(shield=True):
                    await escalate(Unwatched(self.process, self.log), "runner task cancelled",
                                   first="sigkill", shutdown_grace_s=0, term_grace_s=0,
                                   sigkill_wait_s=self.config.sigkill_wait_s)  # fmt: skip
            for stream in (self.process.stdout, self.process.stderr):
                if stream is not None:  # the relays stop at EOF; their fds close here
                    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                        await stream.aclose()
            if self.process.returncode is not None:
                self.reaped.set()
        if self.unkillable:
            self.log.warning("unkillable_runner_reaped", code=returncode)
        self.mark_exited(returncode)

    def mark_exited(self, returncode: int | None, cause: str | None = None) -> None:
        """Record how the runner ended (once) and wake everyone waiting on it.

        ``returncode`` None means the supervisor gave up on its process task
        (``cause`` says why); the process itself is killed and reaped there.
        """
        if self.exited.is_set():
            return
        try:
            if returncode is None:
                self.exit_info = ExitInfo(None, None, cause or "runner task ended", None,
                                          list(self.stderr_tail), audit=self.audit)  # fmt: skip
            else:
                self.exit_info = describe_exit(
                    returncode, self.audit, list(self.stderr_tail), self.kill_cause
                )
        except Exception:  # describing an exit must never stop us reporting it
            self.log.exception("describe_exit_failed", returncode=returncode)
            self.exit_info = ExitInfo(returncode, None, cause or f"exit status {returncode}")
        level = "info" if self.stop_requested else "warning"
        getattr(self.log, level)(
            "runner_exited",
            code=self.exit_info.code,
            signal=self.exit_info.signal,
            cause=self.exit_info.cause,
            requested=self.stop_requested,
        )
        self.exited.set()
        self.watchdog.note_exit()

    async def _pump_events(self) -> None:
        """Forward runner events to ``next_event`` until the pipe closes."""
        assert self.channel is not None
        try:
            while True:
                try:
                    event, body = await self.channel.recv_with_body()
                except ChannelClosed:
                    break
                except ProtocolError as exc:
                    self.log.error("runner_protocol_error", error=str(exc), action="kill")
                    await self.escalate(f"protocol error: {exc}", first="sigkill")
                    break
                self.watchdog.note_alive()
                if isinstance(event, RequestEvent):
                    self._route(event, body)
                    continue
                self.watchdog.track(event)
                self._track_memory(event)
                if isinstance(event, Ready):
                    self.ready.set()
                if isinstance(event, ExitAudit):
                    self.audit = event
                    self.log.info(
                        "exit_audit",
                        cause=event.cause,
                        cause_class=event.cause_class,
                        active_bytes=event.active_bytes,
                        peak_bytes=event.peak_bytes,
                        cache_bytes=event.cache_bytes,
                        tokens_served=event.tokens_served,
                        requests_served=event.requests_served,
                    )
                elif isinstance(event, Started):
                    self.machine_memory = (event.memory_total_bytes, event.memory_available_bytes)
                    self.warm.set()
                    self.log.info("runner_warm", import_s=round(event.import_s, 3))
                elif isinstance(event, EngineReport):
                    self.engine_stats = event.engine
                elif isinstance(event, CacheCleared | TokenCount | Embeddings):
                    # answers to a command: to their waiter; unawaited, dropped
                    for waiter in [w for w in self._waiters if w.wants(event)]:
                        self._waiters.remove(waiter)
                        waiter.deliver(event)
                elif not isinstance(event, Pong | Heartbeat) and not self.unkillable:
                    self._events.put(event)
            await self.exited.wait()  # so RunnerGone can carry the exit status
        finally:
            self._end_delivery()
            with anyio.CancelScope(shield=True):
                await self.channel.aclose()

    def _end_delivery(self) -> None:
        """No more events or request frames: whoever waits on them hears the
        exit (RunnerGone) instead."""
        self._events.close()
        self._requests.end_all()

    def events_pending(self) -> bool:
        """Whether the runner has written frames we have not read yet."""
        if self._event_fd is None:
            return False
        try:
            return bool(select.select([self._event_fd], [], [], 0)[0])
        except (OSError, ValueError):  # closed: nothing more will come
            return False

    # --- memory ---------------------------------------------------------------

    def _track_memory(self, event: RunnerEvent) -> None:
        """Keep the runner's latest MLX figures, and its RSS on each pong."""
        if isinstance(event, Pong):
            self.memory = event.memory
            if event.engine is not None:
                self.engine_stats = event.engine
            self.measure_rss()
        elif isinstance(event, Started):  # the runtime before any model, as the runner read it
            self.memory = event.memory
            self.rss_bytes = event.rss_bytes or self.measure_rss()
            self.runtime_bytes = self.footprint_bytes
        elif isinstance(event, Heartbeat) and event.memory is not None:
            self.memory = event.memory
        elif isinstance(event, LoadProgress):
            self.memory = MemoryFigures(
                event.active_bytes, self.memory.cache_bytes, max(self.memory.peak_bytes,
                                                                 event.active_bytes)
            )  # fmt: skip
        elif isinstance(event, Ready):
            self.memory = MemoryFigures(event.active_bytes, self.memory.cache_bytes,
                                        event.peak_bytes)  # fmt: skip
            self.engine_stats = event.engine
            self.measure_rss()

    def measure_rss(self) -> int | None:
        """Read the process's RSS now (kept while it lives, for after its death)."""
        pid = self.pid
        if pid is not None and not self.exited.is_set():
            rss = process_rss(pid)
            if rss is not None:
                self.rss_bytes = rss
        return self.rss_bytes

    @property
    def footprint_bytes(self) -> int:
        """What this runner holds on this machine: its RSS or MLX's active +
        cache, the larger (a remote rank: nothing here)."""
        if self.host is not None:
            return 0
        mlx = self.memory.active_bytes + self.memory.cache_bytes
        return max(self.rss_bytes or 0, mlx)

    # --- phases and requests --------------------------------------------------

    def _route(self, event: RequestEvent, body: bytes) -> None:
        """A request's frame to its stream; a token is progress, the first one
        also the end of prefill; the last frame closes the request."""
        if self._requests.route(event, body):
            self.watchdog.set_phase(self._requests.phase())
        elif isinstance(event, TextChunk):
            self.watchdog.note_progress()
        else:
            self.close_request(event.request_id, end=False)

    def open_request(self, request_id: int) -> RequestStream:
        """Route the frames of ``request_id`` to a new stream (before sending it)."""
        stream = RequestStream(self, request_id)
        if self.exited.is_set():
            stream.end()
        self._requests.open(stream)
        self.watchdog.set_phase("prefill")
        return stream

    def follow_request(self, request_id: int) -> None:
        """Track ``request_id``'s phase without keeping its frames (a rank
        whose peer answers): the stall watchdog then times its prefill and
        decode as for a request it answers."""
        self._requests.follow(request_id)
        self.watchdog.set_phase("prefill")

    def close_request(self, request_id: int, *, end: bool = True) -> None:
        """Stop routing ``request_id``'s frames; the phase follows what is left."""
        stream = self._requests.close(request_id)
        if stream is not None and end:
            stream.end()
        if self.watchdog.phase in ("prefill", "decode"):
            self.watchdog.set_phase(self._requests.phase())

    # --- talking -------------------------------------------------------------

    async def send(self, command: RunnerCommand) -> None:
        """Send a command to the runner.

        Raises:
            RunnerGone: the runner has exited (or its pipe is closed).
        """
        assert self.channel is not None
        if isinstance(command, LoadModel):
            self.watchdog.set_phase("loading")
        try:
            await self.channel.send(command)
        except ChannelClosed:
            await raise_gone(self)

    def expect(self, kind: type[Any], request_id: int | None = None) -> EventWaiter:
        """Start waiting for the runner's next ``kind`` event (with
        ``request_id``, when given), before sending the command it answers."""
        waiter = EventWaiter(self, kind, self._waiters, request_id)
        self._waiters.append(waiter)
        return waiter

    async def next_event(self) -> RunnerEvent:
        """The runner's next event (load progress, chunks, results).

        Raises:
            RunnerGone: the runner exited; no more events will come.
        """
        return await self._events.next()

    def signal(self, signum: signal.Signals) -> None:
        """Send ``signum`` to the runner if it has not been reaped yet."""
        signal_process(self.process, signum)

    # --- stopping ------------------------------------------------------------

    async def escalate(
        self,
        reason: str,
        *,
        first: Rung = "shutdown",
        term_grace_s: float | None = None,
        shutdown_grace_s: float | None = None,
    ) -> list[str]:
        """The kill ladder (:func:`~supervisor.runners.escalation.escalate`):
        Shutdown message, join, SIGTERM, join, SIGKILL, reap.

        Unloads and daemon shutdown start at ``shutdown`` (a requested stop);
        the stall watchdog starts at ``sigterm`` with a short grace. The
        graces default to the config's. Returns the steps taken; when it
        returns the process has been reaped, or, the last step ``unkillable``,
        given up on (see :meth:`give_up`).
        """
        if first == "shutdown":
            self.stop_requested = True
        if shutdown_grace_s is None:
            shutdown_grace_s = self.config.shutdown_grace_s
        if term_grace_s is None:
            term_grace_s = self.config.term_grace_s
        return await escalate(self, reason, first=first, shutdown_grace_s=shutdown_grace_s,
                              term_grace_s=term_grace_s,
                              sigkill_wait_s=self.config.sigkill_wait_s)  # fmt: skip

    async def send_shutdown(self, reason: str) -> bool:
        """The ladder's first rung: ask the runner to exit. False when its pipe is closed."""
        if self.channel is None:
            return False
        try:
            await self.channel.send(Shutdown(reason))
        except ChannelClosed:
            return False
        return True

    async def give_up(self, elapsed_s: float) -> bool:
        """SIGKILL has not ended the process in ``sigkill_wait_s``: it sleeps
        uninterruptibly (a hung disk or network filesystem, a wedged driver)
        and ends when that does. Nothing waits on it any longer (its model, an
        unload, admission): its streams end, and our end of its command pipe
        closes (a send blocked on the full pipe would wait for good). It stays
        counted as holding its memory until it is reaped, whenever.

        Returns False, and gives up nothing, when it has ended after all: its
        exit was not seen because a child of its own holds its stdout or
        stderr open, and asyncio's wait waits for those too.
        """
        returncode = self.process.returncode if self.process is not None else None
        if returncode is not None:
            self.log.warning("runner_output_held_open", code=returncode,
                             note="a child of the runner holds its stdout or stderr")  # fmt: skip
            self.mark_exited(returncode)
            self.reaped.set()  # dead: its memory is back, whatever holds its pipes
            self._end_delivery()
            return False
        state = process_state(self.pid)
        cause = (f"unkillable: SIGKILL did not end pid {self.pid} in "
                 f"{self.config.sigkill_wait_s:g}s (process state: {state})")  # fmt: skip
        self.unkillable = True
        self.log.error("runner_unkillable", pid=self.pid, state=state, elapsed_s=elapsed_s,
                       rss_bytes=self.rss_bytes)  # fmt: skip
        self.mark_exited(None, cause)
        self._end_delivery()  # its pipe stays open while it lives: end its streams now
        if self.channel is not None:
            with contextlib.suppress(Exception):
                await self.channel.stream.send_eof()
        return True

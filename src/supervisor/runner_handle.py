"""One runner child process: spawn, pipes, events, exit status, escalation.

The handle notices death at once: the pipe from the runner reaches EOF and
the process wait returns, both driven by the event loop, never by a poll.
Every path out of a handle's tasks reaps the child.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import shlex
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

import anyio
import structlog
from anyio.abc import ByteReceiveStream, Process, TaskGroup

from ipc import AsyncChannel, ChannelClosed, Codec, FdStream, ProtocolError
from ipc.messages import (
    CacheCleared,
    EngineReport,
    EngineStats,
    Environment,
    ExitAudit,
    ExitInfo,
    GenerationDone,
    GenerationFailed,
    Heartbeat,
    LoadModel,
    LoadProgress,
    MemoryFigures,
    Ping,
    Pong,
    Ready,
    RunnerCommand,
    RunnerEvent,
    Shutdown,
    Started,
    TextChunk,
)
from supervisor import __version__
from supervisor.config import ModelConfig, SupervisorConfig
from supervisor.state import process_create_time
from supervisor.system import process_rss, process_state

if TYPE_CHECKING:
    from supervisor.runner_group import RunnerGroup

_LEVELS = {"debug", "info", "warning", "error", "critical"}
# Keys a relayed runner log record may not set as they are (ours, or structlog's).
_RESERVED_KEYS = {"source", "event", "level", "timestamp", "model", "runner_pid", "exc_info",
                  "stack_info", "self"}  # fmt: skip
MAX_LOG_LINE_BYTES = 64 * 1024
STALL_STEP_MULTIPLE = 3
"""A step the runner said would take S seconds is a stall only after this
many times S without progress (when that is longer than the phase's limit)..."""
STALL_STEP_CAP = 10
"""...but never after more than this many times the phase's limit: a runner
that states nonsense cannot turn the watchdog off."""
MAX_TAIL_LINE_CHARS = 500


class RunnerGone(Exception):
    """The runner process has exited; ``exit`` says how."""

    def __init__(self, exit: ExitInfo) -> None:
        super().__init__(exit.cause)
        self.exit = exit


RequestEvent = TextChunk | GenerationDone | GenerationFailed
"""What the runner sends about one request."""


class RequestStream:
    """The frames of one request in flight, as the runner sends them.

    Each item is the event and its frame's body as it came over the pipe
    (a relay can write it to a client as it is). Close it when done.

    A deque and one wake-up per wait: a frame costs the relay no checkpoint
    or cancel-scope walk (an anyio memory stream spent about a third of the
    daemon's CPU per relayed frame on those).
    """

    def __init__(self, handle: RunnerHandle, request_id: int) -> None:
        self.handle = handle
        # Whose exit ends the stream: the runner's, or its group's.
        self.owner: RunnerHandle | RunnerGroup = handle
        self.request_id = request_id
        self._items: deque[tuple[RequestEvent, bytes]] = deque()
        self._ended = False
        self._wakeup: anyio.Event | None = None

    async def next(self) -> tuple[RequestEvent, bytes]:
        """The request's next frame.

        Raises:
            RunnerGone: the runner exited; no more frames will come.
        """
        while not self._items:
            if self._ended:
                await self.owner.exited.wait()
                assert self.owner.exit_info is not None
                raise RunnerGone(self.owner.exit_info)
            self._wakeup = anyio.Event()
            await self._wakeup.wait()
        return self._items.popleft()

    def next_nowait(self) -> tuple[RequestEvent, bytes] | None:
        """The next frame if one is waiting, else None."""
        return self._items.popleft() if self._items else None

    def put(self, event: RequestEvent, body: bytes) -> None:
        if self._ended:
            return
        self._items.append((event, body))
        self._wake()

    def end(self) -> None:
        """No more frames (the runner is gone, or the request closed)."""
        self._ended = True
        self._wake()

    def close(self) -> None:
        self.handle.close_request(self.request_id)
        self._ended = True
        self._items.clear()
        self._wake()

    def _wake(self) -> None:
        wakeup, self._wakeup = self._wakeup, None
        if wakeup is not None:
            wakeup.set()


class EventWaiter:
    """Waits for the runner's next event of one type (an answer to a command)."""

    def __init__(self, handle: RunnerHandle, kind: type[Any]) -> None:
        self.handle = handle
        self.kind = kind
        self.event: RunnerEvent | None = None
        self._arrived = anyio.Event()

    def deliver(self, event: RunnerEvent) -> None:
        self.event = event
        self._arrived.set()

    async def wait(self) -> RunnerEvent:
        """The event.

        Raises:
            RunnerGone: the runner exited first.
        """
        async with anyio.create_task_group() as tg:

            async def exited() -> None:
                await self.handle.exited.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(exited)
            await self._arrived.wait()
            tg.cancel_scope.cancel()
        if self.event is None:
            assert self.handle.exit_info is not None
            raise RunnerGone(self.handle.exit_info)
        return self.event

    def cancel(self) -> None:
        with contextlib.suppress(ValueError):
            self.handle._waiters.remove(self)


class RunnerStartError(Exception):
    """The runner could not be started or failed its handshake."""


def signal_name(signum: int) -> str:
    """``SIGKILL``, ``SIGRTMIN+6`` for a realtime signal, else ``SIG40``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        pass
    rtmin = getattr(signal, "SIGRTMIN", None)
    rtmax = getattr(signal, "SIGRTMAX", None)
    if rtmin is not None and rtmax is not None and rtmin < signum <= rtmax:
        return f"SIGRTMIN+{signum - rtmin}"
    return f"SIG{signum}"


def describe_exit(
    returncode: int,
    audit: ExitAudit | None,
    stderr_tail: list[str],
    kill_cause: str | None = None,
) -> ExitInfo:
    """Build the ExitInfo of a reaped runner from its return code and last words.

    ``kill_cause`` is the supervisor's reason for killing it (a stall), which
    wins over the runner's own account.
    """
    tail = list(stderr_tail)
    if returncode < 0:
        name = signal_name(-returncode)
        cause = f"killed by {name}"
        if kill_cause:
            cause = f"{kill_cause} (killed by {name})"
        elif audit is not None:
            cause = f"{audit.cause} (then killed by {name})"
        try:
            description = signal.strsignal(-returncode)
        except ValueError:
            description = None
        return ExitInfo(None, name, cause, description, tail, audit=audit)
    if kill_cause:
        cause = f"{kill_cause} (exited with code {returncode})"
    elif audit is not None:
        cause = audit.cause
    else:
        cause = f"exited with code {returncode}"
        if returncode != 0 and tail:
            cause += f": {tail[-1][:200]}"
    return ExitInfo(returncode, None, cause, None, tail, audit=audit)


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
        # The stall watchdog's view: what the runner is doing and when it last
        # showed progress. Phases: starting, loading, idle, prefill, decode.
        self.phase = "starting"
        self.progress = 0
        self.last_progress_at = time.monotonic()
        self.last_alive_at = time.monotonic()  # any frame from the runner, pongs included
        # The runner's own estimate of its step under way, and the phase it was for.
        self.step: tuple[str, float] | None = None
        self.ping_unanswered_since: float | None = None  # the oldest ping with no frame after it
        self._event_fd: int | None = None
        self._phase_changed = anyio.Event()
        self._ping_seq = 0
        self.stderr_tail: deque[str] = deque(maxlen=config.runner_stderr_lines)
        # Memory as last reported (pongs, heartbeats, load progress) and measured.
        self.memory = MemoryFigures()
        self.rss_bytes: int | None = None
        self.runtime_bytes = 0  # its footprint when it had imported mlx, before any model
        self._events_in, self._events_out = anyio.create_memory_object_stream[RunnerEvent](
            max_buffer_size=math.inf
        )
        # Requests in flight: their frame streams, and whether each is still in
        # prefill (no token yet); the watchdog's phase follows from them.
        self._requests: dict[int, RequestStream] = {}
        self._followed: set[int] = set()  # requests tracked for the phase only
        self._prefilling: set[int] = set()
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
        command_r, command_w = os.pipe()
        try:
            event_r, event_w = os.pipe()
        except OSError as exc:
            os.close(command_r)
            os.close(command_w)
            raise RunnerStartError(f"cannot start runner: {exc}") from exc
        env = {**os.environ, **self.spec.env, "PYTHONUNBUFFERED": "1"}
        argv = [
            sys.executable, "-m", "runner",
            "--read-fd", str(command_r),
            "--write-fd", str(event_w),
            "--parent-pid", str(os.getpid()),
        ]  # fmt: skip
        # A remote rank's pipes are its ssh session's stdin and stdout.
        remote = self.host is not None
        if remote:
            argv = self._ssh_argv()
        try:
            self.process = await anyio.open_process(
                argv,
                stdin=command_r if remote else subprocess.DEVNULL,
                stdout=event_w if remote else subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=() if remote else (command_r, event_w),
                env=os.environ if remote else env,
                # Its own session: a terminal's SIGHUP or Ctrl-C to the daemon's
                # process group never reaches runners; the daemon decides.
                start_new_session=True,
            )
        except BaseException as exc:  # cancelled too: no fd may outlive a failed start
            for fd in (command_r, command_w, event_r, event_w):
                os.close(fd)
            if isinstance(exc, OSError | ValueError | subprocess.SubprocessError):
                raise RunnerStartError(f"cannot start runner: {exc}") from exc
            raise
        os.close(command_r)  # the child's ends
        os.close(event_w)
        self.started_at = time.time()
        self.started_monotonic = time.monotonic()
        self.create_time = process_create_time(self.process.pid)
        self.log = self.log.bind(runner_pid=self.process.pid)
        self.log.info("runner_spawned", argv=argv[1:3], host=self.host)
        self.channel = AsyncChannel(
            FdStream(event_r, command_w), Codec(RunnerEvent, self.config.max_frame_bytes)
        )
        self._event_fd = event_r
        assert self.process.stderr is not None
        self._start_guarded(task_group, self._relay_output, self.process.stderr, "stderr")
        if self.process.stdout is not None:
            self._start_guarded(task_group, self._relay_output, self.process.stdout, "stdout")
        task_group.start_soon(self._watch_exit)  # never raises: it must always report the exit
        try:
            with anyio.fail_after(self.config.handshake_timeout_s):
                if remote:  # its environment first, never on ssh's command line
                    await self.channel.send(Environment(dict(self.spec.env)))
                hello = await self.channel.handshake("supervisor", "runner", __version__)
        except (ProtocolError, ChannelClosed, TimeoutError) as exc:
            self.signal(signal.SIGKILL)
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(self.config.sigkill_wait_s):
                    await self.exited.wait()
                if not self.exited.is_set():
                    await self._give_up(self.config.sigkill_wait_s)
                await self.channel.aclose()
            self._events_in.close()
            reason = str(exc) or type(exc).__name__
            exit_info = self.exit_info
            detail = f" ({exit_info.cause})" if exit_info is not None else ""
            raise RunnerStartError(f"runner handshake failed: {reason}{detail}") from exc
        self.runner_pid = hello.pid  # over ssh: the remote process, not our ssh client
        self.last_alive_at = time.monotonic()
        self._start_guarded(task_group, self._pump_events)
        self._start_guarded(task_group, self._watch_stalls)
        self._start_guarded(task_group, self._watch_liveness)

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
                self.signal(signal.SIGKILL)

        task_group.start_soon(guarded, name=f"{func.__name__} {self.spec.name}")

    def _ssh_argv(self) -> list[str]:
        """``ssh HOST COMMAND`` for a rank on another machine, as ``mlx.launch``
        runs one: the same python and working directory as here (install
        mlx-supervisor alike on every machine). Frames travel on the session's
        stdin and stdout (the runner's fd 3); its own stdout goes to stderr.
        The model's environment goes as the first frame, not in this command
        line, which every user of either machine can read."""
        assert self.host is not None
        runner = [
            "env", "PYTHONUNBUFFERED=1", sys.executable, "-m", "runner",
            "--read-fd", "0", "--write-fd", "3", "--parent-pid", "0", "--env-first",
        ]  # fmt: skip
        command = f"cd {shlex.quote(os.getcwd())} && exec {shlex.join(runner)} 3>&1 1>&2"
        return [*self.config.ssh_command, "--", self.host, command]

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
                    self.signal(signal.SIGKILL)
                    with anyio.move_on_after(self.config.sigkill_wait_s):
                        await self.process.wait()
                if self.process.returncode is None:  # the daemon is stopping: init reaps it
                    self.log.error("runner_left_unkillable", pid=self.process.pid,
                                   waited_s=self.config.sigkill_wait_s)  # fmt: skip
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
        self._phase_changed.set()  # wake the stall watchdog so it sees the exit

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
                    self.signal(signal.SIGKILL)
                    break
                self.last_alive_at = time.monotonic()
                self.ping_unanswered_since = None
                if isinstance(event, TextChunk | GenerationDone | GenerationFailed):
                    stream = self._requests.get(event.request_id)
                    if stream is not None:  # else a late frame of an abandoned request
                        stream.put(event, body)
                    self._track_progress(event)
                    continue
                self._track_progress(event)
                self._track_memory(event)
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
                elif isinstance(event, CacheCleared):
                    for waiter in [w for w in self._waiters if isinstance(event, w.kind)]:
                        self._waiters.remove(waiter)
                        waiter.deliver(event)
                elif not isinstance(event, Pong | Heartbeat) and not self.unkillable:
                    self._events_in.send_nowait(event)
            await self.exited.wait()  # so RunnerGone can carry the exit status
        finally:
            self._end_delivery()
            with anyio.CancelScope(shield=True):
                await self.channel.aclose()

    def _end_delivery(self) -> None:
        """No more events or request frames: whoever waits on them hears the
        exit (RunnerGone) instead."""
        self._events_in.close()
        for stream in self._requests.values():
            stream.end()

    async def _relay_output(self, stream: ByteReceiveStream, source: str) -> None:
        """Re-log the runner's stdout/stderr lines with its model name and pid.

        A line longer than ``MAX_LOG_LINE_BYTES`` is cut there: a runner
        printing without newlines cannot grow the daemon's memory.
        """
        pending = b""
        async for chunk in stream:
            pending += chunk
            *lines, pending = pending.split(b"\n")
            if len(pending) > MAX_LOG_LINE_BYTES:
                lines.append(pending[:MAX_LOG_LINE_BYTES])
                pending = b""
            for line in lines:
                self._relay_line(line[:MAX_LOG_LINE_BYTES], source)
        if pending:
            self._relay_line(pending, source)

    def _relay_line(self, raw: bytes, source: str) -> None:
        text = raw.decode("utf-8", "replace").rstrip()
        if not text:
            return
        if source == "stderr":
            self.stderr_tail.append(text[:MAX_TAIL_LINE_CHARS])  # it travels in status replies
        try:
            record = json.loads(text)
        except ValueError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("event"), str):
            event = record.pop("event")
            level = str(record.pop("level", "info"))
            for key in ("timestamp", "model", "runner_pid"):
                record.pop(key, None)
            # The runner's own keys never clash with ours: prefix any that would.
            fields = {
                (f"runner_{key}" if key in _RESERVED_KEYS else key): value
                for key, value in record.items()
            }
            log_method = getattr(self.log, level if level in _LEVELS else "info")
            log_method(event, source="runner", **fields)
        else:
            self.log.info("runner_output", stream=source, line=text)

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

    # --- the stall watchdog --------------------------------------------------

    def _set_phase(self, phase: str) -> None:
        self.phase = phase
        self._note_progress()
        self._phase_changed.set()  # the watchdog recomputes its deadline

    def note_progress_elsewhere(self) -> None:
        """Another rank of this runner's group made load progress: the
        group's load is moving, though this rank waits silently for it."""
        self._note_progress()

    def _note_progress(self) -> None:
        # Per token: a counter and a timestamp, no wake-up (the watchdog reads them).
        self.progress += 1
        self.last_progress_at = time.monotonic()

    def _track_progress(self, event: RunnerEvent) -> None:
        """Every event is progress; some also move the phase."""
        if isinstance(event, TextChunk):
            if event.request_id in self._prefilling:
                self._prefilling.discard(event.request_id)
                self._set_phase(self._request_phase())
            else:
                self._note_progress()
        elif isinstance(event, GenerationDone | GenerationFailed):
            self._prefilling.discard(event.request_id)
            self.close_request(event.request_id, end=False)
        elif isinstance(event, Started) and self.phase == "starting":
            self._set_phase("idle")
        elif isinstance(event, Ready):
            self._set_phase("idle")
            self.ready.set()
        elif isinstance(event, LoadProgress) and event.phase == "join":
            # Joining a distributed group holds the runner's GIL: no pings
            # are answered until it is done, and the join has its own limit.
            self._set_phase("joining" if event.done < event.total else "loading")
        elif isinstance(event, Heartbeat):
            self.step = None if event.step_s is None else (event.phase, event.step_s)
            self._note_progress()
        elif isinstance(event, LoadProgress):
            self._note_progress()

    def _request_phase(self) -> str:
        """idle with no request in flight; prefill while one waits for its
        first token (the longer timeout); else decode."""
        if not self._requests and not self._followed:
            return "idle"
        return "prefill" if self._prefilling else "decode"

    def open_request(self, request_id: int) -> RequestStream:
        """Route the frames of ``request_id`` to a new stream (before sending it)."""
        stream = RequestStream(self, request_id)
        if self.exited.is_set():
            stream.end()
        self._requests[request_id] = stream
        self._prefilling.add(request_id)
        self._set_phase("prefill")
        return stream

    def follow_request(self, request_id: int) -> None:
        """Track ``request_id``'s phase without keeping its frames (a rank
        whose peer answers): the stall watchdog then times its prefill and
        decode as for a request it answers."""
        self._followed.add(request_id)
        self._prefilling.add(request_id)
        self._set_phase("prefill")

    def close_request(self, request_id: int, *, end: bool = True) -> None:
        """Stop routing ``request_id``'s frames; the phase follows what is left."""
        stream = self._requests.pop(request_id, None)
        self._followed.discard(request_id)
        self._prefilling.discard(request_id)
        if stream is not None and end:
            stream.end()
        if self.phase in ("prefill", "decode"):
            self._set_phase(self._request_phase())

    def stall_timeout_s(self) -> float:
        """How long the current phase may go without progress (idle: forever;
        liveness is the pings' job): the phase's limit, or a multiple of the
        time the runner said its step would take, the longer."""
        config = self.config
        limit = {
            "starting": config.load_stall_s,
            "loading": config.load_stall_s,
            "joining": config.group_join_s,
            "idle": math.inf,
            "prefill": config.prefill_stall_s,
            "decode": config.decode_stall_s,
        }[self.phase]
        if self.step is not None and self.step[0] == self.phase:  # a prefill's, or a decode's
            stated = min(STALL_STEP_MULTIPLE * self.step[1], STALL_STEP_CAP * limit)
            return max(limit, stated)
        return limit

    async def _watch_stalls(self) -> None:
        """Kill the runner when its phase goes without progress for too long.

        Catches hangs that leave the process answering pings (a blocked
        ``mx.eval`` releases the GIL). Sleeps until the last progress plus
        the phase's timeout; progress only moves that deadline, and a phase
        change (whose timeout may be shorter) wakes it early.
        """
        while not self.exited.is_set():
            timeout = self.stall_timeout_s()
            remaining = self.last_progress_at + timeout - time.monotonic()
            if remaining > 0:
                self._phase_changed = anyio.Event()
                with anyio.move_on_after(remaining):
                    await self._phase_changed.wait()
                continue
            if self.stop_requested:
                return
            if self._events_pending():  # progress may be waiting in the pipe: read it first
                await anyio.sleep(0)
                continue
            await self.kill_stalled(f"stalled in {self.phase}: no progress for {timeout:g}s")
            return

    async def _watch_liveness(self) -> None:
        """Kill a frozen runner in any phase: one that sends nothing, not even
        a Pong, for ``ping_timeout_s`` (SIGSTOP, a deadlock holding the GIL).

        The runner's pipe-reader thread answers pings whatever its main thread
        is doing; pings go out from a separate task, since a frozen runner's
        full pipe would block a send.
        """
        timeout = self.config.ping_timeout_s
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._send_pings)
            while not self.exited.is_set() and not self.stop_requested:
                since = self.ping_unanswered_since
                waited_s = time.monotonic() - since if since is not None else 0.0
                if waited_s > timeout and self.phase != "joining":
                    if self._events_pending():  # it did answer; our loop was busy or paused
                        await anyio.sleep(0)
                        continue
                    await self.kill_stalled(
                        f"frozen in {self.phase}: no answer to pings for {waited_s:.1f}s"
                    )
                    break
                interval_s = self.config.ping_interval_s
                next_check_s = timeout - waited_s if since is not None else interval_s
                if self.phase == "joining":  # the stall watchdog has this phase
                    next_check_s = interval_s
                with anyio.move_on_after(next_check_s + 0.01):
                    await self.exited.wait()
            tg.cancel_scope.cancel()

    def _events_pending(self) -> bool:
        """Whether the runner has written frames we have not read yet."""
        if self._event_fd is None:
            return False
        try:
            return bool(select.select([self._event_fd], [], [], 0)[0])
        except (OSError, ValueError):  # closed: nothing more will come
            return False

    async def _send_pings(self) -> None:
        assert self.channel is not None
        while not self.exited.is_set():
            with anyio.move_on_after(self.config.ping_interval_s):  # the ping period
                await self.exited.wait()
            if self.exited.is_set() or self.stop_requested:
                return
            if self.ping_unanswered_since is None:
                self.ping_unanswered_since = time.monotonic()
            self._ping_seq += 1
            try:
                with anyio.CancelScope(shield=True):  # never cut a frame in half
                    await self.channel.send(Ping(self._ping_seq))
            except ChannelClosed:
                return

    async def kill_stalled(self, reason: str) -> None:
        """Kill a hung runner from the outside: SIGTERM, a short grace, SIGKILL.

        A hung ``mx.eval`` cannot be interrupted from inside; SIGKILL can, but
        for a process in uninterruptible sleep (see :meth:`_give_up`).
        """
        self.kill_cause = reason
        self.log.error(
            "runner_stalled",
            reason=reason,
            phase=self.phase,
            progress=self.progress,
            since_progress_s=round(time.monotonic() - self.last_progress_at, 3),
            since_alive_s=round(time.monotonic() - self.last_alive_at, 3),
        )
        await self.escalate(reason, first="sigterm", term_grace_s=self.config.stall_kill_grace_s)

    # --- talking -------------------------------------------------------------

    async def send(self, command: RunnerCommand) -> None:
        """Send a command to the runner.

        Raises:
            RunnerGone: the runner has exited (or its pipe is closed).
        """
        assert self.channel is not None
        if isinstance(command, LoadModel):
            self._set_phase("loading")
        try:
            await self.channel.send(command)
        except ChannelClosed:
            await self.exited.wait()
            assert self.exit_info is not None
            raise RunnerGone(self.exit_info) from None

    def expect(self, kind: type[Any]) -> EventWaiter:
        """Start waiting for the runner's next ``kind`` event (before sending
        the command it answers)."""
        waiter = EventWaiter(self, kind)
        self._waiters.append(waiter)
        return waiter

    async def next_event(self) -> RunnerEvent:
        """The runner's next event (load progress, chunks, results).

        Raises:
            RunnerGone: the runner exited; no more events will come.
        """
        try:
            return await self._events_out.receive()
        except anyio.EndOfStream:
            await self.exited.wait()
            assert self.exit_info is not None
            raise RunnerGone(self.exit_info) from None

    def signal(self, signum: signal.Signals) -> None:
        """Send ``signum`` to the runner if it has not been reaped yet."""
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signum)

    # --- stopping ------------------------------------------------------------

    async def escalate(
        self,
        reason: str,
        *,
        first: Literal["shutdown", "sigterm", "sigkill"] = "shutdown",
        term_grace_s: float | None = None,
        shutdown_grace_s: float | None = None,
    ) -> list[str]:
        """The kill ladder: Shutdown message, join, SIGTERM, join, SIGKILL, reap.

        Unloads and daemon shutdown start at ``shutdown`` (a requested stop);
        the stall watchdog starts at ``sigterm`` with a short grace. Waits
        ``shutdown_grace_s`` after the message, ``term_grace_s`` after
        SIGTERM (defaults: the config's) and ``sigkill_wait_s`` after SIGKILL.
        Returns the steps taken; when it returns the process has been reaped,
        or, the last step ``unkillable``, given up on (see :meth:`_give_up`).
        """
        if first == "shutdown":
            self.stop_requested = True
        term_grace_s = self.config.term_grace_s if term_grace_s is None else term_grace_s
        if shutdown_grace_s is None:
            shutdown_grace_s = self.config.shutdown_grace_s
        steps: list[str] = []
        started = time.perf_counter()

        def elapsed() -> float:
            return round(time.perf_counter() - started, 3)

        if first == "shutdown" and not self.exited.is_set() and self.channel is not None:
            with anyio.move_on_after(shutdown_grace_s):
                try:
                    await self.channel.send(Shutdown(reason))
                    steps.append("shutdown")
                    self.log.info("escalate_shutdown_sent", reason=reason)
                except ChannelClosed:
                    pass
                await self.exited.wait()
        if first != "sigkill" and not self.exited.is_set():
            steps.append("sigterm")
            self.log.warning("escalate_sigterm", reason=reason, elapsed_s=elapsed())
            self.signal(signal.SIGTERM)
            with anyio.move_on_after(term_grace_s):
                await self.exited.wait()
        if not self.exited.is_set():
            steps.append("sigkill")
            self.log.warning("escalate_sigkill", reason=reason, elapsed_s=elapsed())
            self.signal(signal.SIGKILL)
            with anyio.move_on_after(self.config.sigkill_wait_s):
                await self.exited.wait()
        if not self.exited.is_set() and await self._give_up(elapsed()):
            steps.append("unkillable")
            return steps
        self.log.info("runner_reaped", steps=steps, elapsed_s=elapsed())
        return steps

    async def _give_up(self, elapsed_s: float) -> bool:
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

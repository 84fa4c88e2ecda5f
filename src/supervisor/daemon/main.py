"""The daemon: claims the socket, owns the registry, stops cleanly on signals."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import signal
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
import structlog
from anyio.abc import SocketListener, SocketStream, TaskGroup, TaskStatus

from ipc.messages import ReloadReply
from supervisor import __version__
from supervisor.boundary import keep_running, retry_delay_s
from supervisor.config import ModelConfig, SupervisorConfig, parse_listen
from supervisor.daemon.reload import Reloader
from supervisor.daemon.state import (
    DaemonState,
    RunnerRecord,
    StateFile,
    kill_leftover_runners,
    state_path,
)
from supervisor.events import EventHub
from supervisor.fronts.control import ControlServer, claim_socket
from supervisor.fronts.http.server import HttpFront
from supervisor.registry.registry import Registry, RequestError
from supervisor.runners.handle import RUNNER_LOGS, RunnerLogs
from supervisor.system import signal_name

log = structlog.get_logger("supervisor.daemon.main")


class Daemon:
    """One running supervisor: socket, registry, shutdown.

    Args:
        config: the daemon config.
        socket_path: where to listen.
        config_path: the file ``config`` was read from, which a reload reads
            again (None: no file, and a reload is refused).
        http_flag: ``serve --http``, which a reload keeps over the file's.
    """

    def __init__(
        self,
        config: SupervisorConfig,
        socket_path: Path,
        config_path: Path | None = None,
        http_flag: str | None = None,
    ) -> None:
        self.config = config
        self.socket_path = socket_path
        self.config_path = config_path
        self.http_flag = http_flag
        self.reloader: Reloader | None = None
        self._shutdown_started = False
        self._shutdown_done = anyio.Event()
        self._exit = anyio.Event()
        self._stopped_runners = 0
        self.registry: Registry | None = None
        self.events = EventHub()  # what happens to the models, for /admin/events
        self.runner_logs = RunnerLogs()  # what the runners wrote, for the dashboard
        self.state_file = StateFile(state_path(socket_path))
        self._desired_models: list[ModelConfig] = []

    async def shutdown(self) -> int:
        """Stop every runner (escalating, in parallel); idempotent.

        Returns the number of runners stopped.
        """
        if self._shutdown_started:
            await self._shutdown_done.wait()
            return self._stopped_runners
        self._shutdown_started = True
        log.info("daemon_shutting_down")
        self.events.publish("daemon_stopping", pid=os.getpid())
        assert self.registry is not None
        self._stopped_runners = await self.registry.shutdown()
        self._shutdown_done.set()
        return self._stopped_runners

    async def _shutdown_then_exit(self) -> None:
        try:
            await self.shutdown()
        finally:  # whatever happened, a signal to stop stops us
            self._exit.set()

    async def run(self) -> None:
        """Serve until SIGTERM, SIGINT or a shutdown request; then clean up.
        SIGHUP reloads the config file.

        Raises:
            DaemonAlreadyRunning: another daemon owns the socket.
        """
        listener = await claim_socket(self.socket_path)
        socket_inode = os.stat(self.socket_path).st_ino
        previous = self.state_file.load()
        killed = kill_leftover_runners(previous.runners)
        if killed:
            log.warning("predecessor_runners_killed", pids=killed, predecessor=previous.daemon_pid)
        self._desired_models = list(previous.models)
        RUNNER_LOGS.set(self.runner_logs)  # every runner handle made below records its lines
        try:
            async with anyio.create_task_group() as tg:
                self.registry = Registry(self.config, tg, on_change=self._save_state,
                                         events=self.events)  # fmt: skip
                self.registry.start_background()
                self.reloader = Reloader(self.config, self.config_path, self.registry,
                                         self._load_at_start, self.http_flag)  # fmt: skip
                for spec in self._models_at_start(previous):
                    tg.start_soon(self._load_at_start, spec)
                server = ControlServer(
                    self.registry, self.config, self.socket_path, self.shutdown, self._exit.set,
                    reload=self.reload,
                )  # fmt: skip
                await tg.start(self._watch_signals)  # before we say we serve
                http = await self._start_http(tg, server)
                tg.start_soon(serve_connections, listener, server.handle_connection)
                log.info("daemon_started", pid=os.getpid(), version=__version__,
                         socket=str(self.socket_path), http=server.http_url())  # fmt: skip
                self.events.publish("daemon_started", pid=os.getpid(), version=__version__)
                await self._exit.wait()
                self.events.close()  # event streams end, so the HTTP front stops at once
                if http is not None:
                    await http.stop()
                tg.cancel_scope.cancel()
        finally:
            with contextlib.suppress(OSError):
                await listener.aclose()
            with contextlib.suppress(OSError):
                if os.stat(self.socket_path).st_ino == socket_inode:
                    self.socket_path.unlink()
            log.info("daemon_stopped", pid=os.getpid())

    async def reload(self) -> ReloadReply:
        """Read the config file again and apply it (see
        :class:`~supervisor.daemon.reload.Reloader`); never raises. The socket's
        ``reload``, SIGHUP and ``POST /admin/reload`` call it."""
        if self.reloader is None:  # not serving yet
            return ReloadReply(ok=False, error="the daemon is starting: try again")
        return await self.reloader.reload()

    async def _reload_on_signal(self) -> None:
        """SIGHUP: reload; the outcome is in the log (config_reloaded or
        config_reload_refused). A fault boundary: a bug ends here, logged."""
        try:
            await self.reload()
        except Exception:
            log.exception("config_reload_failed")

    async def _start_http(self, tg: TaskGroup, server: ControlServer) -> HttpFront | None:
        """Start the HTTP front in ``tg`` unless ``http_listen`` is off. An
        address that cannot be had is logged, and the socket serves on alone."""
        listen = parse_listen(self.config.http_listen)
        if listen is None:
            return None
        assert self.registry is not None
        front = HttpFront(self.registry, self.config, server.status, reload=self.reload,
                          runner_logs=self.runner_logs)  # fmt: skip
        tg.start_soon(keep_running, "memory history", front.dashboard.history.run,
                      name="memory history")  # fmt: skip
        await tg.start(front.serve, *listen)
        server.http_url = lambda: front.url
        return front

    def _models_at_start(self, previous: DaemonState) -> list[ModelConfig]:
        """Models to load at start: the config's preloads, then (restore_on_start)
        what the predecessor had loaded."""
        wanted = {m.name: m for m in self.config.models if m.preload}
        if self.config.restore_on_start:
            for model in previous.models:
                wanted.setdefault(model.name, model)
        return list(wanted.values())

    async def _load_at_start(self, spec: ModelConfig) -> None:
        """Load one model at start. A failure leaves it ``failed`` in status and
        in the desired state (a later ``load`` retries it); never raises."""
        assert self.registry is not None
        try:
            entry = self.registry.register(spec, keep_if_first_load_fails=True)
            await self.registry.wait_loaded(entry)
            log.info("loaded_at_start", model=spec.name)
        except RequestError as exc:
            log.error("load_at_start_failed", model=spec.name, error=exc.message)
        except Exception:  # a fault boundary, like every model's supervision
            log.exception("load_at_start_failed", model=spec.name)

    def _save_state(self) -> None:
        """Persist our runners (for a successor's cleanup) and the desired models."""
        registry = self.registry
        assert registry is not None
        if not registry.closing:  # a shutdown keeps the models for the next start
            self._desired_models = [  # with the settings a reload left for the next load
                entry.next_spec or entry.spec
                for entry in registry.entries.values()
                if entry.state != "stopping" and not entry.removed
            ]
        runners = [
            RunnerRecord(handle.spec.name, handle.pid, handle.create_time)
            for handle in registry.live_handles
            if handle.pid is not None and handle.create_time is not None
        ]
        state = DaemonState(os.getpid(), str(self.socket_path), runners, self._desired_models)
        try:
            if runners or self._desired_models:
                self.state_file.save(state)
            else:  # nothing to remember: leave no file behind
                self.state_file.path.unlink(missing_ok=True)
        except Exception as exc:  # a full disk must not take the daemon down
            log.error("state_save_failed", path=str(self.state_file.path), error=repr(exc))

    async def _watch_signals(self, *, task_status: TaskStatus[None]) -> None:
        try:
            await self._receive_signals(task_status)
        finally:  # the receiver gave SIGHUP its default action back: not while we stop
            signal.signal(signal.SIGHUP, _sighup_before_serving)

    async def _receive_signals(self, task_status: TaskStatus[None]) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            task_status.started()
            async for signum in signals:
                registry = self.registry
                assert registry is not None
                if signum == signal.SIGHUP:  # reload, as daemons run by launchd and systemd do
                    log.info("reload_requested", by="SIGHUP")  # it stops nothing
                    registry.task_group.start_soon(self._reload_on_signal)
                    continue
                log.info("signal_received", signal=signal_name(signum))
                if self._shutdown_started:
                    continue
                self.registry.task_group.start_soon(self._shutdown_then_exit)  # type: ignore[union-attr]


ACCEPT_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED}
ACCEPT_RETRY_S = 0.1  # no event says an fd was freed: retry after a pause, as servers do


async def serve_connections(
    listener: SocketListener, handler: Callable[[SocketStream], Coroutine[Any, Any, None]]
) -> None:
    """Accept connections until the listener is closed, each served by
    ``handler`` in its own task.

    Unlike ``listener.serve``, no accept error ends it: running out of fds
    (EMFILE, ENFILE) or a connection aborted before it was accepted is
    logged and accepting goes on after a pause; an error it does not know is
    logged with its traceback and retried with a pause that grows (a fault
    boundary: the connections being served go on meanwhile).
    """
    failures = 0
    async with anyio.create_task_group() as tg:
        while True:
            try:
                stream = await listener.accept()
            except anyio.ClosedResourceError:
                return  # the daemon closed it: it is stopping
            except Exception as exc:
                cause = exc.__cause__ if isinstance(exc, anyio.BrokenResourceError) else exc
                if isinstance(cause, OSError) and cause.errno in ACCEPT_ERRORS:
                    log.error("accept_failed", error=str(cause), retry_in_s=ACCEPT_RETRY_S)
                    await anyio.sleep(ACCEPT_RETRY_S)
                    continue
                failures += 1
                delay_s = retry_delay_s(failures)
                log.exception("accept_failed_unexpectedly", failures=failures,
                              retry_in_s=delay_s)  # fmt: skip
                await anyio.sleep(delay_s)
                continue
            failures = 0
            tg.start_soon(handler, stream)


def raise_fd_limit() -> None:
    """Raise the soft limit on open files to the hard one (launchd's default
    soft limit is 256): every runner costs the daemon a few fds."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        if wanted > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ValueError, OSError) as exc:
        log.warning("fd_limit_unchanged", error=str(exc))


def run_daemon(
    config: SupervisorConfig,
    socket_path: Path,
    config_path: Path | None = None,
    http_flag: str | None = None,
) -> None:
    """Run a daemon in this process until it is told to stop (see :class:`Daemon`)."""
    raise_fd_limit()
    # Until the daemon listens for SIGHUP (a reload), one would end it: its
    # default action. Caught, not ignored: a runner started meanwhile gets
    # SIGHUP's default back at exec, as it would from a terminal.
    signal.signal(signal.SIGHUP, _sighup_before_serving)
    anyio.run(Daemon(config, socket_path, config_path, http_flag).run)


def _sighup_before_serving(signum: int, frame: object) -> None:
    """A SIGHUP while the daemon starts or stops: nothing to reload yet (or
    any more), and not the end of the daemon."""

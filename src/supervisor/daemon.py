"""The daemon: claims the socket, owns the registry, stops cleanly on signals."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import anyio
import structlog

from supervisor import __version__
from supervisor.config import SupervisorConfig
from supervisor.control import ControlServer, claim_socket
from supervisor.registry import Registry, RequestError

log = structlog.get_logger("supervisor.daemon")


class Daemon:
    """One running supervisor: socket, registry, shutdown.

    Args:
        config: the daemon config.
        socket_path: where to listen.
    """

    def __init__(self, config: SupervisorConfig, socket_path: Path) -> None:
        self.config = config
        self.socket_path = socket_path
        self._shutdown_started = False
        self._shutdown_done = anyio.Event()
        self._exit = anyio.Event()
        self._stopped_runners = 0
        self.registry: Registry | None = None

    async def shutdown(self) -> int:
        """Stop every runner (escalating, in parallel); idempotent.

        Returns the number of runners stopped.
        """
        if self._shutdown_started:
            await self._shutdown_done.wait()
            return self._stopped_runners
        self._shutdown_started = True
        log.info("daemon_shutting_down")
        assert self.registry is not None
        self._stopped_runners = await self.registry.shutdown()
        self._shutdown_done.set()
        return self._stopped_runners

    async def _shutdown_then_exit(self) -> None:
        await self.shutdown()
        self._exit.set()

    async def run(self) -> None:
        """Serve until SIGTERM, SIGINT or a shutdown request; then clean up.

        Raises:
            DaemonAlreadyRunning: another daemon owns the socket.
        """
        listener = await claim_socket(self.socket_path)
        socket_inode = os.stat(self.socket_path).st_ino
        log.info(
            "daemon_started", pid=os.getpid(), version=__version__, socket=str(self.socket_path)
        )
        try:
            async with anyio.create_task_group() as tg:
                self.registry = Registry(self.config, tg)
                server = ControlServer(
                    self.registry, self.config, self.socket_path, self.shutdown, self._exit.set
                )
                tg.start_soon(self._watch_signals)
                tg.start_soon(listener.serve, server.handle_connection)
                for model in self.config.models:
                    if model.preload:
                        tg.start_soon(self._preload, model.name)
                await self._exit.wait()
                tg.cancel_scope.cancel()
        finally:
            with contextlib.suppress(OSError):
                await listener.aclose()
            with contextlib.suppress(OSError):
                if os.stat(self.socket_path).st_ino == socket_inode:
                    self.socket_path.unlink()
            log.info("daemon_stopped", pid=os.getpid())

    async def _preload(self, name: str) -> None:
        assert self.registry is not None
        model = self.config.model_config(name)
        assert model is not None
        try:
            await self.registry.load(model)
            log.info("preloaded", model=name)
        except RequestError as exc:
            log.error("preload_failed", model=name, error=exc.message)

    async def _watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for signum in signals:
                if signum == signal.SIGHUP:
                    log.info("sighup_ignored")  # a closed terminal must not stop the models
                    continue
                log.info("signal_received", signal=signal.Signals(signum).name)
                if self._shutdown_started:
                    continue
                self.registry.task_group.start_soon(self._shutdown_then_exit)  # type: ignore[union-attr]


def run_daemon(config: SupervisorConfig, socket_path: Path) -> None:
    """Run a daemon in this process until it is told to stop."""
    anyio.run(Daemon(config, socket_path).run)

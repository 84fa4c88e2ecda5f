"""The control socket: one request per client connection, over ipc frames."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import structlog
from anyio.abc import ByteStream, SocketListener

from ipc import AsyncChannel, ChannelClosed, Codec, ProtocolError
from ipc.messages import (
    CancelRequest,
    ClientMessage,
    ErrorReply,
    GenerateRequest,
    LoadProgress,
    LoadRequest,
    ShutdownAck,
    ShutdownRequest,
    StatusReply,
    StatusRequest,
    SupervisorInfo,
    UnloadRequest,
)
from supervisor import __version__
from supervisor.config import SupervisorConfig
from supervisor.registry import Registry, RequestError
from supervisor.system import system_info

log = structlog.get_logger("supervisor.control")

REQUEST_TIMEOUT_S = 30.0  # a connection that says nothing this long is dropped


class DaemonAlreadyRunning(Exception):
    """Another live daemon answers on the socket path."""


async def claim_socket(path: Path) -> SocketListener:
    """Listen on ``path``, replacing a stale socket file but never a live daemon's.

    Raises:
        DaemonAlreadyRunning: a daemon accepts connections there.
        FileExistsError: ``path`` is something other than a socket.
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        if not path.is_socket():
            raise FileExistsError(f"{path} exists and is not a socket; not replacing it")
        try:
            stream = await anyio.connect_unix(path)
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("stale_socket_replaced", socket=str(path))
            path.unlink(missing_ok=True)
        else:
            await stream.aclose()
            raise DaemonAlreadyRunning(f"another mlx-supervisor is serving on {path}")
    listener = await anyio.create_unix_listener(path)
    os.chmod(path, 0o600)
    return listener


class ControlServer:
    """Serves client connections against the registry.

    Args:
        registry: the models.
        config: the daemon config.
        socket_path: shown in status.
        shutdown: the daemon's shutdown coroutine (returns the runner count).
        request_exit: tells the daemon to exit once a shutdown is acknowledged.
    """

    def __init__(
        self,
        registry: Registry,
        config: SupervisorConfig,
        socket_path: Path,
        shutdown: Callable[[], Awaitable[int]],
        request_exit: Callable[[], None],
    ) -> None:
        self.registry = registry
        self.config = config
        self.socket_path = socket_path
        self.shutdown = shutdown
        self.request_exit = request_exit
        self.started = time.monotonic()
        # One codec for every connection: building a union decoder costs ~40 us.
        self.codec: Codec[ClientMessage] = Codec(ClientMessage, config.max_frame_bytes)

    async def handle_connection(self, stream: ByteStream) -> None:
        """Handshake, read one request, answer it. Never raises."""
        channel: AsyncChannel[ClientMessage] = AsyncChannel(stream, self.codec)
        try:
            with anyio.fail_after(REQUEST_TIMEOUT_S):
                await channel.handshake("supervisor", "client", __version__)
                request = await channel.recv()
            await self.dispatch(channel, request)
        except RequestError as exc:
            await self._reply_error(channel, exc.code, exc.message)
        except ProtocolError as exc:
            log.warning("client_protocol_error", error=str(exc))
            await self._reply_error(channel, "protocol", str(exc))
        except (ChannelClosed, TimeoutError, anyio.BrokenResourceError):
            pass
        except Exception as exc:  # the daemon outlives any one request
            log.exception("request_handler_failed")
            await self._reply_error(channel, "bad_request", f"internal error: {exc!r}")
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await channel.aclose()

    async def _reply_error(
        self, channel: AsyncChannel[ClientMessage], code: str, message: str
    ) -> None:
        with contextlib.suppress(ChannelClosed, anyio.BrokenResourceError, OSError):
            await channel.send(ErrorReply(code, message))  # type: ignore[arg-type]

    async def dispatch(self, channel: AsyncChannel[ClientMessage], request: ClientMessage) -> None:
        """Answer one request on ``channel``."""
        if isinstance(request, StatusRequest):
            await channel.send(self.status())
        elif isinstance(request, LoadRequest):
            await self._load(channel, request)
        elif isinstance(request, GenerateRequest):
            await self._generate(channel, request)
        elif isinstance(request, UnloadRequest):
            await channel.send(await self.registry.unload(request.name))
        elif isinstance(request, ShutdownRequest):
            try:
                count = await self.shutdown()
                await channel.send(ShutdownAck(runners=count))
            finally:
                self.request_exit()
        elif isinstance(request, CancelRequest):
            raise RequestError("bad_request", "cancel is only valid during a generate")

    def status(self) -> StatusReply:
        return StatusReply(
            supervisor=SupervisorInfo(
                pid=os.getpid(),
                version=__version__,
                uptime_s=time.monotonic() - self.started,
                socket=str(self.socket_path),
            ),
            system=system_info(),
            runners=self.registry.status(),
            spare=self.registry.spare.info(),
            counters=dict(self.registry.counters),
        )

    async def _load(self, channel: AsyncChannel[ClientMessage], request: LoadRequest) -> None:
        async def forward(progress: LoadProgress) -> None:
            await channel.send(progress)

        spec = self.registry.spec_for(request)
        log.info("load_requested", model=spec.name, source=spec.model)
        await channel.send(await self.registry.load(spec, forward))

    async def _generate(
        self, channel: AsyncChannel[ClientMessage], request: GenerateRequest
    ) -> None:
        cancel = anyio.Event()

        async def watch_client() -> None:
            # The only thing a client may send now is CancelRequest; EOF or
            # anything else also cancels (the client is gone or confused).
            with contextlib.suppress(ChannelClosed, ProtocolError, anyio.BrokenResourceError):
                await channel.recv()
            cancel.set()

        failure: RequestError | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_client)
            try:
                await self.registry.generate(request, channel.send, cancel)
            except RequestError as exc:
                failure = exc
            finally:
                tg.cancel_scope.cancel()
        if failure is not None:
            raise failure

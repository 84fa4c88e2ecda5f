"""The control socket: one request per client connection, over ipc frames.

Every connection is a fault boundary: whatever goes wrong in it ends that
connection (with an error frame where one can still be sent), never the
daemon. Only the daemon's own user (and ``allowed_uids``) is served; writes to
a client have a deadline, and nothing a client does (reading slowly, not at
all, or vanishing) holds up a model for longer than that.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import msgspec
import structlog
from anyio.abc import ByteStream, SocketAttribute, SocketListener

from ipc import ChannelClosed, Codec, ProtocolError
from ipc.aio import AsyncChannel
from ipc.messages import (
    FAULTS_ENV,
    PROTOCOL_VERSION,
    CacheClearRequest,
    CancelRequest,
    ClientMessage,
    EmbedRequest,
    ErrorCode,
    ErrorReply,
    GenerateRequest,
    GenerationDone,
    Hello,
    Loaded,
    LoadProgress,
    LoadRequest,
    Queued,
    ReloadReply,
    ReloadRequest,
    ShutdownAck,
    ShutdownRequest,
    StatusReply,
    StatusRequest,
    SupervisorInfo,
    TextChunk,
    UnloadRequest,
)
from supervisor import __version__
from supervisor.config import SupervisorConfig
from supervisor.fronts.mailbox import ClientGone, Mailbox
from supervisor.registry.registry import Registry, RequestError
from supervisor.security import ensure_private_dir, peer_credentials

log = structlog.get_logger("supervisor.fronts.control")

MAX_ERROR_MESSAGE_CHARS = 1000
CONTROL_RESERVE = 8  # connections past max_connections kept for status, unload, shutdown


class DaemonAlreadyRunning(Exception):
    """Another live daemon answers on the socket path."""


async def claim_socket(path: Path) -> SocketListener:
    """Listen on ``path``, replacing a stale socket file but never a live daemon's.

    The directory must be private (see :func:`ensure_private_dir`); the socket
    is created under a umask that never exposes it, not chmod-ed after bind.

    Raises:
        DaemonAlreadyRunning: a daemon accepts connections there.
        FileExistsError: ``path`` is something other than a socket.
        InsecurePath: the directory is not private to us.
    """
    ensure_private_dir(path.parent)
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
    old_umask = os.umask(0o177)
    try:
        return await anyio.create_unix_listener(path)
    finally:
        os.umask(old_umask)


class Connection:
    """One client connection; every write has a deadline.

    A write that misses ``write_timeout_s`` leaves a half-sent frame, so the
    connection is closed and every later write raises :class:`ClientGone`.
    """

    def __init__(self, channel: AsyncChannel[ClientMessage], write_timeout_s: float) -> None:
        self.channel = channel
        self.write_timeout_s = write_timeout_s
        self.gone = False
        self.peer_uid: int | None = None  # as the kernel says, once checked

    async def send(self, message: msgspec.Struct, body: bytes | None = None) -> None:
        """Write one frame within the deadline; ``body``, when given, is
        ``message`` already encoded (a runner's frame relayed as it came).
        Raises ClientGone."""
        if self.gone:
            raise ClientGone("the client is gone")
        try:
            if body is None:
                await self.channel.send(message, self.write_timeout_s)
            else:
                await self.channel.send_body(body, self.write_timeout_s)
        except TimeoutError:
            self.gone = True
            with anyio.CancelScope(shield=True):
                await self.channel.aclose()
            raise ClientGone(f"the client read nothing for {self.write_timeout_s:g}s") from None
        except ChannelClosed as exc:
            self.gone = True
            raise ClientGone(str(exc)) from None

    async def send_error(self, code: ErrorCode, message: str) -> None:
        """Best effort: the client may be gone already. A long message (one
        that quotes hostile input) is cut, so the reply always fits a frame."""
        if len(message) > MAX_ERROR_MESSAGE_CHARS:
            message = message[:MAX_ERROR_MESSAGE_CHARS] + "... (cut)"
        with contextlib.suppress(ClientGone):
            await self.send(ErrorReply(code, message))


class ControlServer:
    """Serves client connections against the registry.

    Args:
        registry: the models.
        config: the daemon config.
        socket_path: shown in status.
        shutdown: the daemon's shutdown coroutine (returns the runner count).
        request_exit: tells the daemon to exit once a shutdown is acknowledged.
        reload: the daemon's config reload (None: a reload is refused).
    """

    def __init__(
        self,
        registry: Registry,
        config: SupervisorConfig,
        socket_path: Path,
        shutdown: Callable[[], Awaitable[int]],
        request_exit: Callable[[], None],
        *,
        reload: Callable[[], Awaitable[ReloadReply]] | None = None,
    ) -> None:
        self.registry = registry
        self.config = config
        self.socket_path = socket_path
        self.shutdown = shutdown
        self.request_exit = request_exit
        self.reload = reload
        self.started = time.monotonic()
        self.http_url: Callable[[], str | None] = lambda: None  # the HTTP front's, once it listens
        self.connections = 0
        self.allowed_uids = {os.geteuid(), *config.allowed_uids}
        # One codec for every connection: building a union decoder costs ~40 us.
        self.codec: Codec[ClientMessage] = Codec(ClientMessage, config.max_frame_bytes)

    async def handle_connection(self, stream: ByteStream) -> None:
        """Check the peer, handshake, read one request, answer it. Never raises:
        a connection is a fault boundary."""
        channel: AsyncChannel[ClientMessage] = AsyncChannel(stream, self.codec)
        self.connections += 1
        try:
            await self._serve_connection(channel)
        except Exception:  # even a failure to report a failure ends here
            log.exception("connection_failed")
        finally:
            self.connections -= 1
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await channel.aclose()

    async def _serve_connection(self, channel: AsyncChannel[ClientMessage]) -> None:
        conn = Connection(channel, self.config.client_write_timeout_s)
        stream = channel.stream
        try:
            refusal = self._refusal(stream, conn)
            if refusal is not None:
                await self._refuse(conn, *refusal)
                return
            try:
                with anyio.fail_after(self.config.client_idle_timeout_s):
                    await channel.handshake("supervisor", "client", __version__)
                    request = await channel.recv()
            except TimeoutError:
                log.info("client_idle_timeout", timeout_s=self.config.client_idle_timeout_s)
                return
            if self._over_limit(request):
                await conn.send_error("busy", self._busy_message())
                return
            await self.dispatch(conn, request)
        except RequestError as exc:
            await conn.send_error(exc.code, exc.message)
        except ProtocolError as exc:
            log.warning("client_protocol_error", error=str(exc))
            await conn.send_error("protocol", str(exc))
        except (ChannelClosed, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        except Exception as exc:  # a fault boundary: the daemon outlives any one request
            log.exception("request_handler_failed")
            await conn.send_error("internal", f"internal error: {exc!r}")

    def _refusal(self, stream: ByteStream, conn: Connection) -> tuple[ErrorCode, str] | None:
        """Why this connection is not served (a foreign uid, too many
        connections), or None; notes the peer's uid on ``conn``."""
        try:
            peer = peer_credentials(stream.extra(SocketAttribute.raw_socket))
        except (OSError, anyio.TypedAttributeLookupError) as exc:
            log.warning("client_refused", reason=f"peer credentials unknown: {exc}")
            return "forbidden", "the daemon cannot tell who you are"
        conn.peer_uid = peer.uid
        if peer.uid not in self.allowed_uids:
            log.warning("client_refused", reason="uid not allowed",
                        peer_uid=peer.uid, peer_pid=peer.pid)  # fmt: skip
            return "forbidden", f"uid {peer.uid} may not use this daemon (allowed_uids)"
        if self.connections > self.config.max_connections + CONTROL_RESERVE:
            log.warning("client_refused", reason="too many connections",
                        connections=self.connections, peer_pid=peer.pid)  # fmt: skip
            return "busy", self._busy_message()
        return None

    def _over_limit(self, request: ClientMessage) -> bool:
        """Past ``max_connections``, only status, unload and shutdown are served:
        an operator can always look and stop things during a flood."""
        if self.connections <= self.config.max_connections:
            return False
        return not isinstance(request, StatusRequest | UnloadRequest | ShutdownRequest)

    def _busy_message(self) -> str:
        return f"the daemon has {self.config.max_connections} connections already (max_connections)"

    async def _refuse(self, conn: Connection, code: ErrorCode, message: str) -> None:
        # Our Hello first, so the client reads the refusal as an error frame.
        await conn.send(Hello(PROTOCOL_VERSION, os.getpid(), "supervisor", __version__))
        await conn.send_error(code, message)

    async def dispatch(self, conn: Connection, request: ClientMessage) -> None:
        """Answer one request on ``conn``."""
        if isinstance(request, StatusRequest):
            await conn.send(self.status())
        elif isinstance(request, LoadRequest):
            await self._load(conn, request)
        elif isinstance(request, GenerateRequest):
            await self._generate(conn, request)
        elif isinstance(request, UnloadRequest):
            await conn.send(await self.registry.unload(request.name))
        elif isinstance(request, CacheClearRequest):
            await conn.send(await self.registry.clear_cache(request.name, request.disk_only))
        elif isinstance(request, EmbedRequest):
            entry = self.registry.get(request.name)
            await conn.send(await self.registry.embed(entry, request.inputs, request.dimensions,
                                                      request.truncate))  # fmt: skip
        elif isinstance(request, ShutdownRequest):
            try:
                count = await self.shutdown()
                await conn.send(ShutdownAck(runners=count))
            finally:
                self.request_exit()
        elif isinstance(request, ReloadRequest):
            if self.reload is None:
                raise RequestError("bad_request", "this daemon cannot reload its config")
            log.info("reload_requested", by="socket")
            await conn.send(await self.reload())
        elif isinstance(request, CancelRequest):
            raise RequestError("bad_request", "cancel is only valid during a generate")

    def status(self) -> StatusReply:
        return StatusReply(
            supervisor=SupervisorInfo(
                pid=os.getpid(),
                version=__version__,
                uptime_s=time.monotonic() - self.started,
                socket=str(self.socket_path),
                http=self.http_url(),
                unkillable=self.registry.unkillable(),
            ),
            system=self.registry.system_info(),
            runners=self.registry.status(),
            spare=self.registry.spare.info(),
            counters=dict(self.registry.counters),
        )

    async def _load(self, conn: Connection, request: LoadRequest) -> None:
        if FAULTS_ENV in request.env and conn.peer_uid != os.geteuid():
            # Faults crash, hang, hog memory and write files as the daemon's user.
            raise RequestError("forbidden", f"{FAULTS_ENV} (fault injection) is for the "
                               "daemon's own user only")  # fmt: skip
        spec = self.registry.spec_for(request)
        log.info("load_requested", model=spec.name, source=spec.model)
        progress: Mailbox[LoadProgress] = Mailbox()
        outcome: Loaded | RequestError
        async with anyio.create_task_group() as writers:
            writers.start_soon(progress.forward, conn.send)
            try:
                outcome = await self.registry.load(spec, progress.put)
            except RequestError as exc:
                outcome = exc
            finally:
                progress.close()
        if isinstance(outcome, RequestError):
            raise outcome
        await conn.send(outcome)

    async def _generate(self, conn: Connection, request: GenerateRequest) -> None:
        cancel = anyio.Event()
        queued: Mailbox[Queued] = Mailbox()

        async def emit(event: TextChunk | GenerationDone, body: bytes | None) -> None:
            queued.close()  # no position update after the first token
            await conn.send(event, body)

        async def watch_client() -> None:
            # The only thing a client may send now is CancelRequest; EOF or
            # anything else also cancels (the client is gone or confused).
            with contextlib.suppress(ChannelClosed, ProtocolError, anyio.BrokenResourceError):
                await conn.channel.recv()
            cancel.set()

        failure: RequestError | None = None
        async with anyio.create_task_group() as writers:
            writers.start_soon(queued.forward, conn.send)
            try:
                async with anyio.create_task_group() as readers:
                    readers.start_soon(watch_client)
                    try:
                        await self.registry.generate(
                            request,
                            emit,
                            cancel,
                            on_queued=lambda n: queued.put(Queued(n)),
                            front="socket",
                        )
                    except RequestError as exc:
                        failure = exc
                    finally:
                        readers.cancel_scope.cancel()
            finally:
                queued.close()
        if failure is not None:
            raise failure

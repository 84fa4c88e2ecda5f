"""The Python client of the daemon (blocking; used by the CLI and the tests).

One connection per request. A generation is an iterator of text pieces::

    client = Client()
    client.load("builtin:tiny")
    with client.generate("tiny", "Hello", max_tokens=32) as gen:
        for text in gen:
            print(text, end="")
    print(gen.done.generation_tps)
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import anyio
from anyio.abc import SocketAttribute

from ipc import AsyncChannel, BlockingChannel, ChannelClosed, Codec, ProtocolError
from ipc.messages import (
    CacheCleared,
    CacheClearRequest,
    CancelRequest,
    ChatMessage,
    ClientMessage,
    ErrorReply,
    GenerateRequest,
    GenerationDone,
    Loaded,
    LoadProgress,
    LoadRequest,
    Queued,
    RestartStrategy,
    SamplingParams,
    ServerMessage,
    ShutdownAck,
    ShutdownRequest,
    StatusReply,
    StatusRequest,
    TextChunk,
    Unloaded,
    UnloadRequest,
)
from supervisor import __version__
from supervisor.paths import default_socket_path
from supervisor.security import peer_credentials

R = TypeVar("R")


_CODEC: Codec[ServerMessage] = Codec(ServerMessage)  # msgspec codecs are thread-safe


class ClientError(Exception):
    """The daemon refused or failed a request; ``code`` is the protocol's."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class DaemonUnreachable(ClientError):
    """No daemon answers on the socket."""


class Client:
    """Talks to one daemon.

    Args:
        socket_path: the daemon's socket; default ``$MLX_SUPERVISOR_SOCKET``
            or the per-user runtime dir.
        timeout_s: give up on a reply (or the next piece of a stream) after
            this long, with ClientError code ``timeout``; None waits forever.
        daemon_uid: the uid the daemon must run as; default our own, or
            ``$MLX_SUPERVISOR_DAEMON_UID`` (to use another user's daemon that
            lists us in its ``allowed_uids``).
    """

    def __init__(
        self,
        socket_path: str | Path | None = None,
        timeout_s: float | None = None,
        daemon_uid: int | None = None,
    ) -> None:
        self.socket_path = Path(socket_path) if socket_path else default_socket_path()
        self.timeout_s = timeout_s
        self.daemon_uid = expected_daemon_uid(daemon_uid)

    def connect(self, first: ClientMessage | None = None) -> BlockingChannel[ServerMessage]:
        """Open a connection and shake hands, sending ``first`` (the request)
        along with our Hello.

        Raises:
            DaemonUnreachable: nothing listens on the socket.
            ClientError: the daemon speaks another protocol version.
        """
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if self.timeout_s is not None:
            # A kernel-level receive timeout: os.read on the detached fd honours it.
            seconds = int(self.timeout_s)
            micros = int((self.timeout_s - seconds) * 1e6)
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", seconds, micros)
            )
        try:
            sock.connect(str(self.socket_path))
        except OSError as exc:
            sock.close()
            raise DaemonUnreachable(
                "unreachable", f"no daemon at {self.socket_path} ({exc.strerror or exc})"
            ) from exc
        try:
            check_daemon_credentials(sock, self.socket_path, self.daemon_uid)
        except ClientError:
            sock.close()
            raise
        fd = sock.detach()
        channel: BlockingChannel[ServerMessage] = BlockingChannel(fd, fd, _CODEC)
        try:
            channel.handshake("client", "supervisor", __version__, first)
        except (ProtocolError, ChannelClosed, OSError) as exc:
            channel.close()
            message = f"handshake with {self.socket_path} failed: {exc}"
            raise ClientError("protocol", message) from exc
        return channel

    def _request(
        self,
        request: ClientMessage,
        expect: type[R],
        on_message: Callable[[ServerMessage], None] | None = None,
    ) -> R:
        channel = self.connect(request)
        try:
            while True:
                reply = _recv(channel)
                if isinstance(reply, expect):
                    return reply
                if on_message is not None:
                    on_message(reply)
        finally:
            channel.close()

    def status(self) -> StatusReply:
        """The daemon's pid, uptime, the machine's memory and every runner."""
        return self._request(StatusRequest(), StatusReply)

    def load(
        self,
        model: str,
        name: str | None = None,
        *,
        max_tokens: int | None = None,
        env: dict[str, str] | None = None,
        restart: RestartStrategy | None = None,
        keep_alive_s: float | None = None,
        pinned: bool | None = None,
        context_tokens: int | None = None,
        max_concurrent: int | None = None,
        prefix_cache: bool | None = None,
        ranks: int | None = None,
        hostfile: str | None = None,
        on_progress: Callable[[LoadProgress], None] | None = None,
    ) -> Loaded:
        """Start a runner for ``model`` and wait until it is ready.

        Raises:
            ClientError: the load failed (``code`` ``load_failed``,
                ``already_loaded``, ...).
        """

        def progress(message: ServerMessage) -> None:
            if on_progress is not None and isinstance(message, LoadProgress):
                on_progress(message)

        request = LoadRequest(
            local_model_reference(model), name, max_tokens, env or {}, restart,
            keep_alive_s, pinned, context_tokens, max_concurrent, prefix_cache, ranks, hostfile,
        )  # fmt: skip
        return self._request(request, Loaded, progress)

    def unload(self, name: str) -> Unloaded:
        """Stop the model's runner (escalating as needed) and forget it."""
        return self._request(UnloadRequest(name), Unloaded)

    def shutdown(self) -> ShutdownAck:
        """Stop every runner and the daemon; returns once the runners are reaped."""
        return self._request(ShutdownRequest(), ShutdownAck)

    def clear_cache(self, name: str) -> CacheCleared:
        """Drop the model's prefix cache (its runner stays loaded)."""
        return self._request(CacheClearRequest(name), CacheCleared)

    def generate(
        self,
        name: str,
        prompt: str | None = None,
        *,
        messages: list[ChatMessage] | list[dict[str, str]] | None = None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        cache: bool = True,
        stop: Sequence[str] = (),
    ) -> Generation:
        """Start a generation; iterate the result for text pieces. ``cache``
        False: the request neither uses nor fills the model's prefix cache.
        ``stop``: the text ends before the first of these strings."""
        request = generate_request(
            name, prompt, messages, max_tokens, temperature, top_p, seed, cache, stop
        )
        started = time.perf_counter()
        return Generation(self.connect(request), started)

    def generate_text(self, name: str, prompt: str, **kwargs: object) -> tuple[str, GenerationDone]:
        """Generate to the end; return the whole text and the final stats."""
        with self.generate(name, prompt, **kwargs) as gen:  # type: ignore[arg-type]
            text = "".join(gen)
        assert gen.done is not None
        return text, gen.done


def local_model_reference(model: str) -> str:
    """``model`` as the daemon should see it: a local directory or file (a
    GGUF file) that exists here (relative to *our* working directory) becomes
    an absolute path; repo ids and ``builtin:`` names pass unchanged."""
    if model.startswith("builtin:"):
        return model
    try:
        path = Path(model).expanduser()
        local = path.is_dir() or path.is_file()  # a .gguf file, or an Ollama blob
        return str(path.resolve()) if local else model
    except (OSError, RuntimeError, ValueError):  # not a usable path here: the daemon decides
        return model


DAEMON_UID_ENV = "MLX_SUPERVISOR_DAEMON_UID"


def expected_daemon_uid(given: int | None) -> int:
    """The uid a daemon must run as: ``given``, else ``$MLX_SUPERVISOR_DAEMON_UID``,
    else our own."""
    if given is not None:
        return given
    env = os.environ.get(DAEMON_UID_ENV, "")
    return int(env) if env.isdigit() else os.geteuid()


def check_daemon_credentials(sock: socket.socket, socket_path: Path, daemon_uid: int) -> None:
    """Refuse a socket served by anyone but ``daemon_uid`` (a socket in a shared
    place could be anyone's): not one byte of our request is sent to it.

    Raises:
        ClientError: code ``forbidden``, the peer is another uid.
    """
    try:
        peer = peer_credentials(sock)
    except OSError as exc:
        raise ClientError("forbidden", f"cannot tell who serves {socket_path}: {exc}") from exc
    if peer.uid != daemon_uid:
        raise ClientError(
            "forbidden",
            f"{socket_path} is served by uid {peer.uid} (pid {peer.pid}), not by uid "
            f"{daemon_uid}; refusing to talk to it (set {DAEMON_UID_ENV} to trust it)",
        )


def generate_request(
    name: str,
    prompt: str | None,
    messages: list[ChatMessage] | list[dict[str, str]] | None,
    max_tokens: int,
    temperature: float,
    top_p: float,
    seed: int | None,
    cache: bool = True,
    stop: Sequence[str] = (),
) -> GenerateRequest:
    """Build a GenerateRequest; chat turns may be dicts with role and content."""
    chat = None
    if messages is not None:
        chat = [m if isinstance(m, ChatMessage) else ChatMessage(**m) for m in messages]
    sampling = SamplingParams(max_tokens, temperature, top_p, seed, tuple(stop))
    return GenerateRequest(name=name, prompt=prompt, messages=chat, sampling=sampling, cache=cache)


class Generation:
    """A streaming generation: iterate for text; ``done`` holds the stats at the end.

    ``ttft_s`` is measured here, from the call (connect and handshake
    included) to the first text frame.
    """

    def __init__(self, channel: BlockingChannel[ServerMessage], started: float) -> None:
        self._channel = channel
        self._sent_at = started
        self.ttft_s: float | None = None
        self.tokens = 0
        self.position: int | None = None  # place in the model's queue while waiting
        self.done: GenerationDone | None = None

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self.done is not None:
            raise StopIteration
        message = _recv(self._channel)
        while isinstance(message, Queued):
            self.position = message.position
            message = _recv(self._channel)
        if isinstance(message, TextChunk):
            if self.ttft_s is None:
                self.ttft_s = time.perf_counter() - self._sent_at
            self.tokens = message.generation_tokens
            return message.text
        if isinstance(message, GenerationDone):
            self.done = message
            self.close()
            raise StopIteration
        raise ClientError("protocol", f"unexpected {type(message).__name__} during generate")

    def cancel(self) -> None:
        """Ask the daemon to stop; keep iterating to read the rest and ``done``."""
        with contextlib.suppress(OSError):
            self._channel.send(CancelRequest())

    def close(self) -> None:
        """Drop the connection (the daemon then cancels the generation)."""
        self._channel.close()

    def __enter__(self) -> Generation:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncClient:
    """The same client for anyio code (asyncio or trio).

    Args:
        socket_path: the daemon's socket; default as for :class:`Client`.
    """

    def __init__(
        self, socket_path: str | Path | None = None, daemon_uid: int | None = None
    ) -> None:
        self.socket_path = Path(socket_path) if socket_path else default_socket_path()
        self.daemon_uid = expected_daemon_uid(daemon_uid)

    async def connect(self) -> AsyncChannel[ServerMessage]:
        """Open a connection and shake hands (raises like :meth:`Client.connect`)."""
        try:
            stream = await anyio.connect_unix(self.socket_path)
        except OSError as exc:
            raise DaemonUnreachable(
                "unreachable", f"no daemon at {self.socket_path} ({exc.strerror or exc})"
            ) from exc
        try:
            raw = stream.extra(SocketAttribute.raw_socket)
            check_daemon_credentials(raw, self.socket_path, self.daemon_uid)
        except ClientError:
            await stream.aclose()
            raise
        channel: AsyncChannel[ServerMessage] = AsyncChannel(stream, _CODEC)
        try:
            await channel.handshake("client", "supervisor", __version__)
        except (ProtocolError, ChannelClosed) as exc:
            await channel.aclose()
            message = f"handshake with {self.socket_path} failed: {exc}"
            raise ClientError("protocol", message) from exc
        return channel

    async def _request(
        self,
        request: ClientMessage,
        expect: type[R],
        on_message: Callable[[ServerMessage], None] | None = None,
    ) -> R:
        channel = await self.connect()
        try:
            await channel.send(request)
            while True:
                reply = await _arecv(channel)
                if isinstance(reply, expect):
                    return reply
                if on_message is not None:
                    on_message(reply)
        finally:
            await channel.aclose()

    async def status(self) -> StatusReply:
        return await self._request(StatusRequest(), StatusReply)

    async def load(
        self,
        model: str,
        name: str | None = None,
        *,
        max_tokens: int | None = None,
        env: dict[str, str] | None = None,
        restart: RestartStrategy | None = None,
        keep_alive_s: float | None = None,
        pinned: bool | None = None,
        context_tokens: int | None = None,
        ranks: int | None = None,
    ) -> Loaded:
        request = LoadRequest(
            local_model_reference(model), name, max_tokens, env or {}, restart,
            keep_alive_s, pinned, context_tokens, ranks=ranks,
        )  # fmt: skip
        return await self._request(request, Loaded)

    async def unload(self, name: str) -> Unloaded:
        return await self._request(UnloadRequest(name), Unloaded)

    async def shutdown(self) -> ShutdownAck:
        return await self._request(ShutdownRequest(), ShutdownAck)

    async def clear_cache(self, name: str) -> CacheCleared:
        return await self._request(CacheClearRequest(name), CacheCleared)

    async def generate(
        self,
        name: str,
        prompt: str | None = None,
        *,
        messages: list[ChatMessage] | list[dict[str, str]] | None = None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        cache: bool = True,
        stop: Sequence[str] = (),
    ) -> AsyncIterator[str]:
        """Yield text pieces; cancelling the caller drops the connection, which
        cancels the generation in the runner."""
        request = generate_request(
            name, prompt, messages, max_tokens, temperature, top_p, seed, cache, stop
        )
        channel = await self.connect()
        try:
            await channel.send(request)
            while True:
                message = await _arecv(channel)
                if isinstance(message, GenerationDone):
                    return
                if isinstance(message, TextChunk):
                    yield message.text
        finally:
            with anyio.CancelScope(shield=True):
                await channel.aclose()


async def _arecv(channel: AsyncChannel[ServerMessage]) -> ServerMessage:
    try:
        message = await channel.recv()
    except ChannelClosed as exc:
        raise ClientError("disconnected", "the daemon closed the connection") from exc
    except ProtocolError as exc:
        raise ClientError("protocol", str(exc)) from exc
    if isinstance(message, ErrorReply):
        raise ClientError(message.code, message.message)
    return message


def _recv(channel: BlockingChannel[ServerMessage]) -> ServerMessage:
    """Next message; an ErrorReply becomes ClientError, EOF becomes ClientError."""
    try:
        message = channel.recv()
    except BlockingIOError as exc:  # SO_RCVTIMEO expired
        raise ClientError("timeout", "no reply from the daemon in time") from exc
    except ChannelClosed as exc:
        raise ClientError("disconnected", "the daemon closed the connection") from exc
    except ProtocolError as exc:
        raise ClientError("protocol", str(exc)) from exc
    if isinstance(message, ErrorReply):
        raise ClientError(message.code, message.message)
    return message

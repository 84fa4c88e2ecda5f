"""The client for anyio code (asyncio or trio): the commands of
:mod:`supervisor.client.commands` over an :class:`~ipc.aio.AsyncChannel`."""

from __future__ import annotations

import contextlib
import time
from types import TracebackType
from typing import TypeVar

import anyio
from anyio.abc import SocketAttribute

from ipc import ChannelClosed, ProtocolError
from ipc.aio import AsyncChannel
from ipc.messages import (
    CancelRequest,
    ClientMessage,
    GenerateRequest,
    GenerationDone,
    ServerMessage,
)
from supervisor import __version__
from supervisor.client import commands
from supervisor.client.commands import GENERATE_TEXT_DOC, Call, GenerationState, client_method
from supervisor.client.connection import (
    CODEC,
    Endpoint,
    check_daemon_credentials,
    handshake_failed,
    reading_reply,
    unreachable,
)
from supervisor.client.errors import ClientError

R = TypeVar("R")


class AsyncGeneration(GenerationState):
    """A streaming generation: ``async for`` the text; ``done`` holds the stats
    at the end, and ``reasoning``, ``tool_calls`` and ``logprobs`` the answer's
    other parts. It connects when first iterated (``ttft_s`` counts from there).

    Cancelling the caller, leaving ``async with`` or :meth:`aclose` drops the
    connection, which cancels the generation in the runner.
    """

    def __init__(self, client: AsyncClient, request: GenerateRequest) -> None:
        super().__init__()
        self._client = client
        self._request = request
        self._channel: AsyncChannel[ServerMessage] | None = None
        self._closed = False

    def __aiter__(self) -> AsyncGeneration:
        return self

    async def __anext__(self) -> str:
        if self._closed:
            raise StopAsyncIteration
        try:
            if self._channel is None:
                self.started = time.perf_counter()
                self._channel = await self._client.connect(self._request)
            while self.done is None:
                text = self.feed(await _recv(self._channel, self._client.timeout_s))
                if text is not None:
                    return text
        except BaseException:
            await self.aclose()
            raise
        await self.aclose()
        raise StopAsyncIteration

    async def cancel(self) -> None:
        """Ask the daemon to stop; keep iterating to read the rest and ``done``."""
        if self._channel is not None and not self._closed:
            with contextlib.suppress(ChannelClosed):
                await self._channel.send(CancelRequest())

    async def aclose(self) -> None:
        """Drop the connection (the daemon then cancels the generation)."""
        self._closed = True
        if self._channel is not None:
            with anyio.CancelScope(shield=True):
                await self._channel.aclose()

    async def __aenter__(self) -> AsyncGeneration:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


async def generate_to_end(
    client: AsyncClient, request: GenerateRequest
) -> tuple[str, GenerationDone]:
    """Run the generation ``request`` asks for to the end: its text and stats."""
    async with AsyncGeneration(client, request) as gen:
        text = "".join([piece async for piece in gen])
    assert gen.done is not None
    return text, gen.done


class AsyncClient(Endpoint):
    """The same client for anyio code (asyncio or trio): the same methods,
    each awaited, but ``generate``, which returns an :class:`AsyncGeneration`.

    Args:
        socket_path, timeout_s, daemon_uid: as for :class:`~supervisor.client.Client`.
    """

    async def connect(self, first: ClientMessage | None = None) -> AsyncChannel[ServerMessage]:
        """Open a connection and shake hands, then send ``first`` (the request).

        Raises:
            DaemonUnreachable: nothing listens on the socket.
            ClientError: the daemon speaks another protocol version.
        """
        try:
            stream = await anyio.connect_unix(self.socket_path)
        except OSError as exc:
            raise unreachable(self.socket_path, exc) from exc
        try:
            raw = stream.extra(SocketAttribute.raw_socket)
            check_daemon_credentials(raw, self.socket_path, self.daemon_uid)
        except ClientError:
            await stream.aclose()
            raise
        channel: AsyncChannel[ServerMessage] = AsyncChannel(stream, CODEC)
        try:
            with anyio.fail_after(self.timeout_s):
                await channel.handshake("client", "supervisor", __version__)
            if first is not None:
                await channel.send(first)
        except (ProtocolError, ChannelClosed, OSError) as exc:  # OSError: TimeoutError
            await channel.aclose()
            raise handshake_failed(self.socket_path, exc) from exc
        return channel

    async def run(self, call: Call[R]) -> R:
        """Send ``call``'s request on a connection of its own; return its reply.

        Raises:
            ClientError: as :meth:`connect`, or the daemon failed the command.
        """
        channel = await self.connect(call.request)
        try:
            while True:
                reply = call.feed(await _recv(channel, self.timeout_s))
                if reply is not None:
                    return reply
        finally:
            with anyio.CancelScope(shield=True):
                await channel.aclose()

    status = client_method(commands.status, run, "AsyncClient")
    load = client_method(commands.load, run, "AsyncClient")
    unload = client_method(commands.unload, run, "AsyncClient")
    shutdown = client_method(commands.shutdown, run, "AsyncClient")
    clear_cache = client_method(commands.clear_cache, run, "AsyncClient")
    embed = client_method(commands.embed, run, "AsyncClient")
    reload = client_method(commands.reload, run, "AsyncClient")
    generate = client_method(commands.generate, AsyncGeneration, "AsyncClient")
    generate_text = client_method(
        commands.generate,
        generate_to_end,
        "AsyncClient",
        name="generate_text",
        doc=GENERATE_TEXT_DOC,
    )


async def _recv(channel: AsyncChannel[ServerMessage], timeout_s: float | None) -> ServerMessage:
    """The next message, waited for ``timeout_s`` at most; a timeout, EOF or
    bad frame becomes a ClientError."""
    with reading_reply(), anyio.fail_after(timeout_s):
        return await channel.recv()

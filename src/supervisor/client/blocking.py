"""The blocking client: the commands of :mod:`supervisor.client.commands`
over a :class:`~ipc.BlockingChannel` (the CLI and the tests use it)."""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Iterator
from types import TracebackType
from typing import TypeVar

from ipc import BlockingChannel, ChannelClosed, ProtocolError
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


class Generation(GenerationState):
    """A streaming generation: iterate for text; ``done`` holds the stats at the
    end, and ``reasoning``, ``tool_calls`` and ``logprobs`` the answer's other
    parts (:class:`~supervisor.client.commands.GenerationState`).

    ``ttft_s`` is measured here, from the call (connect and handshake
    included) to the first frame of output (text, reasoning or tool calls).
    """

    def __init__(self, client: Client, request: GenerateRequest) -> None:
        super().__init__()
        self._channel = client.connect(request)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        while self.done is None:
            text = self.feed(_recv(self._channel))
            if text is not None:
                return text
        self.close()
        raise StopIteration

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


def generate_to_end(client: Client, request: GenerateRequest) -> tuple[str, GenerationDone]:
    """Run the generation ``request`` asks for to the end: its text and stats."""
    with Generation(client, request) as gen:
        text = "".join(gen)
    assert gen.done is not None
    return text, gen.done


class Client(Endpoint):
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
            raise unreachable(self.socket_path, exc) from exc
        try:
            check_daemon_credentials(sock, self.socket_path, self.daemon_uid)
        except ClientError:
            sock.close()
            raise
        fd = sock.detach()
        channel: BlockingChannel[ServerMessage] = BlockingChannel(fd, fd, CODEC)
        try:
            channel.handshake("client", "supervisor", __version__, first)
        except (ProtocolError, ChannelClosed, OSError) as exc:
            channel.close()
            raise handshake_failed(self.socket_path, exc) from exc
        return channel

    def run(self, call: Call[R]) -> R:
        """Send ``call``'s request on a connection of its own; return its reply.

        Raises:
            ClientError: as :meth:`connect`, or the daemon failed the command.
        """
        channel = self.connect(call.request)
        try:
            while True:
                reply = call.feed(_recv(channel))
                if reply is not None:
                    return reply
        finally:
            channel.close()

    status = client_method(commands.status, run, "Client")
    load = client_method(commands.load, run, "Client")
    unload = client_method(commands.unload, run, "Client")
    shutdown = client_method(commands.shutdown, run, "Client")
    clear_cache = client_method(commands.clear_cache, run, "Client")
    embed = client_method(commands.embed, run, "Client")
    reload = client_method(commands.reload, run, "Client")
    generate = client_method(commands.generate, Generation, "Client")
    generate_text = client_method(
        commands.generate, generate_to_end, "Client", name="generate_text", doc=GENERATE_TEXT_DOC
    )


def _recv(channel: BlockingChannel[ServerMessage]) -> ServerMessage:
    """The next message; a timeout, EOF or bad frame becomes a ClientError."""
    with reading_reply():
        return channel.recv()

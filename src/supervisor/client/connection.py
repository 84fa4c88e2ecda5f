"""What both clients do around a connection, whatever its I/O: where the
daemon is, who it must be, and the ClientErrors for a connection that fails."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ipc import ChannelClosed, Codec, ProtocolError
from ipc.messages import ServerMessage
from supervisor.client.errors import ClientError, DaemonUnreachable
from supervisor.daemon.paths import default_socket_path
from supervisor.security import peer_credentials

CODEC: Codec[ServerMessage] = Codec(ServerMessage)  # msgspec codecs are thread-safe

DAEMON_UID_ENV = "MLX_SUPERVISOR_DAEMON_UID"


class Endpoint:
    """One daemon to talk to: its socket, how long to wait for it, and whom it
    must run as (the arguments of :class:`~supervisor.client.Client` and
    :class:`~supervisor.client.AsyncClient` alike)."""

    def __init__(
        self,
        socket_path: str | Path | None = None,
        *,  # by name: the two clients once had them in different orders
        timeout_s: float | None = None,
        daemon_uid: int | None = None,
    ) -> None:
        self.socket_path = Path(socket_path) if socket_path else default_socket_path()
        self.timeout_s = timeout_s
        self.daemon_uid = expected_daemon_uid(daemon_uid)


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


def unreachable(socket_path: Path, exc: OSError) -> DaemonUnreachable:
    """The error for a socket nobody accepts on."""
    return DaemonUnreachable("unreachable", f"no daemon at {socket_path} ({exc.strerror or exc})")


def handshake_failed(socket_path: Path, exc: Exception) -> ClientError:
    """The error for a daemon that does not complete our handshake (another
    protocol version, or it hung up or fell silent)."""
    return ClientError("protocol", f"handshake with {socket_path} failed: {exc}")


@contextmanager
def reading_reply() -> Iterator[None]:
    """Turn the failures of reading a reply from a channel into ClientErrors.

    Raises:
        ClientError: code ``timeout`` (no reply in the client's ``timeout_s``),
            ``disconnected`` (the daemon hung up) or ``protocol`` (a bad frame).
    """
    try:
        yield
    except (BlockingIOError, TimeoutError) as exc:  # SO_RCVTIMEO expired, or anyio's fail_after
        raise ClientError("timeout", "no reply from the daemon in time") from exc
    except ChannelClosed as exc:
        raise ClientError("disconnected", "the daemon closed the connection") from exc
    except ProtocolError as exc:
        raise ClientError("protocol", str(exc)) from exc

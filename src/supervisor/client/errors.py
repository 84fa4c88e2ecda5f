"""What the client raises: the daemon's refusals and failures, with the protocol's codes."""

from __future__ import annotations


class ClientError(Exception):
    """The daemon refused or failed a request; ``code`` is the protocol's."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class DaemonUnreachable(ClientError):
    """No daemon answers on the socket."""

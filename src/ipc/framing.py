"""Length-prefixed msgpack frames: a 4-byte big-endian length, then the body.

A :class:`Codec` turns one direction's messages into frames and back. A
:class:`FrameSplitter` cuts a byte stream into frame bodies, refusing an
announced length above the maximum before allocating anything for it.
"""

from __future__ import annotations

import struct
from typing import Any, Generic, TypeVar

import msgspec

from ipc.messages import PROTOCOL_VERSION, Hello

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024

T = TypeVar("T")

# What msgspec raises on bad input: DecodeError (ValidationError is a
# subclass), and UnicodeDecodeError for a str that is not valid UTF-8.
_DECODE_ERRORS = (msgspec.DecodeError, UnicodeDecodeError)


class ProtocolError(Exception):
    """A frame or handshake that breaks the protocol: says what was wrong."""


class FrameTooLarge(ProtocolError):
    """An outgoing message is over the frame limit: nothing was sent, the
    channel is as it was (the sender may fail just that message)."""

    def __init__(self, what: str, size: int, limit: int) -> None:
        super().__init__(f"outgoing {what} is {size} bytes, over the {limit}-byte frame limit")
        self.size = size
        self.limit = limit


class ChannelClosed(Exception):
    """The peer closed the connection cleanly, between two frames."""


class Codec(Generic[T]):
    """Encodes any message; decodes frame bodies of type ``recv_type``.

    Args:
        recv_type: the union (or struct) this side expects to receive.
        max_frame_bytes: largest body accepted or sent.
    """

    def __init__(self, recv_type: Any, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(recv_type)
        self._hello_decoder = msgspec.msgpack.Decoder(Hello)

    def frame(self, message: msgspec.Struct) -> bytes:
        """Return ``message`` as one frame (header + body).

        Raises:
            FrameTooLarge: the body would exceed ``max_frame_bytes``.
        """
        body = self._encoder.encode(message)
        if len(body) > self.max_frame_bytes:
            raise FrameTooLarge(type(message).__name__, len(body), self.max_frame_bytes)
        return HEADER.pack(len(body)) + body

    def frame_body(self, body: bytes) -> bytes:
        """A frame around a body encoded elsewhere (a frame relayed as it came).

        Raises:
            FrameTooLarge: the body exceeds ``max_frame_bytes``.
        """
        if len(body) > self.max_frame_bytes:
            raise FrameTooLarge("frame", len(body), self.max_frame_bytes)
        return HEADER.pack(len(body)) + body

    def decode(self, body: bytes | memoryview) -> T:
        """Decode one frame body. Raises ProtocolError on any bad input."""
        try:
            return self._decoder.decode(body)
        except _DECODE_ERRORS as exc:
            raise ProtocolError(f"bad frame: {exc}") from exc

    def decode_hello(self, body: bytes | memoryview, expect_role: str | None = None) -> Hello:
        """Decode and check a peer's Hello.

        Raises:
            ProtocolError: not a Hello, a different protocol version, or the
                wrong role.
        """
        try:
            hello = self._hello_decoder.decode(body)
        except _DECODE_ERRORS as exc:
            raise ProtocolError(f"bad handshake: expected hello ({exc})") from exc
        if hello.protocol_version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"protocol version mismatch: peer pid {hello.pid} speaks "
                f"v{hello.protocol_version}, we speak v{PROTOCOL_VERSION}"
            )
        if expect_role is not None and hello.role != expect_role:
            raise ProtocolError(f"bad handshake: expected a {expect_role}, got a {hello.role}")
        return hello


def check_length(length: int, max_frame_bytes: int) -> None:
    """Raise ProtocolError if an announced frame length is over the limit."""
    if length > max_frame_bytes:
        raise ProtocolError(
            f"frame announces {length} bytes, over the {max_frame_bytes}-byte limit"
        )


class FrameSplitter:
    """Accumulates stream bytes and yields complete frame bodies.

    Args:
        max_frame_bytes: announced lengths above this raise ProtocolError as
            soon as the header is complete, before the body is buffered.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self._need: int | None = None  # body length once the header is read

    def feed(self, data: bytes) -> list[bytes]:
        """Add bytes; return the bodies of all frames now complete."""
        self._buffer += data
        bodies: list[bytes] = []
        while True:
            if self._need is None:
                if len(self._buffer) < HEADER.size:
                    return bodies
                (length,) = HEADER.unpack_from(self._buffer)
                check_length(length, self.max_frame_bytes)
                del self._buffer[: HEADER.size]
                self._need = length
            if len(self._buffer) < self._need:
                return bodies
            bodies.append(bytes(self._buffer[: self._need]))
            del self._buffer[: self._need]
            self._need = None

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held (0 at a frame boundary)."""
        return len(self._buffer) + (HEADER.size if self._need is not None else 0)

    def check_clean_eof(self) -> None:
        """Call at end of stream: raises ProtocolError on a truncated frame."""
        if self.pending:
            raise ProtocolError(f"stream ended inside a frame ({self.pending} bytes pending)")

"""Blocking frame channel over a pair of file descriptors (the runner's side)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from typing import Generic, TypeVar

import msgspec

from ipc.framing import ChannelClosed, Codec, FrameSplitter
from ipc.messages import PROTOCOL_VERSION, Hello, Role

T = TypeVar("T")

_READ_CHUNK = 1 << 16


class BlockingChannel(Generic[T]):
    """Sends any message and receives ``T`` frames over two pipe fds.

    ``send`` is thread-safe (a lock keeps frames whole); ``recv`` is meant
    for one reading thread.

    Args:
        read_fd: where frames from the peer arrive.
        write_fd: where our frames go.
        codec: the codec for this direction.
    """

    def __init__(self, read_fd: int, write_fd: int, codec: Codec[T]) -> None:
        self.read_fd = read_fd
        self.write_fd = write_fd
        self.codec = codec
        self._splitter = FrameSplitter(codec.max_frame_bytes)
        self._bodies: deque[bytes] = deque()
        self._send_lock = threading.Lock()
        self._closed = False

    def send(self, message: msgspec.Struct) -> None:
        """Write one frame. Raises BrokenPipeError if the peer is gone."""
        self._send_bytes(self.codec.frame(message))

    def _send_bytes(self, frames: bytes) -> None:
        data = memoryview(frames)
        with self._send_lock:
            while data:
                written = os.write(self.write_fd, data)
                data = data[written:]

    def _next_body(self) -> bytes:
        while not self._bodies:
            chunk = os.read(self.read_fd, _READ_CHUNK)
            if not chunk:
                self._splitter.check_clean_eof()
                raise ChannelClosed("peer closed the pipe")
            self._bodies.extend(self._splitter.feed(chunk))
        return self._bodies.popleft()

    def recv(self) -> T:
        """Block for the next message.

        Raises:
            ChannelClosed: clean end of stream.
            ProtocolError: malformed, oversized, truncated or wrong-typed frame.
        """
        return self.codec.decode(self._next_body())

    def handshake(
        self,
        role: Role,
        expect_role: Role,
        software_version: str = "",
        first: msgspec.Struct | None = None,
    ) -> Hello:
        """Send our Hello, read and check the peer's. Returns the peer's Hello.

        ``first`` is sent right behind our Hello, before the peer's arrives:
        a client's request then costs no extra round trip. A peer that
        rejects our Hello never acts on it.
        """
        hello = Hello(PROTOCOL_VERSION, os.getpid(), role, software_version)
        data = self.codec.frame(hello)
        if first is not None:
            data += self.codec.frame(first)
        self._send_bytes(data)
        return self.codec.decode_hello(self._next_body(), expect_role)

    def close(self) -> None:
        """Close both fds (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for fd in {self.read_fd, self.write_fd}:
            with contextlib.suppress(OSError):
                os.close(fd)

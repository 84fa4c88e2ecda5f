"""anyio frame channels: over any byte stream (unix sockets) or pipe fds."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import deque
from typing import Generic, TypeVar

import anyio
import msgspec
from anyio.abc import ByteStream, SocketAttribute

from ipc.framing import ChannelClosed, Codec, FrameSplitter
from ipc.messages import PROTOCOL_VERSION, Hello, Role

T = TypeVar("T")

_READ_CHUNK = 1 << 16


class FdStream(ByteStream):
    """A ByteStream over a read fd and a write fd (made non-blocking).

    The supervisor uses it for the pipe pair of each runner; it waits on the
    event loop's readiness notification, never polls.
    """

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd = read_fd
        self.write_fd = write_fd
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        self._closed = False
        self._write_closed = False  # by send_eof: its fd number may be reused
        # On asyncio the read fd stays in the selector while a reader keeps
        # coming back for more (see _wait_readable_asyncio).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._asyncio: bool | None = None  # False: not on asyncio (known at the first wait)
        self._watching = False
        self._waiter: asyncio.Future[None] | None = None

    async def receive(self, max_bytes: int = _READ_CHUNK) -> bytes:
        while True:
            if self._closed:
                raise anyio.ClosedResourceError
            try:
                data = os.read(self.read_fd, max_bytes)
            except BlockingIOError:
                if self._loop is None and self._asyncio is not False:
                    try:
                        self._loop = asyncio.get_running_loop()
                    except RuntimeError:  # another backend (trio)
                        self._asyncio = False
                if self._loop is not None:
                    await self._wait_readable_asyncio(self._loop)
                else:
                    await anyio.wait_readable(self.read_fd)
                continue
            if not data:
                raise anyio.EndOfStream
            return data

    async def _wait_readable_asyncio(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wait until the read fd is readable (or the stream is closed).

        ``anyio.wait_readable`` adds the fd to the selector and removes it
        again on every call: two ``epoll_ctl`` calls and a handle per frame
        from a runner. Here the fd stays registered while each readiness
        finds a reader waiting; one that finds none (the reader is busy
        elsewhere) unregisters it, so a level-triggered selector never spins.
        """
        if self._waiter is not None:
            raise anyio.BusyResourceError("reading from")
        waiter = self._waiter = loop.create_future()
        try:
            if not self._watching:
                loop.add_reader(self.read_fd, self._on_readable)
                self._watching = True
            await waiter
        finally:
            self._waiter = None

    def _on_readable(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        else:
            self._unwatch()

    def _unwatch(self) -> None:
        if self._watching and self._loop is not None:
            self._loop.remove_reader(self.read_fd)
        self._watching = False

    async def send(self, item: bytes) -> None:
        view = memoryview(item)
        while view:
            written = self.write_now(view)
            if not written:
                await anyio.wait_writable(self.write_fd)
                continue
            view = view[written:]

    def write_now(self, data: bytes | memoryview) -> int:
        """Write what the pipe takes of ``data`` now; the bytes written (0: full)."""
        if self._closed or self._write_closed:
            raise anyio.ClosedResourceError
        try:
            return os.write(self.write_fd, data)
        except BlockingIOError:
            return 0
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise anyio.BrokenResourceError from exc

    async def send_eof(self) -> None:
        if not self._write_closed:
            self._write_closed = True
            self._close_fd(self.write_fd)

    def _close_fd(self, fd: int) -> None:
        anyio.notify_closing(fd)
        with contextlib.suppress(OSError):
            os.close(fd)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._unwatch()  # out of the selector before its number can be reused
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)  # the blocked receive sees the stream closed
        self._close_fd(self.read_fd)
        await self.send_eof()


class AsyncChannel(Generic[T]):
    """Sends any message and receives ``T`` frames over an anyio ByteStream.

    Args:
        stream: the transport (a unix socket stream or an :class:`FdStream`).
        codec: the codec for this direction.
    """

    def __init__(self, stream: ByteStream, codec: Codec[T]) -> None:
        self.stream = stream
        self.codec = codec
        self._splitter = FrameSplitter(codec.max_frame_bytes)
        self._bodies: deque[bytes] = deque()
        self._send_lock = anyio.Lock(fast_acquire=True)  # no checkpoint when free
        self._raw_socket = stream.extra(SocketAttribute.raw_socket, None)

    async def send(self, message: msgspec.Struct, timeout_s: float | None = None) -> None:
        """Write one frame; a write that waits longer than ``timeout_s`` for
        the peer to read raises TimeoutError (the frame may be half sent).

        Raises:
            ChannelClosed: the peer has gone away.
        """
        await self._send_frame(self.codec.frame(message), timeout_s)

    async def send_body(self, body: bytes, timeout_s: float | None = None) -> None:
        """Write one frame whose body is already encoded (a relayed frame).

        Raises:
            ChannelClosed: the peer has gone away.
            ProtocolError: the body is over the frame limit.
        """
        await self._send_frame(self.codec.frame_body(body), timeout_s)

    async def _send_frame(self, frame: bytes, timeout_s: float | None) -> None:
        """Write ``frame`` at once when the transport takes it (most frames:
        no task switch, no timer), else what is left as the peer reads."""
        try:
            try:
                self._send_lock.acquire_nowait()  # never yields: nothing runs in between
            except anyio.WouldBlock:  # another frame is under way: wait our turn
                with anyio.fail_after(timeout_s):
                    async with self._send_lock:
                        await self.stream.send(frame)
                return
            try:
                written = self._write_now(frame)
                if written < len(frame):  # the rest as the peer reads, still holding the lock
                    with anyio.fail_after(timeout_s):
                        await self.stream.send(frame[written:])
            finally:
                self._send_lock.release()
        except TimeoutError:  # an OSError too, but the caller's to handle
            raise
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise ChannelClosed(f"peer gone: {exc!r}") from exc

    def _write_now(self, frame: bytes) -> int:
        """Write what the transport takes of ``frame`` without waiting; the
        bytes written (0 for a transport it cannot write to directly)."""
        if isinstance(self.stream, FdStream):
            return self.stream.write_now(frame)
        if self._raw_socket is None:
            return 0
        try:
            return int(self._raw_socket.send(frame))
        except BlockingIOError:
            return 0

    async def _next_body(self) -> bytes:
        while not self._bodies:
            try:
                chunk = await self.stream.receive(_READ_CHUNK)
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
                self._splitter.check_clean_eof()
                raise ChannelClosed("peer closed the connection") from None
            except anyio.ClosedResourceError:
                raise ChannelClosed("the connection was closed on our side") from None
            self._bodies.extend(self._splitter.feed(chunk))
        return self._bodies.popleft()

    async def recv(self) -> T:
        """Wait for the next message.

        Raises:
            ChannelClosed: clean end of stream.
            ProtocolError: malformed, oversized, truncated or wrong-typed frame.
        """
        return self.codec.decode(await self._next_body())

    async def recv_with_body(self) -> tuple[T, bytes]:
        """Like :meth:`recv`, also returning the frame's body as it came, so a
        relay can pass the frame on without encoding it again."""
        body = await self._next_body()
        return self.codec.decode(body), body

    async def handshake(self, role: Role, expect_role: Role, software_version: str = "") -> Hello:
        """Send our Hello, read and check the peer's. Returns the peer's Hello."""
        await self.send(Hello(PROTOCOL_VERSION, os.getpid(), role, software_version))
        return self.codec.decode_hello(await self._next_body(), expect_role)

    async def aclose(self) -> None:
        """Close the transport (idempotent)."""
        await self.stream.aclose()

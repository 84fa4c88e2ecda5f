"""The wire protocol: messages, framing, and the blocking and async channels.

Everything runs over real pipes and unix sockets; nothing sleeps. A test that
would hang if a channel waited for bytes it should not need carries a short
timeout instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import socket
import struct
import sys
import typing
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from anyio.abc import UNIXSocketStream

from ipc import (
    DEFAULT_MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    BlockingChannel,
    ChannelClosed,
    Codec,
    FrameSplitter,
    ProtocolError,
)
from ipc import messages as m
from ipc.aio import AsyncChannel, FdStream

UNIONS: dict[str, Any] = {
    "ClientMessage": m.ClientMessage,
    "ServerMessage": m.ServerMessage,
    "RunnerCommand": m.RunnerCommand,
    "RunnerEvent": m.RunnerEvent,
}

FAST = pytest.mark.timeout(15)  # for tests that would hang on a regression


# --- fixtures and helpers ----------------------------------------------------


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _open_fds() -> set[int]:
    # filtered after listing: the fd listdir itself used is closed by then
    return {fd for fd in map(int, os.listdir("/proc/self/fd")) if _is_open(fd)}


@pytest.fixture(autouse=True)
def no_fd_leaks() -> Iterator[None]:
    """Every fd a test opens is closed by its end (Linux only)."""
    if not sys.platform.startswith("linux") or not os.path.isdir("/proc/self/fd"):
        yield
        return
    before = _open_fds()
    yield
    leaked = _open_fds() - before
    for fd in leaked:  # don't let one failure cascade into the next tests
        with contextlib.suppress(OSError):
            os.close(fd)
    assert not leaked, f"test leaked fds {sorted(leaked)}"


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _close(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _header(length: int) -> bytes:
    return struct.pack(">I", length)


def _frame_body(body: bytes) -> bytes:
    return _header(len(body)) + body


@contextlib.contextmanager
def _blocking_pair(
    a_recv: Any, b_recv: Any, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> Iterator[tuple[BlockingChannel[Any], BlockingChannel[Any]]]:
    """Two BlockingChannels joined by two pipes (a -> b and b -> a)."""
    a_to_b_r, a_to_b_w = os.pipe()
    b_to_a_r, b_to_a_w = os.pipe()
    a = BlockingChannel(b_to_a_r, a_to_b_w, Codec(a_recv, max_frame_bytes))
    b = BlockingChannel(a_to_b_r, b_to_a_w, Codec(b_recv, max_frame_bytes))
    try:
        yield a, b
    finally:
        a.close()
        b.close()


@contextlib.contextmanager
def _reader_from_raw(
    recv_type: Any, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> Iterator[tuple[BlockingChannel[Any], int, int]]:
    """A BlockingChannel whose peer is raw fds: (channel, peer_write, peer_read)."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    channel = BlockingChannel(in_r, out_w, Codec(recv_type, max_frame_bytes))
    try:
        yield channel, in_w, out_r
    finally:
        channel.close()
        _close(in_w, out_r)


# --- building one instance of every message with non-default values ---------


def _value_for(t: msgspec.inspect.Type, name: str, counter: Iterator[int]) -> Any:
    n = next(counter)
    if isinstance(t, msgspec.inspect.IntType):
        return 1000 + n
    if isinstance(t, msgspec.inspect.FloatType):
        return n + 0.25
    if isinstance(t, msgspec.inspect.BoolType):
        return True
    if isinstance(t, msgspec.inspect.StrType):
        return f"{name}-{n}-é✓"  # non-ASCII on purpose
    if isinstance(t, msgspec.inspect.BytesType):  # raw bytes (an image, a vector's floats)
        return bytes([n % 256, 0, 255]) + f"{name}".encode()
    if isinstance(t, msgspec.inspect.LiteralType):
        return t.values[-1]
    if isinstance(t, msgspec.inspect.UnionType):
        non_none = [x for x in t.types if not isinstance(x, msgspec.inspect.NoneType)]
        return _value_for(non_none[0], name, counter)
    if isinstance(t, msgspec.inspect.ListType):
        return [_value_for(t.item_type, name, counter) for _ in range(2)]
    if isinstance(t, msgspec.inspect.VarTupleType):
        return tuple(_value_for(t.item_type, name, counter) for _ in range(2))
    if isinstance(t, msgspec.inspect.DictType):
        return {
            _value_for(t.key_type, f"{name}-key", counter): _value_for(
                t.value_type, f"{name}-value", counter
            )
            for _ in range(2)
        }
    if isinstance(t, msgspec.inspect.TupleType):
        return tuple(_value_for(item, name, counter) for item in t.item_types)
    if isinstance(t, msgspec.inspect.AnyType):  # JSON-like data (a tool's schema, ...)
        return {f"{name}-{n}": [n, f"é✓-{n}", {"nested": None}]}
    if isinstance(t, msgspec.inspect.StructType):
        return _instance(t.cls, counter)
    raise NotImplementedError(f"teach _value_for about {t!r} (field {name})")


def _instance(cls: type[msgspec.Struct], counter: Iterator[int] | None = None) -> Any:
    """One ``cls`` with every field set, away from its default (deterministic)."""
    counter = itertools.count(1) if counter is None else counter
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    kwargs = {f.name: _value_for(f.type, f.name, counter) for f in info.fields}
    for f in info.fields:  # a bool that defaults to True is set False
        if isinstance(f.type, msgspec.inspect.BoolType) and f.default is True:
            kwargs[f.name] = False
    return cls(**kwargs)


def _union_members(union: Any) -> tuple[type[msgspec.Struct], ...]:
    return typing.get_args(union)


def _tag(cls: type) -> Any:
    return cls.__struct_config__.tag


def _tagged_structs_in_module() -> list[type[msgspec.Struct]]:
    return [
        obj
        for obj in vars(m).values()
        if isinstance(obj, type)
        and issubclass(obj, msgspec.Struct)
        and obj.__module__ == m.__name__
        and _tag(obj) is not None
    ]


ROUND_TRIP_CASES = [
    pytest.param(union_name, cls, id=f"{union_name}-{cls.__name__}")
    for union_name, union in UNIONS.items()
    for cls in _union_members(union)
]


def _stream_messages() -> list[msgspec.Struct]:
    return [
        _instance(m.LoadProgress),
        m.StatusRequest(),  # an empty struct: the smallest body there is
        _instance(m.TextChunk),
        m.TextChunk(request_id=2, text="", generation_tokens=0),
        _instance(m.GenerationDone),
        _instance(m.StatusReply),
    ]


# --- the message catalogue ---------------------------------------------------


def test_every_union_member_is_a_tagged_struct() -> None:
    for union_name, union in UNIONS.items():
        members = _union_members(union)
        assert members, union_name
        for cls in members:
            assert issubclass(cls, msgspec.Struct), (union_name, cls)
            assert _tag(cls) is not None, f"{cls.__name__} in {union_name} has no tag"


def test_tags_are_unique_within_each_union() -> None:
    for union_name, union in UNIONS.items():
        tags = [_tag(cls) for cls in _union_members(union)]
        assert len(tags) == len(set(tags)), (union_name, tags)


def test_every_tagged_struct_travels_in_some_union() -> None:
    in_unions = {cls for union in UNIONS.values() for cls in _union_members(union)}
    orphans = [
        cls.__name__
        for cls in _tagged_structs_in_module()
        if cls not in in_unions and cls is not m.Hello  # Hello is the handshake
    ]
    assert not orphans, f"tagged structs in no union: {orphans}"


def test_sample_instances_differ_from_every_default() -> None:
    # so that a round trip can't pass by falling back on defaults
    for _, cls in [p.values for p in ROUND_TRIP_CASES]:
        sample = _instance(cls)
        for f in msgspec.inspect.type_info(cls).fields:
            if not f.required:
                default = f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
                assert getattr(sample, f.name) != default, (cls.__name__, f.name)


@pytest.mark.parametrize(("union_name", "cls"), ROUND_TRIP_CASES)
def test_message_round_trips_through_frame_splitter_and_codec(
    union_name: str, cls: type[msgspec.Struct]
) -> None:
    message = _instance(cls)
    codec = Codec(UNIONS[union_name])
    frame = codec.frame(message)
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4

    splitter = FrameSplitter()
    bodies = splitter.feed(frame)
    assert bodies == [frame[4:]]
    assert splitter.pending == 0

    decoded = codec.decode(bodies[0])
    assert type(decoded) is cls
    assert decoded == message


def test_hello_round_trips_through_decode_hello() -> None:
    hello = m.Hello(PROTOCOL_VERSION, 4242, "runner", "1.2.3")
    codec = Codec(m.RunnerEvent)
    (body,) = FrameSplitter().feed(codec.frame(hello))
    assert codec.decode_hello(body, "runner") == hello
    assert codec.decode_hello(body) == hello  # no role expectation


def test_message_outside_the_expected_union_is_refused() -> None:
    # Ping is a runner command: a client connection must not accept it
    body = Codec(m.RunnerCommand).frame(m.Ping(seq=3))[4:]
    with pytest.raises(ProtocolError, match="ping"):
        Codec(m.ClientMessage).decode(body)


def test_decode_accepts_a_memoryview() -> None:
    codec = Codec(m.RunnerCommand)
    body = codec.frame(m.Ping(seq=9))[4:]
    assert codec.decode(memoryview(body)) == m.Ping(seq=9)


# --- splitting a stream at every byte boundary -------------------------------


def _decode_all(codec: Codec[Any], bodies: list[bytes]) -> list[Any]:
    return [codec.decode(b) for b in bodies]


def test_stream_fed_byte_by_byte_yields_the_same_messages() -> None:
    codec = Codec(m.ServerMessage | m.ClientMessage)
    messages = _stream_messages()
    stream = b"".join(codec.frame(msg) for msg in messages)

    splitter = FrameSplitter()
    bodies: list[bytes] = []
    for i in range(len(stream)):
        bodies += splitter.feed(stream[i : i + 1])
    assert _decode_all(codec, bodies) == messages
    assert splitter.pending == 0
    splitter.check_clean_eof()


def test_stream_split_at_every_single_point_yields_the_same_messages() -> None:
    codec = Codec(m.ServerMessage | m.ClientMessage)
    messages = _stream_messages()
    stream = b"".join(codec.frame(msg) for msg in messages)

    for cut in range(len(stream) + 1):
        splitter = FrameSplitter()
        bodies = splitter.feed(stream[:cut]) + splitter.feed(stream[cut:])
        assert _decode_all(codec, bodies) == messages, f"split at {cut}"
        assert splitter.pending == 0


def test_pending_counts_the_bytes_of_an_incomplete_frame() -> None:
    frame = _frame_body(b"\x80" * 10)  # 14 bytes
    for cut in range(len(frame)):
        splitter = FrameSplitter()
        assert splitter.feed(frame[:cut]) == []
        assert splitter.pending == cut
    splitter = FrameSplitter()
    assert splitter.feed(frame) == [b"\x80" * 10]
    assert splitter.pending == 0


def test_feeding_empty_bytes_changes_nothing() -> None:
    splitter = FrameSplitter()
    assert splitter.feed(b"") == []
    assert splitter.feed(_header(1)) == []
    assert splitter.feed(b"") == []
    assert splitter.feed(b"\xc0") == [b"\xc0"]


def test_zero_length_frame_is_split_and_then_refused_by_the_codec() -> None:
    splitter = FrameSplitter()
    assert splitter.feed(_header(0) + _frame_body(b"\xc0")) == [b"", b"\xc0"]
    with pytest.raises(ProtocolError, match="bad frame"):
        Codec(m.RunnerCommand).decode(b"")


# --- oversized frames --------------------------------------------------------


def test_oversized_length_is_refused_before_reading_body() -> None:
    splitter = FrameSplitter(max_frame_bytes=100)
    header = _header(101)
    for byte in header[:3]:
        assert splitter.feed(bytes([byte])) == []
    with pytest.raises(ProtocolError, match=r"101 bytes, over the 100-byte limit"):
        splitter.feed(header[3:])  # the fourth header byte, and no body at all


def test_oversized_length_is_refused_in_a_chunk_holding_only_the_header() -> None:
    with pytest.raises(ProtocolError, match="over the 100-byte limit"):
        FrameSplitter(max_frame_bytes=100).feed(_header(101))


def test_default_limit_is_16_mib_and_named_in_the_error() -> None:
    assert DEFAULT_MAX_FRAME_BYTES == 16 * 1024 * 1024
    assert FrameSplitter().feed(_header(DEFAULT_MAX_FRAME_BYTES)) == []  # at the limit: waits
    with pytest.raises(ProtocolError, match=f"over the {DEFAULT_MAX_FRAME_BYTES}-byte limit"):
        FrameSplitter().feed(_header(DEFAULT_MAX_FRAME_BYTES + 1))


def test_largest_possible_announced_length_is_refused() -> None:
    with pytest.raises(ProtocolError, match=str(2**32 - 1)):
        FrameSplitter().feed(b"\xff\xff\xff\xff")


def test_frame_of_exactly_the_limit_is_accepted() -> None:
    body = b"x" * 100
    assert FrameSplitter(max_frame_bytes=100).feed(_frame_body(body)) == [body]


def test_oversized_frame_after_a_good_one_is_refused() -> None:
    splitter = FrameSplitter(max_frame_bytes=8)
    assert splitter.feed(_frame_body(b"12345678")) == [b"12345678"]
    with pytest.raises(ProtocolError, match="9 bytes"):
        splitter.feed(_header(9))


def test_codec_frame_refuses_to_send_a_body_over_the_limit() -> None:
    message = m.TextChunk(request_id=1, text="y" * 200, generation_tokens=1)
    body_len = len(msgspec.msgpack.encode(message))
    assert Codec(m.ServerMessage, max_frame_bytes=body_len).frame(message)  # at the limit
    with pytest.raises(ProtocolError) as err:
        Codec(m.ServerMessage, max_frame_bytes=body_len - 1).frame(message)
    text = str(err.value)
    assert "TextChunk" in text
    assert f"{body_len} bytes" in text
    assert f"over the {body_len - 1}-byte frame limit" in text


def test_codec_frame_refuses_over_the_default_limit() -> None:
    message = m.TextChunk(request_id=1, text="z" * DEFAULT_MAX_FRAME_BYTES, generation_tokens=1)
    with pytest.raises(ProtocolError, match=f"{DEFAULT_MAX_FRAME_BYTES}-byte frame limit"):
        Codec(m.ServerMessage).frame(message)


@FAST
def test_blocking_channel_honours_the_codec_limit_without_waiting_for_the_body() -> None:
    with _reader_from_raw(m.RunnerCommand, max_frame_bytes=64) as (channel, peer_w, _):
        assert channel.codec.max_frame_bytes == 64
        ok = msgspec.msgpack.encode(m.Shutdown(reason="r" * 30))
        assert len(ok) <= 64
        _write_all(peer_w, _frame_body(ok))
        assert channel.recv() == m.Shutdown(reason="r" * 30)
        # the peer announces 65 bytes and keeps the pipe open: recv must not wait
        _write_all(peer_w, _header(65))
        with pytest.raises(ProtocolError, match="65 bytes, over the 64-byte limit"):
            channel.recv()


@FAST
def test_blocking_channel_refuses_to_send_over_its_limit() -> None:
    with _blocking_pair(m.RunnerEvent, m.RunnerCommand, max_frame_bytes=32) as (a, b):
        with pytest.raises(ProtocolError, match="32-byte frame limit"):
            a.send(m.LoadFailed(error="e" * 100))
        # nothing went out: the channel is still in step
        a.send(m.Ping(seq=1))
        assert b.recv() == m.Ping(seq=1)


# --- truncated streams -------------------------------------------------------


def test_clean_eof_check_passes_at_a_frame_boundary() -> None:
    splitter = FrameSplitter()
    splitter.check_clean_eof()  # nothing ever arrived
    splitter.feed(_frame_body(b"\xc0") * 2)
    splitter.check_clean_eof()


@pytest.mark.parametrize("cut", [1, 2, 3], ids=lambda c: f"{c}-header-bytes")
def test_eof_in_the_middle_of_a_header_is_a_protocol_error(cut: int) -> None:
    splitter = FrameSplitter()
    splitter.feed(_frame_body(b"abc")[:cut])
    with pytest.raises(ProtocolError, match=rf"inside a frame \({cut} bytes pending\)"):
        splitter.check_clean_eof()


@pytest.mark.parametrize("body_bytes", [0, 1, 9], ids=lambda c: f"{c}-of-10-body-bytes")
def test_eof_in_the_middle_of_a_body_is_a_protocol_error(body_bytes: int) -> None:
    splitter = FrameSplitter()
    splitter.feed(_frame_body(b"\xc0") + _frame_body(b"0123456789")[: 4 + body_bytes])
    with pytest.raises(ProtocolError, match=rf"\({4 + body_bytes} bytes pending\)"):
        splitter.check_clean_eof()


def test_eof_at_every_cut_inside_a_stream_is_detected() -> None:
    codec = Codec(m.ServerMessage | m.ClientMessage)
    frames = [codec.frame(msg) for msg in _stream_messages()]
    stream = b"".join(frames)
    boundaries = set(itertools.accumulate(len(f) for f in frames)) | {0}
    for cut in range(len(stream) + 1):
        splitter = FrameSplitter()
        splitter.feed(stream[:cut])
        if cut in boundaries:
            splitter.check_clean_eof()
        else:
            with pytest.raises(ProtocolError, match="stream ended inside a frame"):
                splitter.check_clean_eof()


TRUNCATIONS = [
    pytest.param(lambda frame: frame[:2], id="mid-header"),
    pytest.param(lambda frame: frame[:4], id="header-only"),
    pytest.param(lambda frame: frame[: len(frame) - 1], id="mid-body"),
]


@FAST
@pytest.mark.parametrize("truncate", TRUNCATIONS)
def test_blocking_recv_on_a_pipe_closed_mid_frame_is_a_protocol_error(
    truncate: Callable[[bytes], bytes],
) -> None:
    frame = Codec(m.RunnerCommand).frame(m.Ping(seq=77))
    with _reader_from_raw(m.RunnerCommand) as (channel, peer_w, _):
        _write_all(peer_w, frame + truncate(frame))
        os.close(peer_w)
        assert channel.recv() == m.Ping(seq=77)
        with pytest.raises(ProtocolError, match="stream ended inside a frame"):
            channel.recv()


@FAST
def test_blocking_recv_at_a_frame_boundary_eof_is_channel_closed() -> None:
    with _reader_from_raw(m.RunnerCommand) as (channel, peer_w, _):
        _write_all(peer_w, Codec(m.RunnerCommand).frame(m.Cancel(request_id=5)))
        os.close(peer_w)
        assert channel.recv() == m.Cancel(request_id=5)
        with pytest.raises(ChannelClosed):
            channel.recv()
        with pytest.raises(ChannelClosed):  # and stays closed
            channel.recv()


@FAST
def test_blocking_recv_with_nothing_ever_sent_is_channel_closed() -> None:
    with _reader_from_raw(m.RunnerCommand) as (channel, peer_w, _):
        os.close(peer_w)
        with pytest.raises(ChannelClosed):
            channel.recv()


# --- garbage bodies ----------------------------------------------------------


def _enc(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


GARBAGE_BODIES = [
    pytest.param(b"\xc1", id="never-used-msgpack-byte"),
    pytest.param(random.Random(1234).randbytes(64), id="random-bytes"),
    pytest.param(b"\x92\x01", id="truncated-msgpack"),
    pytest.param(_enc({"type": "ping", "seq": 1}) + b"\x00", id="trailing-bytes"),
    pytest.param(_enc([1, 2, 3]), id="array-not-map"),
    pytest.param(_enc(17), id="int-not-map"),
    pytest.param(_enc("ping"), id="str-not-map"),
    pytest.param(_enc({"seq": 1}), id="no-tag"),
    pytest.param(_enc({"type": "no_such_message", "seq": 1}), id="unknown-tag"),
    pytest.param(_enc({"type": 7, "seq": 1}), id="int-tag"),
    pytest.param(_enc({"type": "ping", "seq": "one"}), id="wrong-typed-field"),
    pytest.param(_enc({"type": "ping", "seq": 1.5}), id="float-for-int"),
    pytest.param(_enc({"type": "ping"}), id="missing-required-field"),
    pytest.param(
        _enc({"type": "generate", "request_id": 1, "sampling": {"max_tokens": "x"}}),
        id="wrong-typed-nested-field",
    ),
    pytest.param(
        _enc({"type": "generate", "request_id": 1, "messages": [{"content": "hi"}]}),
        id="missing-nested-field",
    ),
    pytest.param(
        _enc({"type": "shutdown", "reason": "AB"}).replace(b"AB", b"\xff\xfe"),
        id="invalid-utf8-in-str-field",
    ),
    pytest.param(
        _enc({"type": "pinX", "seq": 1}).replace(b"pinX", b"pi\xc3\x28"),
        id="invalid-utf8-in-tag",
    ),
]


def _msgspec_description(body: bytes, recv_type: Any) -> str:
    """What msgspec itself says about ``body``."""
    try:
        msgspec.msgpack.decode(body, type=recv_type)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        return str(exc)
    raise AssertionError(f"msgspec accepted {body!r}")


@pytest.mark.parametrize("body", GARBAGE_BODIES)
def test_garbage_body_is_a_protocol_error_carrying_msgspecs_description(body: bytes) -> None:
    with pytest.raises(ProtocolError) as err:
        Codec(m.RunnerCommand).decode(body)
    description = _msgspec_description(body, m.RunnerCommand)
    assert description
    assert str(err.value) == f"bad frame: {description}"
    assert err.value.__cause__ is not None


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (_enc({"type": "no_such_message"}), "Invalid value 'no_such_message' - at `$.type`"),
        (_enc({"type": "ping", "seq": "one"}), "Expected `int`, got `str` - at `$.seq`"),
        (_enc({"type": "ping"}), "Object missing required field `seq`"),
        (_enc([1]), "Expected `object`, got `array`"),
    ],
    ids=["unknown-tag", "wrong-type", "missing-field", "wrong-shape"],
)
def test_protocol_error_says_what_was_wrong(body: bytes, expected: str) -> None:
    with pytest.raises(ProtocolError) as err:
        Codec(m.RunnerCommand).decode(body)
    assert expected in str(err.value)


def test_random_bodies_never_escape_as_anything_but_protocol_error() -> None:
    rng = random.Random(20240611)
    valid = [_enc(_instance(cls)) for cls in _union_members(m.ServerMessage)]
    codecs = [Codec(union) for union in UNIONS.values()]
    for _ in range(3000):
        body = bytearray(rng.choice(valid))
        for _ in range(rng.randrange(1, 4)):  # flip a few bytes
            body[rng.randrange(len(body))] = rng.randrange(256)
        for codec in codecs:
            for decode in (codec.decode, codec.decode_hello):
                with contextlib.suppress(ProtocolError):
                    decode(bytes(body))


def test_bad_body_does_not_desync_the_frame_splitter() -> None:
    codec = Codec(m.RunnerCommand)
    stream = (
        codec.frame(m.Ping(seq=1))
        + _frame_body(b"\xc1garbage")
        + _frame_body(_enc({"type": "ping", "seq": "x"}))
        + codec.frame(m.Ping(seq=2))
    )
    splitter = FrameSplitter()
    bodies = []
    for i in range(len(stream)):
        bodies += splitter.feed(stream[i : i + 1])
    assert len(bodies) == 4
    assert codec.decode(bodies[0]) == m.Ping(seq=1)
    for bad in bodies[1:3]:
        with pytest.raises(ProtocolError):
            codec.decode(bad)
    assert codec.decode(bodies[3]) == m.Ping(seq=2)


@FAST
@pytest.mark.parametrize("together", [True, False], ids=["one-write", "separate-writes"])
def test_blocking_recv_reads_the_next_good_frame_after_a_bad_body(together: bool) -> None:
    codec = Codec(m.RunnerCommand)
    frames = [
        _frame_body(b"\xc1"),
        _frame_body(_enc({"type": "ping"})),
        codec.frame(m.Ping(seq=3)),
    ]
    with _reader_from_raw(m.RunnerCommand) as (channel, peer_w, _):
        if together:
            _write_all(peer_w, b"".join(frames))
        for i, frame in enumerate(frames):
            if not together:
                _write_all(peer_w, frame)
            if i < 2:
                with pytest.raises(ProtocolError, match="bad frame"):
                    channel.recv()
        assert channel.recv() == m.Ping(seq=3)


# --- handshake ---------------------------------------------------------------


@FAST
def test_blocking_channels_shake_hands_across_two_pipes_in_two_threads() -> None:
    with (
        _blocking_pair(m.RunnerEvent, m.RunnerCommand) as (supervisor, runner),
        ThreadPoolExecutor(1) as pool,
    ):
        runner_side = pool.submit(runner.handshake, "runner", "supervisor", "runner-9")
        peer_of_supervisor = supervisor.handshake("supervisor", "runner", "sup-3")
        peer_of_runner = runner_side.result(timeout=10)

        assert peer_of_supervisor == m.Hello(PROTOCOL_VERSION, os.getpid(), "runner", "runner-9")
        assert peer_of_runner == m.Hello(PROTOCOL_VERSION, os.getpid(), "supervisor", "sup-3")

        # after the handshake the channels carry their unions, both ways
        supervisor.send(m.Ping(seq=11))
        assert runner.recv() == m.Ping(seq=11)
        runner.send(m.Pong(seq=11, memory=m.MemoryFigures(123, 4, 5)))
        assert supervisor.recv() == m.Pong(seq=11, memory=m.MemoryFigures(123, 4, 5))


@FAST
def test_handshake_sends_our_hello_with_pid_and_role() -> None:
    with _reader_from_raw(m.RunnerCommand) as (channel, peer_w, peer_r):
        _write_all(peer_w, Codec(m.Hello).frame(m.Hello(PROTOCOL_VERSION, 1, "supervisor")))
        channel.handshake("runner", "supervisor", "v-test")
        (body,) = FrameSplitter().feed(os.read(peer_r, 65536))
        ours = Codec(m.RunnerEvent).decode_hello(body, "runner")
        assert ours == m.Hello(PROTOCOL_VERSION, os.getpid(), "runner", "v-test")


@FAST
def test_frames_arriving_with_the_peer_hello_are_kept_for_recv() -> None:
    hello = Codec(m.Hello).frame(m.Hello(PROTOCOL_VERSION, 1, "supervisor"))
    ping = Codec(m.RunnerCommand).frame(m.Ping(seq=8))
    with _reader_from_raw(m.RunnerCommand) as (channel, peer_w, _):
        _write_all(peer_w, hello + ping)  # one write: likely one read
        channel.handshake("runner", "supervisor")
        assert channel.recv() == m.Ping(seq=8)


@FAST
def test_handshake_with_a_different_protocol_version_names_both_versions() -> None:
    assert PROTOCOL_VERSION != 999
    with _reader_from_raw(m.RunnerCommand) as (channel, peer_w, _):
        _write_all(peer_w, Codec(m.Hello).frame(m.Hello(999, 4242, "supervisor")))
        with pytest.raises(ProtocolError) as err:
            channel.handshake("runner", "supervisor")
    text = str(err.value)
    assert "version mismatch" in text
    assert "v999" in text
    assert f"v{PROTOCOL_VERSION}" in text
    assert "4242" in text


@FAST
def test_handshake_with_the_wrong_role_is_a_protocol_error() -> None:
    with _reader_from_raw(m.RunnerCommand) as (channel, peer_w, _):
        _write_all(peer_w, Codec(m.Hello).frame(m.Hello(PROTOCOL_VERSION, 1, "client")))
        with pytest.raises(ProtocolError, match="expected a supervisor, got a client"):
            channel.handshake("runner", "supervisor")


@FAST
def test_handshake_with_an_unknown_role_is_a_protocol_error() -> None:
    body = _enc({"type": "hello", "protocol_version": PROTOCOL_VERSION, "pid": 1, "role": "x"})
    with _reader_from_raw(m.RunnerCommand) as (channel, peer_w, _):
        _write_all(peer_w, _frame_body(body))
        with pytest.raises(ProtocolError, match="bad handshake: expected hello"):
            channel.handshake("runner", "supervisor")


@FAST
@pytest.mark.parametrize(
    "first_body",
    [
        pytest.param(_enc(m.Ping(seq=1)), id="a-command"),
        pytest.param(b"\xc1\xc1", id="garbage"),
        pytest.param(_enc({"type": "hello", "pid": 1, "role": "runner"}), id="hello-no-version"),
    ],
)
def test_non_hello_first_frame_is_a_protocol_error(first_body: bytes) -> None:
    with _reader_from_raw(m.RunnerCommand) as (channel, peer_w, _):
        _write_all(peer_w, _frame_body(first_body))
        with pytest.raises(ProtocolError, match="bad handshake: expected hello") as err:
            channel.handshake("runner", "supervisor")
    assert _msgspec_description(first_body, m.Hello) in str(err.value)


@FAST
def test_handshake_when_the_peer_leaves_first_is_channel_closed() -> None:
    with _reader_from_raw(m.RunnerCommand) as (channel, peer_w, _):
        os.close(peer_w)
        with pytest.raises(ChannelClosed):
            channel.handshake("runner", "supervisor")


# --- blocking channel: sending and closing -----------------------------------


@FAST
def test_concurrent_blocking_sends_keep_frames_whole() -> None:
    threads, per_thread, size = 4, 12, 100_000  # frames far above PIPE_BUF
    with (
        _blocking_pair(m.ServerMessage, m.ServerMessage) as (a, b),
        ThreadPoolExecutor(threads + 1) as pool,
    ):

        def sender(t: int) -> None:
            for i in range(per_thread):
                text = chr(ord("a") + t) * size
                a.send(m.TextChunk(request_id=t * 1000 + i, text=text, generation_tokens=i))

        def receiver() -> list[Any]:
            return [b.recv() for _ in range(threads * per_thread)]

        received = pool.submit(receiver)
        for f in [pool.submit(sender, t) for t in range(threads)]:
            f.result(timeout=10)
        got = received.result(timeout=10)

    assert sorted(c.request_id for c in got) == sorted(
        t * 1000 + i for t in range(threads) for i in range(per_thread)
    )
    for chunk in got:
        t = chunk.request_id // 1000
        assert chunk.text == chr(ord("a") + t) * size
        assert chunk.generation_tokens == chunk.request_id % 1000
    # each thread's frames arrive in its own order
    for t in range(threads):
        mine = [c.request_id for c in got if c.request_id // 1000 == t]
        assert mine == sorted(mine)


@FAST
def test_blocking_send_to_a_departed_peer_raises_broken_pipe() -> None:
    with _reader_from_raw(m.RunnerCommand) as (channel, _, peer_r):
        os.close(peer_r)
        with pytest.raises(BrokenPipeError):
            channel.send(m.Pong(seq=1))


def test_blocking_close_closes_both_fds_and_is_idempotent() -> None:
    r, w = os.pipe()
    channel = BlockingChannel(r, w, Codec(m.RunnerCommand))
    channel.close()
    for fd in (r, w):
        with pytest.raises(OSError):
            os.fstat(fd)
    # the numbers are free again: a second close must not touch their new owners
    r2, w2 = os.pipe()
    try:
        channel.close()
        os.fstat(r2)
        os.fstat(w2)
    finally:
        _close(r2, w2)


def test_blocking_close_over_one_socket_fd_closes_it_once() -> None:
    a, b = socket.socketpair()
    fd = a.detach()
    try:
        channel = BlockingChannel(fd, fd, Codec(m.ServerMessage))
        channel.close()
        with pytest.raises(OSError):
            os.fstat(fd)
    finally:
        b.close()


@FAST
def test_blocking_channel_over_a_socketpair_round_trips() -> None:
    a, b = socket.socketpair()
    fa, fb = a.detach(), b.detach()
    client = BlockingChannel(fa, fa, Codec(m.ServerMessage))
    server = BlockingChannel(fb, fb, Codec(m.ClientMessage))
    try:
        client.send(_instance(m.GenerateRequest))
        assert server.recv() == _instance(m.GenerateRequest)
        server.send(m.ErrorReply(code="protocol", message="nope"))
        assert client.recv() == m.ErrorReply(code="protocol", message="nope")
    finally:
        client.close()
        server.close()


# --- async channels ----------------------------------------------------------

BIG_TEXT = "0123456789abcdef" * (5 * 1024 * 1024 // 16)  # 5 MiB: many reads and writes


@contextlib.asynccontextmanager
async def _fd_stream_pair() -> typing.AsyncIterator[tuple[FdStream, FdStream]]:
    """Two FdStreams joined by two pipes."""
    a_to_b_r, a_to_b_w = os.pipe()
    b_to_a_r, b_to_a_w = os.pipe()
    a = FdStream(b_to_a_r, a_to_b_w)
    b = FdStream(a_to_b_r, b_to_a_w)
    try:
        yield a, b
    finally:
        await a.aclose()
        await b.aclose()


async def _a_waiting_receive_gets(
    a: FdStream,
    b: FdStream,
    data: bytes,
    while_waiting: Callable[[], typing.Awaitable[None]] | None = None,
) -> None:
    """A receive on ``b`` that waits (nothing is there yet) gets ``data``,
    sent on ``a`` after ``while_waiting``."""
    got: list[bytes] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:

            async def receive() -> None:
                got.append(await b.receive())

            tg.start_soon(receive)
            await anyio.wait_all_tasks_blocked()
            if while_waiting is not None:
                await while_waiting()
            await a.send(data)
    assert got == [data]


@contextlib.asynccontextmanager
async def _socket_stream_pair() -> typing.AsyncIterator[tuple[UNIXSocketStream, UNIXSocketStream]]:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        a = await UNIXSocketStream.from_socket(left)
    except BaseException:
        left.close()
        right.close()
        raise
    try:
        b = await UNIXSocketStream.from_socket(right)
    except BaseException:
        await a.aclose()
        right.close()
        raise
    try:
        yield a, b
    finally:
        await a.aclose()
        await b.aclose()


@contextlib.asynccontextmanager
async def _listener_stream_pair(
    path: Path,
) -> typing.AsyncIterator[tuple[anyio.abc.SocketStream, anyio.abc.SocketStream]]:
    """A client connection and the server's accepted side, via a socket file."""
    accepted: list[anyio.abc.SocketStream] = []
    async with (
        await anyio.create_unix_listener(path) as listener,
        anyio.create_task_group() as tg,
    ):

        async def accept() -> None:
            accepted.append(await listener.accept())

        tg.start_soon(accept)
        client = await anyio.connect_unix(path)
    try:
        yield client, accepted[0]
    finally:
        await client.aclose()
        await accepted[0].aclose()


TRANSPORTS = ["pipes", "socketpair", "unix-listener"]


@contextlib.asynccontextmanager
async def _channel_pair(
    transport: str, tmp_path: Path, a_recv: Any, b_recv: Any, max_frame_bytes: int
) -> typing.AsyncIterator[tuple[AsyncChannel[Any], AsyncChannel[Any]]]:
    pair: Any
    if transport == "pipes":
        pair = _fd_stream_pair()
    elif transport == "socketpair":
        pair = _socket_stream_pair()
    else:
        pair = _listener_stream_pair(tmp_path / "ipc.sock")
    async with pair as (sa, sb):
        a = AsyncChannel(sa, Codec(a_recv, max_frame_bytes))
        b = AsyncChannel(sb, Codec(b_recv, max_frame_bytes))
        try:
            yield a, b
        finally:
            await a.aclose()
            await b.aclose()


def _channels(
    transport: str,
    tmp_path: Path,
    a_recv: Any = m.ServerMessage,
    b_recv: Any = m.ClientMessage,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> Any:
    return _channel_pair(transport, tmp_path, a_recv, b_recv, max_frame_bytes)


@pytest.mark.anyio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_async_channels_round_trip_messages_both_ways(transport: str, tmp_path: Path) -> None:
    client_msgs = [_instance(cls) for cls in _union_members(m.ClientMessage)]
    server_msgs = [_instance(cls) for cls in _union_members(m.ServerMessage)]
    with anyio.fail_after(10):
        async with _channels(transport, tmp_path) as (client, server):
            for msg in client_msgs:
                await client.send(msg)
            for msg in server_msgs:
                await server.send(msg)
            assert [await server.recv() for _ in client_msgs] == client_msgs
            assert [await client.recv() for _ in server_msgs] == server_msgs


@pytest.mark.anyio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_async_channels_carry_a_large_frame_both_ways(transport: str, tmp_path: Path) -> None:
    to_server = m.LoadRequest(model="big", env={"PAYLOAD": BIG_TEXT})
    to_client = m.TextChunk(request_id=1, text=BIG_TEXT, generation_tokens=5)
    with anyio.fail_after(20):
        async with _channels(transport, tmp_path) as (client, server):
            got: dict[str, Any] = {}

            async def serve() -> None:
                got["server"] = await server.recv()
                await server.send(to_client)
                await server.send(m.ShutdownAck(runners=0))

            async with anyio.create_task_group() as tg:
                tg.start_soon(serve)
                await client.send(to_server)
                got["client"] = await client.recv()
                got["after"] = await client.recv()

    assert got["server"] == to_server
    assert got["client"] == to_client
    assert got["after"] == m.ShutdownAck(runners=0)


@pytest.mark.anyio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_async_channels_shake_hands(transport: str, tmp_path: Path) -> None:
    with anyio.fail_after(10):
        async with _channels(transport, tmp_path) as (client, server):
            async with anyio.create_task_group() as tg:
                peers: dict[str, m.Hello] = {}

                async def side(name: str, ch: AsyncChannel[Any], role: Any, expect: Any) -> None:
                    peers[name] = await ch.handshake(role, expect, f"{name}-1")

                tg.start_soon(side, "client", client, "client", "supervisor")
                tg.start_soon(side, "server", server, "supervisor", "client")
            await client.send(m.StatusRequest())
            assert await server.recv() == m.StatusRequest()

    assert peers["client"] == m.Hello(PROTOCOL_VERSION, os.getpid(), "supervisor", "server-1")
    assert peers["server"] == m.Hello(PROTOCOL_VERSION, os.getpid(), "client", "client-1")


@pytest.mark.anyio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_async_clean_eof_at_a_frame_boundary_is_channel_closed(
    transport: str, tmp_path: Path
) -> None:
    with anyio.fail_after(10):
        async with _channels(transport, tmp_path) as (client, server):
            await client.send(m.UnloadRequest(name="x"))
            await client.stream.send_eof()
            assert await server.recv() == m.UnloadRequest(name="x")
            with pytest.raises(ChannelClosed):
                await server.recv()
            # the other direction still works after a half close
            await server.send(m.ShutdownAck(runners=2))
            assert await client.recv() == m.ShutdownAck(runners=2)


@pytest.mark.anyio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_async_peer_closing_mid_frame_is_a_protocol_error(
    transport: str, tmp_path: Path
) -> None:
    frame = Codec(m.ClientMessage).frame(m.UnloadRequest(name="half"))
    with anyio.fail_after(10):
        async with _channels(transport, tmp_path) as (client, server):
            await client.stream.send(frame + frame[: len(frame) // 2])
            await client.stream.send_eof()
            assert await server.recv() == m.UnloadRequest(name="half")
            with pytest.raises(ProtocolError, match="stream ended inside a frame"):
                await server.recv()


@pytest.mark.anyio
@pytest.mark.parametrize("truncate", TRUNCATIONS)
async def test_async_recv_over_pipes_closed_mid_frame_is_a_protocol_error(
    truncate: Callable[[bytes], bytes],
) -> None:
    frame = Codec(m.RunnerEvent).frame(m.Pong(seq=1, memory=m.MemoryFigures(active_bytes=2)))
    r, w = os.pipe()
    sink_r, sink_w = os.pipe()
    channel = AsyncChannel(FdStream(r, sink_w), Codec(m.RunnerEvent))
    try:
        _write_all(w, frame + truncate(frame))
        os.close(w)
        with anyio.fail_after(10):
            assert await channel.recv() == m.Pong(seq=1, memory=m.MemoryFigures(active_bytes=2))
            with pytest.raises(ProtocolError, match="stream ended inside a frame"):
                await channel.recv()
    finally:
        await channel.aclose()
        _close(w, sink_r)


@pytest.mark.anyio
async def test_async_oversized_header_is_refused_without_waiting_for_the_body() -> None:
    r, w = os.pipe()
    sink_r, sink_w = os.pipe()
    channel = AsyncChannel(FdStream(r, sink_w), Codec(m.RunnerEvent, max_frame_bytes=1000))
    try:
        _write_all(w, _header(1001))  # and the writer stays open
        with anyio.fail_after(10), pytest.raises(ProtocolError, match="1000-byte limit"):
            await channel.recv()
    finally:
        await channel.aclose()
        _close(w, sink_r)


@pytest.mark.anyio
async def test_async_channel_refuses_to_send_over_its_limit() -> None:
    async with _fd_stream_pair() as (sa, sb):
        a = AsyncChannel(sa, Codec(m.RunnerEvent, max_frame_bytes=16))
        b = AsyncChannel(sb, Codec(m.RunnerCommand, max_frame_bytes=16))
        with pytest.raises(ProtocolError, match="16-byte frame limit"):
            await a.send(m.LoadModel(name="n" * 20, model="m"))
        await a.send(m.Ping(seq=4))
        with anyio.fail_after(10):
            assert await b.recv() == m.Ping(seq=4)


@pytest.mark.anyio
async def test_async_recv_reads_the_next_good_frame_after_a_bad_body() -> None:
    async with _fd_stream_pair() as (sa, sb):
        b = AsyncChannel(sb, Codec(m.RunnerCommand))
        await sa.send(
            _frame_body(_enc({"type": "cancel", "request_id": "x"}))
            + Codec(m.RunnerCommand).frame(m.Cancel(request_id=6))
        )
        with anyio.fail_after(10):
            with pytest.raises(ProtocolError, match="Expected `int`, got `str`"):
                await b.recv()
            assert await b.recv() == m.Cancel(request_id=6)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("hello", "match"),
    [
        (m.Hello(999, 4242, "runner"), f"v999, we speak v{PROTOCOL_VERSION}"),
        (m.Hello(PROTOCOL_VERSION, 1, "client"), "expected a runner, got a client"),
        (m.Ping(seq=1), "bad handshake: expected hello"),
    ],
    ids=["wrong-version", "wrong-role", "not-a-hello"],
)
async def test_async_handshake_refuses_a_bad_hello(hello: msgspec.Struct, match: str) -> None:
    async with _fd_stream_pair() as (supervisor_side, runner_side):
        channel = AsyncChannel(supervisor_side, Codec(m.RunnerEvent))
        await runner_side.send(Codec(m.Hello).frame(hello))
        with anyio.fail_after(10), pytest.raises(ProtocolError, match=match):
            await channel.handshake("supervisor", "runner")


@pytest.mark.anyio
async def test_async_handshake_when_the_peer_leaves_first_is_channel_closed() -> None:
    async with _fd_stream_pair() as (a, b):
        channel = AsyncChannel(a, Codec(m.RunnerEvent))
        await b.send_eof()
        with anyio.fail_after(10), pytest.raises(ChannelClosed):
            await channel.handshake("supervisor", "runner")


@pytest.mark.anyio
async def test_async_send_to_a_departed_peer_is_channel_closed() -> None:
    r, w = os.pipe()
    channel = AsyncChannel(FdStream(r, w), Codec(m.RunnerEvent))
    os.close(r)  # nobody reads our write end any more
    try:
        # the channel's read fd is already gone; only the write side matters here
        with pytest.raises(ChannelClosed, match="peer gone"):
            await channel.send(m.Ping(seq=1))
    finally:
        await channel.aclose()


@pytest.mark.anyio
async def test_async_send_over_a_closed_socket_peer_is_channel_closed() -> None:
    async with _socket_stream_pair() as (a, b):
        await b.aclose()
        channel = AsyncChannel(a, Codec(m.ServerMessage))
        with anyio.fail_after(10), pytest.raises(ChannelClosed):
            for _ in range(100):  # the first writes may still land in the buffer
                await channel.send(m.TextChunk(request_id=1, text="x" * 65536, generation_tokens=1))


@pytest.mark.anyio
async def test_concurrent_async_sends_keep_frames_whole() -> None:
    senders, per_sender, size = 4, 8, 200_000
    async with _fd_stream_pair() as (sa, sb):
        a = AsyncChannel(sa, Codec(m.ServerMessage))
        b = AsyncChannel(sb, Codec(m.ServerMessage))
        got: list[Any] = []

        async def send(s: int) -> None:
            for i in range(per_sender):
                text = chr(ord("A") + s) * size
                await a.send(m.TextChunk(request_id=s * 100 + i, text=text, generation_tokens=i))

        async def receive() -> None:
            for _ in range(senders * per_sender):
                got.append(await b.recv())

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(receive)
                for s in range(senders):
                    tg.start_soon(send, s)

    assert len(got) == senders * per_sender
    for chunk in got:
        assert chunk.text == chr(ord("A") + chunk.request_id // 100) * size
    for s in range(senders):
        mine = [c.request_id for c in got if c.request_id // 100 == s]
        assert mine == [s * 100 + i for i in range(per_sender)]


@pytest.mark.anyio
async def test_blocking_runner_and_async_supervisor_talk_over_pipes() -> None:
    """The real arrangement: a blocking runner thread, an async supervisor."""
    cmd_r, cmd_w = os.pipe()
    evt_r, evt_w = os.pipe()
    supervisor = AsyncChannel(FdStream(evt_r, cmd_w), Codec(m.RunnerEvent))
    runner = BlockingChannel(cmd_r, evt_w, Codec(m.RunnerCommand))

    def run_runner() -> m.Hello:
        peer = runner.handshake("runner", "supervisor", "runner-x")
        command = runner.recv()
        assert isinstance(command, m.Generate)
        runner.send(m.TextChunk(request_id=command.request_id, text=BIG_TEXT, generation_tokens=1))
        runner.send(_instance(m.GenerationDone))
        return peer

    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                result: dict[str, Any] = {}

                async def in_thread() -> None:
                    result["runner_peer"] = await anyio.to_thread.run_sync(run_runner)

                tg.start_soon(in_thread)
                peer = await supervisor.handshake("supervisor", "runner")
                await supervisor.send(_instance(m.Generate))
                chunk = await supervisor.recv()
                done = await supervisor.recv()
    finally:
        runner.close()
        await supervisor.aclose()

    assert peer == m.Hello(PROTOCOL_VERSION, os.getpid(), "runner", "runner-x")
    assert result["runner_peer"].role == "supervisor"
    assert chunk == m.TextChunk(
        request_id=_instance(m.Generate).request_id, text=BIG_TEXT, generation_tokens=1
    )
    assert done == _instance(m.GenerationDone)


# --- FdStream ----------------------------------------------------------------


@pytest.mark.anyio
async def test_fd_stream_makes_its_fds_non_blocking() -> None:
    r, w = os.pipe()
    stream = FdStream(r, w)
    try:
        assert not os.get_blocking(r)
        assert not os.get_blocking(w)
    finally:
        await stream.aclose()


@pytest.mark.anyio
async def test_fd_stream_aclose_closes_both_fds_and_is_idempotent() -> None:
    r, w = os.pipe()
    stream = FdStream(r, w)
    await stream.aclose()
    for fd in (r, w):
        with pytest.raises(OSError):
            os.fstat(fd)
    # the numbers are free again: a second aclose must not touch their new owners
    r2, w2 = os.pipe()
    try:
        await stream.aclose()
        os.fstat(r2)
        os.fstat(w2)
    finally:
        _close(r2, w2)


@pytest.mark.anyio
async def test_fd_stream_refuses_io_after_aclose() -> None:
    r, w = os.pipe()
    stream = FdStream(r, w)
    await stream.aclose()
    with pytest.raises(anyio.ClosedResourceError):
        await stream.receive()
    with pytest.raises(anyio.ClosedResourceError):
        await stream.send(b"x")


@pytest.mark.anyio
async def test_fd_stream_aclose_wakes_a_blocked_receive() -> None:
    async with _fd_stream_pair() as (a, _):
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                outcome: list[BaseException] = []

                async def receive() -> None:
                    try:
                        await a.receive()
                    except anyio.ClosedResourceError as exc:
                        outcome.append(exc)

                tg.start_soon(receive)
                await anyio.wait_all_tasks_blocked()
                await a.aclose()
        assert len(outcome) == 1


@pytest.mark.anyio
async def test_fd_stream_send_eof_ends_the_peer_stream_but_not_ours() -> None:
    async with _fd_stream_pair() as (a, b):
        await a.send(b"last")
        await a.send_eof()
        assert await b.receive() == b"last"
        with anyio.fail_after(10), pytest.raises(anyio.EndOfStream):
            await b.receive()
        await b.send(b"reply")
        assert await a.receive() == b"reply"
        with pytest.raises(anyio.ClosedResourceError):
            await a.send(b"more")


@pytest.mark.anyio
async def test_fd_stream_aclose_after_send_eof_leaves_a_reused_fd_alone() -> None:
    r, w = os.pipe()
    stream = FdStream(r, w)
    await stream.send_eof()
    await stream.send_eof()  # idempotent too
    r2, w2 = os.pipe()  # likely reuses the write fd's number
    try:
        await stream.aclose()
        os.fstat(r2)
        os.fstat(w2)
    finally:
        _close(r2, w2)
    with pytest.raises(OSError):
        os.fstat(r)


@pytest.mark.anyio
async def test_fd_stream_a_failed_registration_leaves_the_stream_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The event loop refusing the fd is that receive's error, not every later
    receive's (it must not leave a waiter behind: BusyResourceError)."""
    loop = asyncio.get_running_loop()
    async with _fd_stream_pair() as (a, b):

        def refuse(fd: int, callback: Callable[..., object], *args: object) -> None:
            raise OSError("the selector is full")

        monkeypatch.setattr(loop, "add_reader", refuse)
        with pytest.raises(OSError, match="selector is full"):
            await b.receive()
        monkeypatch.undo()
        await _a_waiting_receive_gets(a, b, b"after")


@pytest.mark.anyio
async def test_fd_stream_a_cancelled_receive_leaves_the_stream_usable() -> None:
    async with _fd_stream_pair() as (a, b):
        with anyio.move_on_after(0.05) as scope:
            await b.receive()
        assert scope.cancelled_caught
        with anyio.fail_after(10):
            # A readiness that finds no reader waiting takes the fd out of the
            # (level-triggered) selector, which would otherwise call back forever.
            await a.send(b"later")
            while b._watching:
                await anyio.lowlevel.checkpoint()
            assert await b.receive() == b"later"

        async def back_in_the_selector() -> None:
            assert b._watching

        await _a_waiting_receive_gets(a, b, b"and more", back_in_the_selector)


@pytest.mark.anyio
async def test_fd_stream_two_readers_at_once_is_a_busy_resource() -> None:
    async with _fd_stream_pair() as (a, b):

        async def a_second_receive() -> None:
            with pytest.raises(anyio.BusyResourceError):
                await b.receive()

        await _a_waiting_receive_gets(a, b, b"for the first", a_second_receive)


@pytest.mark.anyio
async def test_fd_stream_receive_honours_max_bytes() -> None:
    async with _fd_stream_pair() as (a, b):
        await a.send(b"abcdef")
        assert await b.receive(4) == b"abcd"
        assert await b.receive(4) == b"ef"


@pytest.mark.anyio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_peer_that_reads_nothing_times_a_send_out_and_frames_never_interleave(
    transport: str, tmp_path: Path
) -> None:
    """Sends write at once while the peer's buffer has room; then one waits
    (bounded by its timeout: TimeoutError, not a closed channel), and a frame
    sent meanwhile by another task waits behind it, whole."""
    text = "x" * 3000
    with anyio.fail_after(30):
        async with _channels(transport, tmp_path) as (reader, writer):
            sent = 0
            with pytest.raises(TimeoutError):
                while True:
                    await writer.send(m.TextChunk(1, text, sent), timeout_s=0.2)
                    sent += 1
            assert sent > 0
    # Two tasks at once on a fresh pair: every frame arrives whole, in some order.
    async with _channels(transport, tmp_path) as (reader, writer):

        async def burst(request_id: int) -> None:
            for i in range(200):
                await writer.send(m.TextChunk(request_id, text, i), timeout_s=10)

        received: list[Any] = []

        async def read_all() -> None:
            while len(received) < 400:
                received.append(await reader.recv())

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(read_all)
                tg.start_soon(burst, 1)
                tg.start_soon(burst, 2)
    for request_id in (1, 2):
        mine = [r.generation_tokens for r in received if r.request_id == request_id]
        assert mine == list(range(200)) and all(r.text == text for r in received)

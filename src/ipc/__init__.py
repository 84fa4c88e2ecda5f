"""The wire between clients, the supervisor and its runners.

Read :mod:`ipc.messages` for the protocol; :mod:`ipc.framing` for the frame
format; :mod:`ipc.blocking` and :mod:`ipc.aio` for the channels.
"""

from ipc.aio import AsyncChannel, FdStream
from ipc.blocking import BlockingChannel
from ipc.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    ChannelClosed,
    Codec,
    FrameSplitter,
    ProtocolError,
)
from ipc.messages import PROTOCOL_VERSION

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "AsyncChannel",
    "BlockingChannel",
    "ChannelClosed",
    "Codec",
    "FdStream",
    "FrameSplitter",
    "ProtocolError",
]

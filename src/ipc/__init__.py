"""The wire between clients, the supervisor and its runners.

Read :mod:`ipc.messages` for the protocol; :mod:`ipc.framing` for the frame
format; :mod:`ipc.blocking` and :mod:`ipc.aio` for the channels. The anyio
channels are imported from :mod:`ipc.aio` by the supervisor only: a runner
never imports anyio (its start-up pays for every import).
"""

from ipc.blocking import BlockingChannel
from ipc.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    ChannelClosed,
    Codec,
    FrameSplitter,
    FrameTooLarge,
    ProtocolError,
)
from ipc.messages import PROTOCOL_VERSION

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "BlockingChannel",
    "ChannelClosed",
    "Codec",
    "FrameSplitter",
    "FrameTooLarge",
    "ProtocolError",
]

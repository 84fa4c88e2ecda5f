"""One rank of a model sharded with ``mx.distributed``: joining the group and
agreeing with the other ranks.

Every rank runs the same requests through the same engine, so their
collectives (two ``all_sum`` per layer in a tensor-parallel forward pass)
line up. What one rank alone can know, a cancel that reached it first or its
own memory guard, is agreed on with one small ``all_sum`` per step, so every
rank stops at the same token. A rank never waits in a collective while idle:
it blocks on its pipe, and the next request reaches every rank from the
supervisor.

A peer that dies makes the next collective here raise (the ring backend says
``connection to a peer was lost``); the group cannot be used again, so the
runner exits and the supervisor restarts the group as a whole.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import tempfile
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import structlog

from ipc.messages import Distributed

__all__ = ["Group", "is_peer_lost", "join"]

log = structlog.get_logger("runner.distributed")

PEER_LOST_MARKERS = ("connection to a peer was lost", "Too many send/recv errors")


def is_peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is the backend saying a peer is gone."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(m in text for m in PEER_LOST_MARKERS)


class Group:
    """This process's place in an ``mx.distributed`` group."""

    def __init__(self, spec: Distributed, group: Any) -> None:
        self.spec = spec
        self.group = group
        self.rank: int = group.rank()
        self.size: int = group.size()

    def agree(self, *flags: bool) -> list[bool]:
        """Each flag, true if it is true on any rank (one ``all_sum``).

        Every rank must call this at the same point with as many flags."""
        local = mx.array([int(f) for f in flags], dtype=mx.int32)
        total = mx.distributed.all_sum(local, group=self.group, stream=mx.cpu)
        return [bool(total[i].item()) for i in range(len(flags))]

    def agree_with_step(self, stop: bool, cancelled: bool, size: int) -> tuple[bool, bool, int]:
        """Each flag, true if it is true on any rank, and rank 0's ``size``
        (a step's size each rank would choose from its own timings), in one
        ``all_sum``. Every rank must call this at the same point."""
        size = size if self.rank == 0 else 0
        local = mx.array([int(stop), int(cancelled), size], dtype=mx.int32)  # a step: < 2**31
        total = mx.distributed.all_sum(local, group=self.group, stream=mx.cpu)
        values = cast(list[int], total.tolist())
        return bool(values[0]), bool(values[1]), values[2]

    def same_seed(self) -> None:
        """Seed every rank's generator alike: sampling with a temperature then
        draws the same tokens everywhere."""
        state: mx.array = mx.random.state[0]  # type: ignore[index]
        seed = mx.distributed.all_sum(state, group=self.group, stream=mx.cpu)
        mx.random.seed(cast(int, seed.view(mx.uint64).item()))


def join(spec: Distributed) -> Group:
    """Join the group ``spec`` describes (blocks until every rank has joined).

    The ring backend reads its rank and host list from the environment. Its
    ``init`` holds the GIL and has no timeout of its own: the supervisor
    starts the last rank only once the others listen, and kills the group
    if it does not form in time.

    Raises:
        RuntimeError: the backend could not form the group.
    """
    log.info("distributed_joining", rank=spec.rank, size=spec.size, backend=spec.backend)
    with contextlib.ExitStack() as stack:
        hostfile = spec.hostfile
        if hostfile is None:  # on another machine than the supervisor: our own, read by init
            directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="mlx-ring-"))
            path = Path(directory) / "hosts.json"
            path.write_text(json.dumps([[host] for host in spec.hosts]), encoding="utf-8")
            hostfile = str(path)
        os.environ["MLX_RANK"] = str(spec.rank)
        os.environ["MLX_HOSTFILE"] = hostfile
        # init holds the GIL and never gives up waiting for a peer: a C thread
        # ends the process if it takes too long (the supervisor also would,
        # but not a remote rank's once its ssh session is gone).
        faulthandler.dump_traceback_later(spec.join_timeout_s, exit=True)
        try:
            group = mx.distributed.init(strict=True, backend=spec.backend)
        finally:
            faulthandler.cancel_dump_traceback_later()
    if group.size() != spec.size or group.rank() != spec.rank:
        raise RuntimeError(
            f"joined as rank {group.rank()} of {group.size()}, expected {spec.rank} of {spec.size}"
        )
    log.info("distributed_joined", rank=spec.rank, size=spec.size)
    return Group(spec, group)

"""Where the ranks of a group run: ``ranks`` on loopback, or the hosts of an
``mlx.launch`` hostfile. Pure (no processes, no event loop): the config checks a
hostfile with it when it loads, the group places its ranks with it."""

from __future__ import annotations

import errno
import functools
import os
import re
import socket
import stat
from typing import Protocol

import msgspec

__all__ = ["LOOPBACK", "Place", "free_ports", "group_places", "is_group", "local_names"]

LOOPBACK = "127.0.0.1"
MAX_HOSTFILE_BYTES = 1 << 20
"""A hostfile lists a few hosts: one larger than this is refused unread."""
SSH_DESTINATION = re.compile(r"[A-Za-z0-9_.:\[\]%][A-Za-z0-9_.:\[\]%@-]*")
"""A host (``user@host``, an IP): no leading ``-``, no space or shell character."""


class RankSpec(Protocol):
    """What placement reads of a model's spec (a ``ModelConfig``)."""

    @property
    def hostfile(self) -> str | None: ...
    @property
    def ranks(self) -> int | None: ...


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on loopback now (bound to port 0 and
    closed: the kernel's choice, so two groups do not pick the same one)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((LOOPBACK, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class HostEntry(msgspec.Struct):
    """One line of an ``mlx.launch`` hostfile: where to ssh, which IPs the
    ring may use there (the first is used)."""

    ssh: str
    ips: list[str] = []


class Place(msgspec.Struct, frozen=True):
    """Where one rank runs: ``host`` None is this machine (spawned directly),
    else the ssh destination; ``ip`` is the address its ring listens on."""

    host: str | None
    ip: str


@functools.cache
def local_names() -> frozenset[str]:
    """This machine's names (a reverse lookup: once per daemon)."""
    name = socket.gethostname()
    return frozenset({"localhost", "127.0.0.1", "::1", name, name.split(".")[0], socket.getfqdn()})


def read_hostfile(path: str) -> bytes:
    """The bytes of the hostfile at ``path``, which must be a regular file
    of at most :data:`MAX_HOSTFILE_BYTES`. Opened without blocking and
    checked before it is read: a FIFO would block the reader until someone
    writes to it, a device (``/dev/zero``) or a huge file would fill memory.

    Raises:
        OSError: it cannot be opened or read, or it is no such file.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if info.st_size > MAX_HOSTFILE_BYTES:
            raise OSError(errno.EFBIG, f"over {MAX_HOSTFILE_BYTES} bytes ({info.st_size})")
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read(MAX_HOSTFILE_BYTES + 1)  # it may have grown since the fstat
    finally:
        os.close(fd)
    if len(data) > MAX_HOSTFILE_BYTES:
        raise OSError(errno.EFBIG, f"over {MAX_HOSTFILE_BYTES} bytes")
    return data


def group_places(spec: RankSpec) -> list[Place]:
    """Where each rank of ``spec`` runs: ``ranks`` on loopback, or one per
    entry of its hostfile (accepted as a list or as ``{"hosts": [...]}``).
    Reads the hostfile (:func:`read_hostfile`: never blocks on a FIFO):
    an async caller runs it in a worker thread (a slow disk).

    Raises:
        ValueError: an unreadable hostfile (or one that is not a small
            regular file), fewer than 2 ranks (the ring would connect to
            itself), or ``ranks`` that disagrees with it.
    """
    if spec.hostfile is None:
        return [Place(None, LOOPBACK) for _ in range(spec.ranks or 1)]
    try:
        raw = msgspec.json.decode(read_hostfile(spec.hostfile))
        listed = raw["hosts"] if isinstance(raw, dict) else raw
        entries = msgspec.convert(listed, list[HostEntry])
    except OSError as exc:
        raise ValueError(f"cannot read hostfile {spec.hostfile}: {exc.strerror or exc}") from None
    except (KeyError, TypeError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"cannot read hostfile {spec.hostfile}: {exc}") from None
    if len(entries) < 2:
        raise ValueError(f"hostfile {spec.hostfile} lists {len(entries)} host(s); a group needs 2")
    if spec.ranks is not None and spec.ranks != len(entries):
        raise ValueError(f"ranks = {spec.ranks} but hostfile {spec.hostfile} lists "
                         f"{len(entries)} hosts")  # fmt: skip
    local = local_names()
    mixed = any(entry.ssh not in local for entry in entries)
    places = []
    for entry in entries:
        if not SSH_DESTINATION.fullmatch(entry.ssh):  # never an ssh option, never a shell word
            raise ValueError(f"hostfile {spec.hostfile}: {entry.ssh!r} is not a host name")
        here = entry.ssh in local
        # Only a ring all on this machine may default to loopback.
        ip = entry.ips[0] if entry.ips else (LOOPBACK if here and not mixed else "")
        if not ip:
            raise ValueError(f"hostfile {spec.hostfile}: {entry.ssh} has no ips for the ring")
        places.append(Place(None if here else entry.ssh, ip))
    return places


def is_group(spec: RankSpec) -> bool:
    return spec.hostfile is not None or (spec.ranks or 1) > 1

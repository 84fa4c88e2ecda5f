"""Who may talk to the daemon, and what a request may ask of it.

The daemon serves only its own user (plus the uids in ``allowed_uids``):
every connection's peer credentials are read from the kernel. Its socket
lives in a private directory (0700, owned by the daemon's user). A request's
runner environment and model name are checked before anything is spawned.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import stat
import struct
import sys
from pathlib import Path
from typing import NamedTuple

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Names that change what code a runner executes: its loader, its interpreter,
# libraries it dlopens (OpenSSL providers, iconv modules), or where Python finds
# user site-packages and config.
FORBIDDEN_ENV_PREFIXES = ("LD_", "DYLD_", "PYTHON", "OPENSSL_", "XDG_")
FORBIDDEN_ENV_NAMES = {"GCONV_PATH", "HOME", "PATH", "NLSPATH", "LOCPATH", "SSL_CERT_FILE",
                       "SSL_CERT_DIR", "BASH_ENV", "ENV"}  # fmt: skip
MODEL_NAME_MAX = 64


class Credentials(NamedTuple):
    """A socket peer as the kernel reports it; ``pid`` is None where unknown."""

    pid: int | None
    uid: int


class InsecurePath(Exception):
    """The socket's directory could be used by someone else; says what is wrong."""


def peer_credentials(sock: socket.socket) -> Credentials:
    """The uid (and pid where the OS says) of the process at the other end.

    Linux: SO_PEERCRED. macOS: LOCAL_PEERCRED (uid) and LOCAL_PEERPID.

    Raises:
        OSError: the OS cannot tell (an unsupported platform included).
    """
    if sys.platform.startswith("linux"):
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
        pid, uid, _gid = struct.unpack("iII", raw)
        return Credentials(pid, uid)
    if sys.platform == "darwin":
        sol_local, local_peercred, local_peerpid = 0, 0x001, 0x002
        # struct xucred { u_int cr_version; uid_t cr_uid; short cr_ngroups; gid_t cr_groups[16]; }
        raw = sock.getsockopt(sol_local, local_peercred, struct.calcsize("IIh16I"))
        _version, uid = struct.unpack_from("II", raw)
        try:
            (pid,) = struct.unpack("i", sock.getsockopt(sol_local, local_peerpid, 4))
        except OSError:
            return Credentials(None, uid)
        return Credentials(pid, uid)
    raise OSError(f"peer credentials are not supported on {sys.platform}")


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` as 0700 if missing; refuse one others could write to.

    Raises:
        InsecurePath: it is not a directory (or is a symlink), is owned by
            another user, or is writable by group or others.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise InsecurePath(f"{path} is not a directory (a symlink or a file); not using it")
    if info.st_uid != os.geteuid():
        raise InsecurePath(
            f"{path} is owned by uid {info.st_uid}, not by us (uid {os.geteuid()}); "
            "another user could have made it: remove it or choose another socket path"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise InsecurePath(
            f"{path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o}); "
            f"run `chmod 700 {path}` or choose another socket path"
        )


def env_problem(env: dict[str, str]) -> str | None:
    """Why a runner environment from a request is refused, or None if it is fine."""
    for name, value in env.items():
        if not ENV_NAME.fullmatch(name):
            return f"environment variable name {name!r} is not [A-Za-z_][A-Za-z0-9_]*"
        if name.upper().startswith(FORBIDDEN_ENV_PREFIXES) or name.upper() in FORBIDDEN_ENV_NAMES:
            return f"environment variable {name} would change what code the runner runs"
        if "\x00" in value:
            return f"environment variable {name} holds a NUL byte"
    return None


def model_name_problem(name: str) -> str | None:
    """Why ``name`` is not a usable model name, or None."""
    if not name:
        return "a model name must not be empty"
    if len(name) > MODEL_NAME_MAX:
        return f"a model name has at most {MODEL_NAME_MAX} characters, got {len(name)}"
    if "/" in name or not name.isprintable():
        return f"model name {name!r} must be printable and hold no '/'"
    return None


def model_reference_problem(model: str) -> str | None:
    """Why ``model`` (a repo id, local path or ``builtin:`` name) is refused, or
    None. (Its length is bounded by ModelConfig, since it shows in every status.)"""
    if not model.isprintable():
        return "a model reference must be printable (no control characters)"
    return None

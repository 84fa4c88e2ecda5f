"""Where the daemon keeps its socket and state, following the XDG variables."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

SOCKET_ENV = "MLX_SUPERVISOR_SOCKET"
APP_DIR = "mlx-supervisor"


def runtime_dir() -> Path:
    """Per-user runtime dir: ``$XDG_RUNTIME_DIR/mlx-supervisor``, or the per-user
    temp dir (``$TMPDIR`` on macOS is already per user) with the uid in the name."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / APP_DIR
    base = Path(tempfile.gettempdir())
    if sys.platform == "darwin":
        return base / APP_DIR
    return base / f"{APP_DIR}-{os.getuid()}"


def default_socket_path() -> Path:
    """``$MLX_SUPERVISOR_SOCKET`` if set, else ``supervisor.sock`` in the runtime dir."""
    env = os.environ.get(SOCKET_ENV)
    if env:
        return Path(env)
    return runtime_dir() / "supervisor.sock"


def state_dir() -> Path:
    """``$XDG_STATE_HOME/mlx-supervisor`` (default ``~/.local/state/mlx-supervisor``)."""
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return base / APP_DIR


def config_dir() -> Path:
    """``$XDG_CONFIG_HOME/mlx-supervisor`` (default ``~/.config/mlx-supervisor``)."""
    xdg = os.environ.get("XDG_CONFIG_HOME")
    base = Path(xdg) if xdg else Path.home() / ".config"
    return base / APP_DIR


def default_config_path() -> Path:
    """The config file ``serve`` reads when ``--config`` is not given (if it exists)."""
    return config_dir() / "config.toml"

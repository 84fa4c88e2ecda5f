"""The daemon's configuration: a TOML file decoded into msgspec Structs.

Every key has a default; an unknown key is an error that names it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from ipc.framing import DEFAULT_MAX_FRAME_BYTES

RestartStrategy = Literal["always", "on-failure", "never"]


class ConfigError(Exception):
    """The config file is unreadable or invalid; the message says where."""


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Settings for one model, applied whenever a model of this name loads."""

    name: str
    model: str
    max_tokens: int | None = None  # cap on every request's max_tokens
    env: dict[str, str] = {}  # added to the runner's environment
    preload: bool = False  # load when the daemon starts
    restart: RestartStrategy | None = None  # default: the daemon's restart setting


class SupervisorConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Settings of the daemon; see configs/mlx-supervisor.toml for each key."""

    socket_path: str | None = None
    # unload and shutdown escalation
    shutdown_grace_s: float = 5.0
    term_grace_s: float = 3.0
    handshake_timeout_s: float = 30.0
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    runner_stderr_lines: int = 20
    # restart policy (OTP-style restart intensity)
    restart: RestartStrategy = "always"
    max_restarts: int = 5
    restart_window_s: float = 60.0
    restart_backoff_s: float = 0.5
    restart_backoff_cap_s: float = 30.0
    retry_unstarted: bool = True
    queue_timeout_s: float = 300.0
    # stall watchdog: no progress for this long in a phase means hung
    load_stall_s: float = 300.0
    prefill_stall_s: float = 120.0
    decode_stall_s: float = 30.0
    ping_timeout_s: float = 10.0
    stall_kill_grace_s: float = 0.5
    # process management
    hot_spare: bool = True
    restore_on_start: bool = True
    models: list[ModelConfig] = []

    @property
    def ping_interval_s(self) -> float:
        """How often an idle runner is pinged: a few pings fit in the timeout."""
        return self.ping_timeout_s / 4

    def model_config(self, name: str) -> ModelConfig | None:
        """The configured settings for the model called ``name``, if any."""
        return next((m for m in self.models if m.name == name), None)


def load_config(path: Path | None) -> SupervisorConfig:
    """Read ``path`` (or return the defaults when it is None).

    Raises:
        ConfigError: the file is missing, not TOML, or has a bad or unknown key.
    """
    if path is None:
        return SupervisorConfig()
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    try:
        config = msgspec.toml.decode(data, type=SupervisorConfig)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"invalid config {path}: {exc}") from exc
    names = [m.name for m in config.models]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"invalid config {path}: model names repeated: {', '.join(duplicates)}")
    return config

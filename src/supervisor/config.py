"""The daemon's configuration: a TOML file decoded into msgspec Structs.

Every key has a default; an unknown key is an error that names it.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from ipc.framing import DEFAULT_MAX_FRAME_BYTES


class ConfigError(Exception):
    """The config file is unreadable or invalid; the message says where."""


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Settings for one model, applied whenever a model of this name loads."""

    name: str
    model: str
    max_tokens: int | None = None  # cap on every request's max_tokens
    env: dict[str, str] = {}  # added to the runner's environment
    preload: bool = False  # load when the daemon starts


class SupervisorConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Settings of the daemon; see configs/mlx-supervisor.toml for each key."""

    socket_path: str | None = None
    shutdown_grace_s: float = 5.0
    term_grace_s: float = 3.0
    handshake_timeout_s: float = 30.0
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    runner_stderr_lines: int = 20
    models: list[ModelConfig] = []

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

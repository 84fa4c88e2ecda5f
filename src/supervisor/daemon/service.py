"""Service files for running the daemon under launchd (macOS) or systemd (Linux).

The templates ship as package data in ``supervisor/daemon/service_templates/`` (with
identical copies in the repository's ``configs/``). They hold ``@NAME@``
placeholders that :func:`render_service` fills in:

``@COMMAND@``
    the argv prefix that runs the daemon, up to and including ``serve``;
``@SOCKET@``
    the daemon's socket path (``--socket`` and ``MLX_SUPERVISOR_SOCKET``);
``@CONFIG_ARGS@``
    ``--config PATH``, or nothing when there is no config file;
``@LOG_DIR@``
    the directory for the stdout/stderr log files.

The plist is read and written with :mod:`plistlib` (the template's comments
are for readers of the file in ``configs/``; the rendered plist is plistlib's);
the unit's values are quoted and escaped per systemd.syntax(7) (``%``
specifiers and ``$`` variable expansion included).
"""

from __future__ import annotations

import os
import plistlib
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any

from supervisor.daemon.paths import SOCKET_ENV as SOCKET_ENV_VAR

__all__ = [
    "LAUNCHD_LABEL",
    "SERVICE_KINDS",
    "SOCKET_ENV_VAR",
    "SYSTEMD_UNIT_NAME",
    "TEMPLATE_NAMES",
    "install_hint",
    "read_template",
    "render_service",
    "service_install_path",
]

SERVICE_KINDS = ("launchd", "systemd")

LAUNCHD_LABEL = "com.github.mlx-supervisor"
SYSTEMD_UNIT_NAME = "mlx-supervisor.service"

#: Template file name per kind, inside ``supervisor/daemon/service_templates/``.
TEMPLATE_NAMES: Mapping[str, str] = {
    "launchd": f"{LAUNCHD_LABEL}.plist",
    "systemd": SYSTEMD_UNIT_NAME,
}

_TEMPLATE_DIR = "service_templates"
_PLACEHOLDER = re.compile(r"@([A-Z_]+)@")
# Words systemd takes literally without quoting (no quotes, specifiers, `$`, spaces).
_SYSTEMD_BARE_WORD = re.compile(r"[A-Za-z0-9_+=:,./@-]+")
# Characters that, leading ExecStart's first word, systemd reads as prefixes.
_SYSTEMD_EXEC_PREFIXES = "-@+!:|"


def _check_kind(kind: str) -> None:
    if kind not in SERVICE_KINDS:
        raise ValueError(
            f"unknown service kind {kind!r}; expected one of: {', '.join(SERVICE_KINDS)}"
        )


def read_template(kind: str) -> str:
    """Return the unrendered template for *kind* from the package data."""
    _check_kind(kind)
    resource = files("supervisor.daemon").joinpath(_TEMPLATE_DIR).joinpath(TEMPLATE_NAMES[kind])
    return resource.read_text(encoding="utf-8")


def _check_value(what: str, value: str) -> str:
    """Reject values no service file can carry: control characters, non-UTF-8."""
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value):
        raise ValueError(f"{what} contains a control character: {value!r}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid UTF-8: {value!r}") from exc
    return value


def _abs_path(what: str, path: Path) -> str:
    return _check_value(what, str(Path(path).expanduser().absolute()))


def render_service(
    kind: str,
    *,
    command: Sequence[str],
    socket_path: Path,
    config_path: Path | None,
    log_dir: Path | None = None,
) -> str:
    """Render the service file for *kind* ("launchd" or "systemd").

    *command* is the argv prefix that runs the daemon, up to and including
    ``serve`` (e.g. ``[sys.executable, "-m", "supervisor", "serve"]``); the
    service runs ``command + ["--socket", socket_path]`` plus
    ``["--config", config_path]`` when *config_path* is given. Paths are made
    absolute (``~`` expanded). *log_dir* defaults to
    ``~/Library/Logs/mlx-supervisor`` for launchd; for systemd, None leaves
    output in the journal and a directory appends to files there instead.
    Raises ValueError for an unknown kind or a value the format cannot carry.
    """
    _check_kind(kind)
    if isinstance(command, str) or not command:
        raise ValueError("command must be a non-empty sequence of arguments")
    argv = [_check_value("command argument", str(arg)) for arg in command]
    socket = _abs_path("socket path", socket_path)
    config_args = (
        ["--config", _abs_path("config path", config_path)] if config_path is not None else []
    )
    template = read_template(kind)
    if kind == "launchd":
        logs = _abs_path(
            "log directory",
            log_dir if log_dir is not None else Path.home() / "Library/Logs/mlx-supervisor",
        )
        return _render_plist(template, argv, socket, config_args, logs)
    logs_or_none = _abs_path("log directory", log_dir) if log_dir is not None else None
    return _render_systemd(template, argv, socket, config_args, logs_or_none)


# --- launchd -----------------------------------------------------------------


def _render_plist(
    template: str, argv: list[str], socket: str, config_args: list[str], log_dir: str
) -> str:
    lists = {"COMMAND": argv, "CONFIG_ARGS": config_args}
    scalars = {"SOCKET": socket, "LOG_DIR": log_dir}

    def fill(value: Any) -> Any:
        """The template value with its placeholders filled in; a list item that
        is only ``@COMMAND@`` or ``@CONFIG_ARGS@`` becomes zero or more items."""
        if isinstance(value, dict):
            return {key: fill(item) for key, item in value.items()}
        if isinstance(value, list):
            out: list[Any] = []
            for item in value:
                whole = _PLACEHOLDER.fullmatch(item) if isinstance(item, str) else None
                if whole is not None and whole.group(1) in lists:
                    out.extend(lists[whole.group(1)])
                else:
                    out.append(fill(item))
            return out
        if isinstance(value, str):
            # One pass, so a value that happens to contain "@NAME@" is never re-expanded.
            return _PLACEHOLDER.sub(_lookup(scalars, "the launchd plist"), value)
        return value

    rendered = fill(plistlib.loads(template.encode("utf-8")))
    return plistlib.dumps(rendered, sort_keys=False).decode("utf-8")


# --- systemd -----------------------------------------------------------------


def _systemd_specifiers(value: str) -> str:
    """Escape ``%`` so systemd does not expand it as a specifier."""
    return value.replace("%", "%%")


def _systemd_quoted_inner(value: str) -> str:
    """Escape *value* for use inside a double-quoted systemd word."""
    return _systemd_specifiers(value.replace("\\", "\\\\").replace('"', '\\"'))


def _systemd_exec_word(value: str) -> str:
    """Quote one ExecStart argument (specifiers and ``$`` escaped)."""
    if value == ";":
        raise ValueError("systemd cannot pass a lone ';' argument in ExecStart")
    if _SYSTEMD_BARE_WORD.fullmatch(value):
        return value
    return '"' + _systemd_quoted_inner(value).replace("$", "$$") + '"'


def _systemd_exec_words(values: Sequence[str]) -> str:
    return " ".join(_systemd_exec_word(v) for v in values)


def _render_systemd(
    template: str,
    argv: list[str],
    socket: str,
    config_args: list[str],
    log_dir: str | None,
) -> str:
    executable = argv[0]
    if not executable or executable[0] in _SYSTEMD_EXEC_PREFIXES:
        raise ValueError(
            f"systemd would read the start of the executable {executable!r} as an "
            f"ExecStart prefix ({_SYSTEMD_EXEC_PREFIXES}); use an absolute path"
        )
    if "$" in executable:
        raise ValueError(f"systemd cannot reliably run an executable path with '$': {executable!r}")

    out: list[str] = []
    for line in template.splitlines(keepends=True):
        stripped = line.lstrip()
        if stripped.startswith(("#", ";")) or not _PLACEHOLDER.search(line):
            out.append(line)
            continue
        key = stripped.split("=", 1)[0].strip()
        values: dict[str, str]
        if key == "ExecStart":
            values = {
                "COMMAND": _systemd_exec_words(argv),
                "SOCKET": _systemd_exec_word(socket),
                "CONFIG_ARGS": _systemd_exec_words(config_args),
            }
        elif key == "Environment":
            # The template quotes the whole assignment: Environment="VAR=@SOCKET@".
            values = {"SOCKET": _systemd_quoted_inner(socket)}
        elif key in ("StandardOutput", "StandardError"):
            if log_dir is None:
                continue  # keep systemd's default: the journal
            # append:PATH takes the rest of the line verbatim, specifiers aside.
            values = {"LOG_DIR": _systemd_specifiers(log_dir)}
        else:
            raise ValueError(f"systemd template: unexpected placeholder in {key}=")
        rendered = _PLACEHOLDER.sub(_lookup(values, f"the systemd unit's {key}="), line)
        if key == "ExecStart":  # an empty @CONFIG_ARGS@ leaves trailing spaces
            rendered = rendered.rstrip() + ("\n" if line.endswith("\n") else "")
        out.append(rendered)
    return "".join(out)


def _lookup(values: Mapping[str, str], where: str) -> Callable[[re.Match[str]], str]:
    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in values:
            raise ValueError(f"unexpected placeholder @{name}@ in {where}")
        return values[name]

    return substitute


# --- installation ------------------------------------------------------------


def service_install_path(kind: str) -> Path:
    """Return where the rendered service file for *kind* is installed.

    launchd: ``~/Library/LaunchAgents/com.github.mlx-supervisor.plist``;
    systemd: ``$XDG_CONFIG_HOME/systemd/user/mlx-supervisor.service``
    (``~/.config`` when XDG_CONFIG_HOME is unset or not absolute).
    """
    _check_kind(kind)
    if kind == "launchd":
        return Path.home() / "Library" / "LaunchAgents" / TEMPLATE_NAMES[kind]
    xdg = os.environ.get("XDG_CONFIG_HOME", "")
    config_home = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".config"
    return config_home / "systemd" / "user" / TEMPLATE_NAMES[kind]


def install_hint(kind: str) -> str:
    """Return the shell commands to run after writing the service file for *kind*."""
    _check_kind(kind)
    path = shlex.quote(str(service_install_path(kind)))
    if kind == "launchd":
        log_dir = shlex.quote(str(Path.home() / "Library" / "Logs" / "mlx-supervisor"))
        return (
            f"mkdir -p {log_dir}\n"
            f'launchctl bootout "gui/$(id -u)/{LAUNCHD_LABEL}" 2>/dev/null || true\n'
            f'launchctl bootstrap "gui/$(id -u)" {path}\n'
        )
    unit = SYSTEMD_UNIT_NAME.removesuffix(".service")
    return (
        f"systemctl --user daemon-reload && systemctl --user enable --now {unit}\n"
        f"# optional, to keep it running while you are logged out:\n"
        f'# loginctl enable-linger "$USER"\n'
    )

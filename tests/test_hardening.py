"""The daemon never dies of a client's or a runner's mistake, and bounds its load.

Each numbered failure of issue 6 has a test here that failed before its fix:
real daemons, real runners, real sockets.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from conftest import DaemonFactory, assert_reaped, faults, runner
from ipc import Codec
from ipc.messages import (
    FAULTS_ENV,
    PROTOCOL_VERSION,
    ErrorReply,
    GenerateRequest,
    GenerationDone,
    Hello,
    LoadRequest,
    Queued,
    SamplingParams,
    ServerMessage,
    StatusRequest,
)
from runner.builtin import ensure_builtin_model
from supervisor.client import Client, ClientError
from supervisor.daemon.process import DaemonProcess
from supervisor.fronts.mailbox import ClientGone

PROMPT = "The quick brown fox"
CODEC: Codec[ServerMessage] = Codec(ServerMessage)


def raw_connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(str(path))
    return sock


def hello_bytes() -> bytes:
    return CODEC.frame(Hello(PROTOCOL_VERSION, os.getpid(), "client"))


def read_frames(sock: socket.socket) -> list[ServerMessage | Hello]:
    """Everything the daemon sends until it closes the connection (a reset, when
    it closes with our bytes unread, comes after everything it sent)."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    frames: list[ServerMessage | Hello] = []
    while data:
        length = int.from_bytes(data[:4], "big")
        body, data = data[4 : 4 + length], data[4 + length :]
        frames.append(CODEC.decode_hello(body) if not frames else CODEC.decode(body))
    return frames


# --- 1. a bad runner environment in a request ------------------------------------------


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"X=Y": "1"}, "is not"),
        ({"GOOD": "a\x00b"}, "NUL"),
        ({"LD_PRELOAD": "/tmp/evil.so"}, "what code the runner runs"),
        ({"DYLD_INSERT_LIBRARIES": "x"}, "what code the runner runs"),
        ({"PYTHONPATH": "/tmp"}, "what code the runner runs"),
        ({"": "1"}, "is not"),
    ],
)
def test_bad_runner_env_is_refused_and_nothing_is_spawned(
    start_daemon: DaemonFactory, env: dict[str, str], reason: str
) -> None:
    daemon = start_daemon("hot_spare = false\n")
    client = Client(daemon.socket_path, timeout_s=60)
    client.load("builtin:tiny", "a")
    spawned = len(daemon.events("runner_spawned"))
    with client.generate("a", PROMPT, max_tokens=40) as gen:
        first = next(gen)
        with pytest.raises(ClientError) as excinfo:
            client.load("builtin:tiny", "c", env=env)
        list(gen)  # to its end
    assert excinfo.value.code == "bad_request" and reason in excinfo.value.message
    # The stream it refused the load in the middle of went on to its end (a
    # client that reads late may get all of it in one frame: ``rest`` may be "").
    assert first and gen.done is not None and gen.done.finish_reason == "length"
    assert gen.done.generation_tokens == 40 and gen.tokens <= 40
    assert len(daemon.events("runner_spawned")) == spawned
    assert [r.name for r in client.status().runners] == ["a"]
    assert daemon.process is not None and daemon.process.poll() is None


@pytest.mark.parametrize("name", ["x" * 65, "a/b", "tab\there", "bell\x07"])
def test_bad_model_names_are_refused(client: Client, name: str) -> None:
    with pytest.raises(ClientError) as excinfo:
        client.load("builtin:tiny", name)
    assert excinfo.value.code == "bad_request"
    assert client.status().runners == []


# --- 2. a realtime signal ----------------------------------------------------------------


def test_realtime_signal_to_a_runner_and_the_spare_is_named(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon("restart_backoff_s = 0.1\n")
    client = Client(daemon.socket_path, timeout_s=60)
    loaded = client.load("builtin:tiny")
    rt = signal.SIGRTMIN + 6
    os.kill(loaded.pid, rt)
    daemon.wait_until(lambda: runner(client, "tiny").restarts == 1
                      and runner(client, "tiny").state == "ready")  # fmt: skip
    last_exit = runner(client, "tiny").last_exit
    assert last_exit is not None and last_exit.signal == "SIGRTMIN+6"
    assert "SIGRTMIN+6" in last_exit.cause
    daemon.wait_until(lambda: (s := client.status().spare) is not None and s.pid is not None)
    spare = client.status().spare
    assert spare is not None and spare.pid is not None
    os.kill(spare.pid, rt)
    daemon.wait_until(lambda: any(e.get("signal") == "SIGRTMIN+6" and e.get("model") == "(spare)"
                                  for e in daemon.events("runner_exited")))  # fmt: skip
    text, _ = client.generate_text("tiny", PROMPT, max_tokens=4)
    assert text


def test_every_signal_number_has_a_name() -> None:
    from supervisor.runners.exits import describe_exit
    from supervisor.system import signal_name

    assert signal_name(9) == "SIGKILL"
    assert signal_name(signal.SIGRTMIN) == "SIGRTMIN"
    assert signal_name(signal.SIGRTMIN + 6) == "SIGRTMIN+6"
    assert signal_name(200) == "SIG200"
    exit_info = describe_exit(-200, None, [])
    assert exit_info.signal == "SIG200" and exit_info.cause == "killed by SIG200"


# --- 3. runner log records whose keys clash with ours ------------------------------------


def test_runner_log_keys_that_clash_with_ours_are_relayed(
    client: Client, daemon: DaemonProcess
) -> None:
    # The runner logs `load_started` with a key named `source`, as ours does.
    client.load("builtin:tiny")
    (record,) = daemon.events("load_started")
    assert record["source"] == "runner" and record["runner_source"] == "builtin:tiny"
    assert record["model"] == "tiny" and isinstance(record["runner_pid"], int)


# --- 4. terminal signals to the daemon's process group -------------------------------------


def test_sighup_to_the_daemons_process_group_does_not_reach_runners(
    start_daemon: DaemonFactory,
) -> None:
    daemon = start_daemon(new_session=True)
    client = Client(daemon.socket_path, timeout_s=60)
    loaded = client.load("builtin:tiny")
    os.killpg(daemon.pid, signal.SIGHUP)  # what closing the terminal of `serve &` does
    daemon.wait_until(lambda: bool(daemon.events("config_reload_refused")))  # no config file
    text, _ = client.generate_text("tiny", PROMPT, max_tokens=4)
    info = runner(client, "tiny")
    assert text and info.pid == loaded.pid and info.restarts == 0 and info.last_exit is None
    assert os.getpgid(loaded.pid) != os.getpgid(daemon.pid)


# --- 5. leaks, spare loops, lost cancels, slow clients ---------------------------------------


def test_failed_handshakes_and_loads_leak_no_fds_or_children(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon("hot_spare = false\n")
    client = Client(daemon.socket_path, timeout_s=120)
    proc = psutil.Process(daemon.pid)

    def quiet_fds() -> int:
        # A status whose connection we read to EOF: the daemon has closed its end.
        sock = raw_connect(daemon.socket_path)
        sock.sendall(hello_bytes() + CODEC.frame(StatusRequest()))
        read_frames(sock)
        sock.close()
        return proc.num_fds()

    fds_before, children_before = quiet_fds(), len(proc.children())
    for i in range(8):
        with pytest.raises(ClientError, match="handshake"):
            client.load("builtin:tiny", f"h{i}", env=faults("exit_in_handshake"))
    for i in range(6):
        with pytest.raises(ClientError) as excinfo:
            client.load("builtin:tiny", f"i{i}", env=faults("exit_at_import"))
        assert excinfo.value.code == "load_failed"
    for i in range(3):  # the runner reports the failure itself (these import mlx: slower)
        with pytest.raises(ClientError, match="no model directory"):
            client.load(f"/nonexistent/model-{i}", f"l{i}")
    assert client.status().runners == []
    assert len(proc.children()) == children_before
    assert quiet_fds() == fds_before


def test_spare_that_cannot_start_backs_off_and_shows_failed(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(
        "restart_backoff_s = 0.1\nrestart_backoff_cap_s = 0.8\n",
        env={FAULTS_ENV: "exit_at_import"},
    )
    client = Client(daemon.socket_path, timeout_s=30)

    def spare_failed() -> bool:
        spare = client.status().spare
        return spare is not None and spare.state == "failed"

    daemon.wait_until(spare_failed)
    spare = client.status().spare
    assert spare is not None and spare.failure is not None and "before it imported" in spare.failure
    daemon.wait_until(lambda: len(daemon.events("spare_failed")) >= 5)
    delays = [e["retry_in_s"] for e in daemon.events("spare_failed")][:5]
    assert delays == [0.1, 0.2, 0.4, 0.8, 0.8]


def test_a_cancel_right_behind_its_request_is_never_lost(client: Client) -> None:
    client.load("builtin:tiny")
    for _ in range(5):
        with client.generate("tiny", PROMPT, max_tokens=5000) as gen:
            gen.cancel()  # before reading anything: it races the request to the runner
            list(gen)
        assert gen.done is not None and gen.done.finish_reason == "cancelled"
        assert gen.done.generation_tokens < 200


def test_a_client_that_stops_reading_does_not_block_its_model(
    start_daemon: DaemonFactory,
) -> None:
    # A frame per token: the stuck client's socket fills however fast the
    # model is (4,096 frames of 25 ms text could all fit in its buffer).
    daemon = start_daemon("client_write_timeout_s = 1.0\nstream_interval_ms = 0\n")
    client = Client(daemon.socket_path, timeout_s=60)
    client.load("builtin:tiny")
    stuck = raw_connect(daemon.socket_path)
    request = GenerateRequest("tiny", PROMPT, sampling=SamplingParams(max_tokens=100_000))
    stuck.sendall(hello_bytes() + CODEC.frame(request))
    try:
        received = b""
        while len(received) < 200:  # the Hello and the first chunks: it streams...
            received += stuck.recv(4096)
        # ... and from now on the client reads nothing.
        started = time.monotonic()
        text, done = client.generate_text("tiny", PROMPT, max_tokens=4)
        assert text and done.finish_reason == "length"
        assert time.monotonic() - started < 30
        # Served beside the stuck one; that one is dropped once its write deadline passes.
        daemon.wait_until(lambda: bool(daemon.events("client_gone")), timeout_s=30)
        gone = daemon.events("client_gone")
        assert gone[0]["model"] == "tiny"
    finally:
        stuck.close()


# --- 6. a restore that fails -----------------------------------------------------------------


@pytest.mark.slow
def test_failed_restore_stays_failed_and_desired_until_a_load_retries_it(
    start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    model_dir = tmp_path / "mymodel"
    shutil.copytree(ensure_builtin_model("builtin:tiny"), model_dir)
    first = start_daemon()
    Client(first.socket_path).load(str(model_dir), "mine")
    first.process.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
    first.wait()
    hidden = tmp_path / "hidden"
    model_dir.rename(hidden)

    def start_on_same_socket() -> DaemonProcess:
        daemon = DaemonProcess(first.socket_path).start()
        client = Client(daemon.socket_path, timeout_s=60)
        daemon.wait_until(lambda: runner(client, "mine").state in ("failed", "ready"))
        return daemon

    second = start_on_same_socket()
    try:
        info = runner(Client(second.socket_path), "mine")
        assert info.state == "failed" and info.failure and "no model directory" in info.failure
    finally:
        assert second.terminate() == 0
    third = start_on_same_socket()  # still desired: tried again, failed again
    try:
        client = Client(third.socket_path, timeout_s=60)
        assert runner(client, "mine").state == "failed"
        hidden.rename(model_dir)
        loaded = client.load(str(model_dir), "mine")  # an explicit load retries it
        assert loaded.name == "mine" and runner(client, "mine").state == "ready"
    finally:
        assert third.terminate() == 0


# --- 8. relative model paths ------------------------------------------------------------------


def test_relative_model_path_is_the_callers(daemon: DaemonProcess, tmp_path: Path) -> None:
    shutil.copytree(ensure_builtin_model("builtin:tiny"), tmp_path / "here")
    assert Path.cwd() != tmp_path
    result = subprocess.run(
        [sys.executable, "-m", "supervisor", "load", "./here", "--name", "rel",
         "--socket", str(daemon.socket_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    info = runner(Client(daemon.socket_path), "rel")
    assert info.model == str(tmp_path / "here") and info.state == "ready"


# --- 9. a frozen runner -----------------------------------------------------------------------


def test_frozen_runner_is_killed_by_missed_pings_in_any_phase(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon("ping_timeout_s = 1.0\nprefill_stall_s = 120\nstall_kill_grace_s = 0.2\n")
    client = Client(daemon.socket_path, timeout_s=60)
    loaded = client.load("builtin:tiny")
    os.kill(loaded.pid, signal.SIGSTOP)  # frozen just before the request reaches it
    started = time.monotonic()
    text, done = client.generate_text("tiny", PROMPT, max_tokens=8)  # retried on the new runner
    elapsed = time.monotonic() - started
    assert text and done.generation_tokens == 8
    assert elapsed < 20  # the prefill timeout alone would take 120 s
    (stall,) = daemon.events("runner_stalled")
    assert "no answer to pings" in stall["reason"] and stall["runner_pid"] == loaded.pid
    assert_reaped(loaded.pid)
    assert runner(client, "tiny").restarts == 1


# --- bad input on the socket ------------------------------------------------------------------


def test_a_silent_client_and_a_byte_a_second_client_are_cut_off(
    start_daemon: DaemonFactory,
) -> None:
    daemon = start_daemon("client_idle_timeout_s = 1.0\n")
    silent = raw_connect(daemon.socket_path)
    started = time.monotonic()
    frames = read_frames(silent)  # the daemon's Hello, then it closes
    assert [type(f) for f in frames] == [Hello]
    assert 0.9 < time.monotonic() - started < 10
    silent.close()
    slow = raw_connect(daemon.socket_path)
    data = hello_bytes() + CODEC.frame(StatusRequest())
    started = time.monotonic()
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        for byte in data:  # a byte every 0.2 s: the whole request would take seconds
            slow.send(bytes([byte]))
            time.sleep(0.2)  # the client's own pace, not a wait for the daemon
    assert time.monotonic() - started < 10
    slow.close()
    assert Client(daemon.socket_path).status().runners == []


def test_an_error_quoting_huge_hostile_input_still_fits_a_frame(
    start_daemon: DaemonFactory,
) -> None:
    # Found by the fuzzer: msgspec quotes the bad value, and the reply outgrew the
    # frame limit; raising that from the error path took the daemon down.
    daemon = start_daemon("max_frame_bytes = 65536\n")
    import msgspec

    hostile = msgspec.msgpack.encode(
        {"type": "hello", "protocol_version": PROTOCOL_VERSION, "pid": 1, "role": "x" * 65000}
    )
    sock = raw_connect(daemon.socket_path)
    sock.sendall(len(hostile).to_bytes(4, "big") + hostile)
    frames = read_frames(sock)
    sock.close()
    reply = frames[-1]
    assert isinstance(reply, ErrorReply) and reply.code == "protocol"
    assert reply.message.endswith("(cut)") and len(reply.message) < 2000
    assert Client(daemon.socket_path).status().runners == []
    with pytest.raises(ClientError) as excinfo:
        Client(daemon.socket_path).load("/x" * 3000, "long")
    assert excinfo.value.code == "bad_request" and "<= 4096 - at `$.model`" in excinfo.value.message


def test_a_runner_that_sends_garbage_is_killed_and_restarted(
    start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon = start_daemon("restart_backoff_s = 0.1\n")
    client = Client(daemon.socket_path, timeout_s=60)
    loaded = client.load("builtin:tiny", env=faults(f"garbage_at_token=3,once={tmp_path / 'g'}"))
    with pytest.raises(ClientError) as excinfo, client.generate("tiny", PROMPT, max_tokens=20) as g:
        list(g)
    assert excinfo.value.code == "runner_died" and "SIGKILL" in excinfo.value.message
    assert daemon.events("runner_protocol_error")
    assert_reaped(loaded.pid)
    daemon.wait_until(lambda: runner(client, "tiny").state == "ready")
    assert client.generate_text("tiny", PROMPT, max_tokens=4)[0]


# --- load it holds ------------------------------------------------------------------------------


def test_queue_bound_refuses_busy_at_once_and_changes_nothing(
    start_daemon: DaemonFactory,
) -> None:
    daemon = start_daemon("max_queue = 2\nhot_spare = false\n")
    client = Client(daemon.socket_path, timeout_s=60)
    client.load("builtin:tiny", max_concurrent=1)  # one at a time: the others wait in line
    finished: dict[str, str] = {}

    def wait_in_line(name: str) -> None:
        _, done = client.generate_text("tiny", PROMPT, max_tokens=3)
        finished[name] = done.finish_reason

    with client.generate("tiny", PROMPT, max_tokens=100_000) as long:
        next(long)
        waiters = [threading.Thread(target=wait_in_line, args=(f"w{i}",)) for i in (1, 2)]
        for depth, thread in enumerate(waiters, start=1):
            thread.start()
            daemon.wait_until(lambda d=depth: runner(client, "tiny").queue_depth == d)
        started = time.monotonic()
        with pytest.raises(ClientError) as excinfo:
            client.generate_text("tiny", PROMPT, max_tokens=3)
        assert time.monotonic() - started < 5  # at once, not after a wait
        assert excinfo.value.code == "busy" and "max_queue" in excinfo.value.message
        assert runner(client, "tiny").queue_depth == 2  # the refusal changed nothing
        status_started = time.monotonic()
        assert client.status().runners[0].state == "busy"  # status answers meanwhile
        assert time.monotonic() - status_started < 5
        long.cancel()
        list(long)
    for thread in waiters:
        thread.join(60)
    assert finished == {"w1": "length", "w2": "length"}
    assert client.status().counters["requests_refused_busy"] == 1


def test_waiting_requests_are_told_their_position_as_they_move(
    start_daemon: DaemonFactory,
) -> None:
    daemon = start_daemon("hot_spare = false\n")
    client = Client(daemon.socket_path, timeout_s=60)
    client.load("builtin:tiny", max_concurrent=1)  # one at a time: the others wait in line
    with client.generate("tiny", PROMPT, max_tokens=100_000) as long:
        next(long)
        first = raw_connect(daemon.socket_path)
        first.sendall(hello_bytes() + CODEC.frame(GenerateRequest("tiny", PROMPT)))
        daemon.wait_until(lambda: runner(client, "tiny").queue_depth == 1)
        second = raw_connect(daemon.socket_path)
        request = GenerateRequest("tiny", PROMPT, sampling=SamplingParams(max_tokens=2))
        second.sendall(hello_bytes() + CODEC.frame(request))
        daemon.wait_until(lambda: runner(client, "tiny").queue_depth == 2)
        first.close()  # the first in line leaves: it is out of the queue at once
        daemon.wait_until(lambda: runner(client, "tiny").queue_depth == 1)
        assert runner(client, "tiny").state == "busy"  # the long one still runs
        long.cancel()
        list(long)
    frames = read_frames(second)
    second.close()
    assert [f.position for f in frames if isinstance(f, Queued)] == [2, 1]
    assert isinstance(frames[-1], GenerationDone) and frames[-1].generation_tokens == 2


def test_connections_past_max_connections_are_refused_busy(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon("max_connections = 3\n")
    held = [raw_connect(daemon.socket_path) for _ in range(3)]
    try:
        for sock in held:  # each is accepted and counted once the daemon's Hello comes
            assert sock.recv(4)
        extra = raw_connect(daemon.socket_path)
        extra.sendall(hello_bytes() + CODEC.frame(GenerateRequest("tiny", PROMPT)))
        frames = read_frames(extra)
        extra.close()
        assert isinstance(frames[-1], ErrorReply) and frames[-1].code == "busy"
        assert "max_connections" in frames[-1].message
        # ...but an operator can still look (and unload, and shut down).
        assert Client(daemon.socket_path).status().runners == []
    finally:
        for sock in held:
            sock.close()
    # Their slots come back once they are closed: a request is served again, not refused.
    client = Client(daemon.socket_path)

    def served() -> bool:
        with pytest.raises(ClientError) as excinfo:
            client.generate_text("tiny", PROMPT, max_tokens=1)
        assert excinfo.value.code in ("busy", "unknown_model"), excinfo.value
        return excinfo.value.code == "unknown_model"

    daemon.wait_until(served, 30)


def test_load_request_frames_from_a_raw_client_get_one_answer(daemon: DaemonProcess) -> None:
    sock = raw_connect(daemon.socket_path)
    sock.sendall(hello_bytes() + CODEC.frame(LoadRequest("builtin:tiny", "t", env={"A=B": "c"})))
    frames = read_frames(sock)
    sock.close()
    assert isinstance(frames[0], Hello)
    assert isinstance(frames[-1], ErrorReply) and frames[-1].code == "bad_request"


# --- load progress to a slow client (a component test: a real socket that is never read) --


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_load_progress_never_waits_on_a_client_that_does_not_read(tmp_path: Path) -> None:
    import anyio

    from ipc.aio import AsyncChannel
    from ipc.messages import ClientMessage, LoadProgress
    from supervisor.fronts.control import Connection
    from supervisor.fronts.mailbox import Mailbox

    async with await anyio.create_unix_listener(tmp_path / "p.sock") as listener:
        client = await anyio.connect_unix(tmp_path / "p.sock")  # it never reads
        accepted = await listener.accept()
        conn = Connection(AsyncChannel(accepted, Codec(ClientMessage)), write_timeout_s=0.5)
        progress: Mailbox[LoadProgress] = Mailbox()
        puts = 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(progress.forward, conn.send)
            # The model's supervision: far more progress than any socket buffer holds,
            # each handed over without waiting, while the writer blocks and gives up.
            while not conn.gone:
                progress.put(LoadProgress("m", "weights", puts, 0, 0))
                puts += 1
                await anyio.sleep(0)
            progress.close()
        assert conn.gone and puts > 1000
        with pytest.raises(ClientGone):
            await conn.send(LoadProgress("m", "weights", 0, 0, 0))
        await client.aclose()
        await accepted.aclose()


# --- found in review: the daemon's own surroundings ----------------------------------------


def test_the_daemon_outlives_the_reader_of_its_stderr(tmp_path: Path) -> None:
    # The terminal of `serve &` closed, or a log pipe whose reader died: writes fail.
    socket_path = tmp_path / "s.sock"
    process = subprocess.Popen(
        [sys.executable, "-m", "supervisor", "serve", "--socket", str(socket_path)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stderr is not None
        for line in process.stderr:  # its own word that it serves
            if b'"daemon_started"' in line:
                break
        process.stderr.close()  # nobody reads its log any more
        client = Client(socket_path, timeout_s=60)
        client.load("builtin:tiny")  # logs a lot: every write now fails
        assert client.generate_text("tiny", PROMPT, max_tokens=4)[0]
        assert process.poll() is None
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_running_out_of_fds_pauses_accepting_and_never_ends_the_daemon(
    start_daemon: DaemonFactory,
) -> None:
    import resource

    daemon = start_daemon("client_idle_timeout_s = 1.0\nhot_spare = false\n")
    resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (48, 48))
    idle = [raw_connect(daemon.socket_path) for _ in range(80)]  # far past 48 fds
    try:
        daemon.wait_until(lambda: bool(daemon.events("accept_failed")))
    finally:
        for sock in idle:
            sock.close()
    assert Client(daemon.socket_path, timeout_s=30).status().runners == []
    assert daemon.process is not None and daemon.process.poll() is None


def test_a_paused_daemon_does_not_kill_its_healthy_runners_when_it_resumes(
    start_daemon: DaemonFactory,
) -> None:
    daemon = start_daemon("ping_timeout_s = 1.0\n")
    client = Client(daemon.socket_path, timeout_s=60)
    loaded = client.load("builtin:tiny")
    os.kill(daemon.pid, signal.SIGSTOP)  # Ctrl-Z, a debugger, a frozen container
    time.sleep(2.5)  # how long it stays paused: the test's input, not a wait
    os.kill(daemon.pid, signal.SIGCONT)
    assert client.generate_text("tiny", PROMPT, max_tokens=20)[0]
    info = runner(client, "tiny")
    assert info.pid == loaded.pid and info.restarts == 0
    assert not daemon.events("runner_stalled")


def test_a_load_request_out_of_the_config_ranges_is_refused(client: Client) -> None:
    # Accepted, it made the whole state file unreadable for the next daemon.
    for max_tokens in (2_000_000, -1):
        with pytest.raises(ClientError) as excinfo:
            client.load("builtin:tiny", max_tokens=max_tokens)
        assert excinfo.value.code == "bad_request" and "max_tokens" in excinfo.value.message
    assert client.status().runners == []


def test_restart_backoff_never_overflows() -> None:
    from ipc.messages import ExitInfo
    from supervisor.registry.restart import RestartIntensity, RestartTracker

    tracker = RestartTracker("always", RestartIntensity(max_restarts=5000, backoff_cap_s=30))
    crash = ExitInfo(None, "SIGKILL", "killed by SIGKILL")
    delays = [tracker.decide(crash, now=float(i)).delay_s for i in range(1100)]
    assert delays[0] == 0.0 and delays[-1] == 30.0

"""Crash recovery for real: restarts, restart intensity, retries, the stall
watchdog, the state file, restore on start and the hot spare."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from conftest import DaemonFactory, assert_reaped, faults, runner
from supervisor.client import Client, ClientError
from supervisor.daemon.process import DaemonProcess
from supervisor.daemon.state import DaemonState, RunnerRecord, StateFile, state_path

PROMPT = "Once upon a time"
FAST = "restart_backoff_s = 0.1\nrestart_backoff_cap_s = 0.4\n"


def wait_for_state(client: Client, name: str, states: set[str], daemon: DaemonProcess) -> None:
    """Wait (re-checking whenever the daemon logs) until the model is in ``states``."""
    daemon.wait_until(lambda: runner(client, name).state in states)


def kill_into_backoff(client: Client, daemon: DaemonProcess, name: str) -> None:
    """Kill the runner twice: the first restart is immediate, the second waits
    ``restart_backoff_s``; return once the model waits in ``restarting``."""
    os.kill(runner(client, name).pid, signal.SIGKILL)  # type: ignore[arg-type]
    daemon.wait_until(lambda: runner(client, name).restarts == 1)
    daemon.wait_until(lambda: runner(client, name).state == "ready")
    os.kill(runner(client, name).pid, signal.SIGKILL)  # type: ignore[arg-type]
    wait_for_state(client, name, {"restarting"}, daemon)


# --- restarts -----------------------------------------------------------------


def test_killed_runner_is_restarted_and_serves_again(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(FAST)
    client = Client(daemon.socket_path)
    first = client.load("builtin:tiny")
    os.kill(first.pid, signal.SIGKILL)
    # A request sent now waits for the restart instead of failing.
    _, done = client.generate_text("tiny", PROMPT, max_tokens=5)
    assert done.generation_tokens == 5
    info = runner(client, "tiny")
    assert info.state == "ready" and info.restarts == 1
    assert info.pid is not None and info.pid != first.pid
    assert info.last_exit is not None and info.last_exit.signal == "SIGKILL"
    assert_reaped(first.pid)
    assert client.status().counters["restarts"] == 1


@pytest.mark.parametrize("signame", ["SIGSEGV", "SIGABRT"])
def test_runner_crashing_mid_generation_names_the_signal(
    start_daemon: DaemonFactory, signame: str
) -> None:
    daemon = start_daemon(FAST)
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", env=faults(f"crash_at_token=3:{signame}"))
    with (
        client.generate("tiny", PROMPT, max_tokens=50) as gen,
        pytest.raises(ClientError) as excinfo,
    ):
        list(gen)
    assert excinfo.value.code == "runner_died"
    assert signame in excinfo.value.message
    info = runner(client, "tiny")
    assert info.last_exit is not None and info.last_exit.signal == signame
    assert info.last_exit.stderr_tail, "the last stderr lines are kept"


def test_a_refused_load_leaves_a_crashed_model_as_it_was(
    start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    """A load that its spec's check refuses (here a hostfile that cannot be read) changes
    nothing: the crashed model it would have replaced keeps its state and its last exit."""
    daemon = start_daemon(FAST)
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", restart="never", env=faults("crash_at_token=1:SIGKILL"))
    with pytest.raises(ClientError):
        client.generate_text("tiny", PROMPT, max_tokens=5)
    daemon.wait_until(lambda: runner(client, "tiny").state == "crashed")
    with pytest.raises(ClientError) as excinfo:
        client.load("builtin:tiny", "tiny", ranks=2, hostfile=str(tmp_path / "missing.json"))
    assert excinfo.value.code == "bad_request" and "hostfile" in excinfo.value.message
    info = runner(client, "tiny")
    assert info.state == "crashed"
    assert info.last_exit is not None and info.last_exit.signal == "SIGKILL"


def test_restart_budget_spent_leaves_model_failed_until_explicit_load(
    start_daemon: DaemonFactory,
) -> None:
    daemon = start_daemon(FAST + "max_restarts = 2\n")
    client = Client(daemon.socket_path)
    # Every generation crashes the runner at its first token.
    client.load("builtin:tiny", env=faults("crash_at_token=1:SIGKILL"))
    for _ in range(3):
        with pytest.raises(ClientError) as excinfo:
            client.generate_text("tiny", PROMPT, max_tokens=5)
        assert excinfo.value.code == "runner_died"
    info = runner(client, "tiny")
    assert info.state == "failed"
    assert info.restarts == 2
    assert info.failure is not None and "2 restarts within 60s" in info.failure
    assert info.pid is None
    with pytest.raises(ClientError) as excinfo:
        client.generate_text("tiny", PROMPT, max_tokens=5)
    assert "failed" in excinfo.value.message
    # An explicit load brings it back.
    client.load("builtin:tiny")
    _, done = client.generate_text("tiny", PROMPT, max_tokens=5)
    assert done.generation_tokens == 5


def test_restart_never_leaves_model_crashed(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(FAST + 'restart = "never"\n')
    client = Client(daemon.socket_path)
    loaded = client.load("builtin:tiny")
    os.kill(loaded.pid, signal.SIGTERM)
    with pytest.raises(ClientError) as excinfo:
        client.generate_text("tiny", PROMPT, max_tokens=5)
    assert excinfo.value.code == "runner_died"
    info = runner(client, "tiny")
    assert info.state == "crashed" and info.restarts == 0
    assert info.last_exit is not None and info.last_exit.cause == "SIGTERM"


def test_unload_calls_off_a_pending_restart(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon("restart_backoff_s = 30\n")
    client = Client(daemon.socket_path)
    client.load("builtin:tiny")
    kill_into_backoff(client, daemon, "tiny")
    info = runner(client, "tiny")
    assert info.next_restart_at is not None and info.next_restart_at > time.time() + 20
    started = time.monotonic()
    unloaded = client.unload("tiny")
    assert time.monotonic() - started < 5
    assert unloaded.steps == []
    assert client.status().runners == []


# --- in-flight and queued requests ------------------------------------------------


def test_unstarted_request_is_retried_on_the_restarted_runner(
    start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon = start_daemon(FAST)
    client = Client(daemon.socket_path)
    # The first runner dies as its first token is made, before it is sent; the
    # restarted runner finds the once-file and runs clean.
    once = tmp_path / "crashed-once"
    client.load("builtin:tiny", env=faults(f"crash_at_token=1:SIGKILL,once={once}"))
    _, done = client.generate_text("tiny", PROMPT, max_tokens=5)
    assert done.generation_tokens == 5
    counters = client.status().counters
    assert counters["requests_retried"] == 1 and counters["restarts"] == 1


def test_retry_happens_once_then_the_cause_is_reported(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(FAST)
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", env=faults("crash_at_token=1:SIGKILL"))
    started = time.monotonic()
    with pytest.raises(ClientError) as excinfo:
        client.generate_text("tiny", PROMPT, max_tokens=5)
    assert excinfo.value.code == "runner_died"
    assert "SIGKILL" in excinfo.value.message
    assert time.monotonic() - started < 30
    assert client.status().counters["requests_retried"] == 1


def test_request_that_streamed_is_not_replayed(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(FAST + "stream_interval_ms = 0\n")  # a frame per token: 3 before
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", env=faults("crash_at_token=4:SIGKILL"))
    with client.generate("tiny", PROMPT, max_tokens=50) as gen:
        pieces = []
        with pytest.raises(ClientError) as excinfo:
            for piece in gen:
                pieces.append(piece)
    # 3 tokens came (in 3 frames, or fewer when the daemon joined those that
    # piled up while this client was slow), and then the error, not a replay.
    assert gen.tokens == 3 and 1 <= len(pieces) <= 3
    assert "SIGKILL" in excinfo.value.message
    assert client.status().counters.get("requests_retried", 0) == 0


def test_queued_requests_wait_for_the_restart(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(FAST)
    client = Client(daemon.socket_path)
    loaded = client.load("builtin:tiny", max_concurrent=1)  # the second one waits in line
    results: list[object] = []
    with client.generate("tiny", PROMPT, max_tokens=100_000) as gen:
        next(gen)

        def queued() -> None:
            try:
                results.append(client.generate_text("tiny", PROMPT, max_tokens=6)[1])
            except ClientError as exc:
                results.append(exc)

        waiter = threading.Thread(target=queued)
        waiter.start()
        daemon.wait_until(lambda: runner(client, "tiny").queue_depth == 1)
        os.kill(loaded.pid, signal.SIGKILL)
        with pytest.raises(ClientError):
            list(gen)
    waiter.join(60)
    (result,) = results
    assert not isinstance(result, ClientError), result
    assert result.generation_tokens == 6  # type: ignore[attr-defined]


def test_queue_timeout_bounds_the_wait(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon("queue_timeout_s = 0.5\nrestart_backoff_s = 30\n")
    client = Client(daemon.socket_path)
    client.load("builtin:tiny")
    kill_into_backoff(client, daemon, "tiny")
    started = time.monotonic()
    with pytest.raises(ClientError) as excinfo:
        client.generate_text("tiny", PROMPT, max_tokens=5)
    assert excinfo.value.code == "not_ready"
    assert "timed out after 0.5s" in excinfo.value.message
    assert time.monotonic() - started < 5


# --- the stall watchdog -------------------------------------------------------------

NEVER = "restart = 'never'\n"
STALLS = FAST + "decode_stall_s = 1.0\nprefill_stall_s = 1.0\nstall_kill_grace_s = 0.3\n"


@pytest.mark.parametrize("how", ["", "c"], ids=["busy-loop", "blocked-in-c"])
def test_hung_decode_is_killed_from_outside_and_restarted(
    start_daemon: DaemonFactory, how: str
) -> None:
    daemon = start_daemon(STALLS)
    client = Client(daemon.socket_path)
    loaded = client.load("builtin:tiny", env=faults(f"hang_at_token=3:{how}".rstrip(":")))
    started = time.monotonic()
    with (
        client.generate("tiny", PROMPT, max_tokens=50) as gen,
        pytest.raises(ClientError) as excinfo,
    ):
        list(gen)
    elapsed = time.monotonic() - started
    assert "stalled in decode" in excinfo.value.message
    assert 1.0 <= elapsed < 1.0 + 0.3 + 3.0
    (stall,) = daemon.events("runner_stalled")
    assert stall["phase"] == "decode" and stall["runner_pid"] == loaded.pid
    # A busy loop dies of SIGTERM; a C call with SIGTERM masked needs SIGKILL.
    assert bool(daemon.events("escalate_sigkill")) == (how == "c")
    info = runner(client, "tiny")
    assert info.last_exit is not None and "stalled in decode" in info.last_exit.cause
    wait_for_state(client, "tiny", {"ready"}, daemon)


# A prompt of about 600 tokens on builtin:tiny (its byte-level BPE takes a few
# characters a token).
LONG_PROMPT = " ".join(f"line {i}: the supervisor keeps its runners alive." for i in range(60))


@pytest.mark.slow
@pytest.mark.parametrize(
    "limits",
    [
        # The prompt in one chunk of mlx-lm's 2,048 tokens would take about 5 s
        # without a word to the supervisor, past the 2 s limit: chunks sized
        # from the measured rate report every prefill_chunk_s (1 s) instead.
        "prefill_stall_s = 2.0\n",
        # Chunks of about 2.5 s against a 1 s limit: each is announced in a
        # heartbeat before it starts, and the limit stretches to 3 times that.
        "prefill_stall_s = 1.0\nprefill_chunk_s = 2.5\n",
    ],
    ids=["chunked", "announced"],
)
def test_a_slow_prefill_is_never_taken_for_a_hang(start_daemon: DaemonFactory, limits: str) -> None:
    daemon = start_daemon(FAST + NEVER + limits + "stall_kill_grace_s = 0.3\n")
    client = Client(daemon.socket_path)
    loaded = client.load("builtin:tiny", env=faults("slow_prefill=0.008"))  # 8 ms a prompt token
    _, done = client.generate_text("tiny", LONG_PROMPT, max_tokens=4)
    assert done.prompt_tokens > 500 and done.generation_tokens == 4
    assert not daemon.events("runner_stalled")
    assert runner(client, "tiny").pid == loaded.pid


def test_a_prefill_that_hangs_between_chunks_is_still_killed(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(FAST + NEVER + "prefill_stall_s = 1.0\nstall_kill_grace_s = 0.3\n")
    client = Client(daemon.socket_path)
    loaded = client.load("builtin:tiny", env=faults("slow_prefill=0.002,hang_in_prefill=3:c"))
    with pytest.raises(ClientError) as excinfo:
        client.generate_text("tiny", LONG_PROMPT, max_tokens=4)
    assert "stalled in prefill" in excinfo.value.message
    (stall,) = daemon.events("runner_stalled")
    assert stall["phase"] == "prefill" and stall["runner_pid"] == loaded.pid
    assert daemon.events("escalate_sigkill")  # SIGTERM is masked in the hang
    assert_reaped(loaded.pid)


def test_idle_runner_that_stops_answering_pings_is_killed(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(
        FAST + "ping_timeout_s = 0.8\nstall_kill_grace_s = 0.3\nrestart = 'never'\n"
    )
    client = Client(daemon.socket_path)
    # Deadlocked holding the GIL: even the pipe-reader thread cannot answer.
    loaded = client.load("builtin:tiny", env=faults("hang_when_idle=gil"))
    wait_for_state(client, "tiny", {"crashed"}, daemon)
    (stall,) = daemon.events("runner_stalled")
    assert stall["phase"] == "idle" and "no answer to pings" in stall["reason"]
    assert daemon.events("escalate_sigkill")  # SIGTERM is masked: only SIGKILL ends it
    assert_reaped(loaded.pid)


def test_hung_load_is_killed_and_the_load_fails(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon("load_stall_s = 1.0\nstall_kill_grace_s = 0.3\n")
    client = Client(daemon.socket_path)
    with pytest.raises(ClientError) as excinfo:
        client.load("builtin:tiny", env=faults("hang_at_load=c"))
    assert excinfo.value.code == "load_failed"
    assert "stalled in loading" in excinfo.value.message


# --- orphans, state file, restore ------------------------------------------------------


def test_leftover_runner_of_a_dead_predecessor_is_killed_but_a_reused_pid_is_not(
    tmp_path: Path, start_daemon: DaemonFactory
) -> None:
    socket_path = tmp_path / "d0.sock"
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    leftover = subprocess.Popen(sleeper)
    stranger = subprocess.Popen(sleeper)
    try:
        created = psutil.Process(leftover.pid).create_time()
        StateFile(state_path(socket_path)).save(
            DaemonState(
                daemon_pid=1,
                socket=str(socket_path),
                runners=[
                    RunnerRecord("old", leftover.pid, created),
                    # Same pid as a live process, different start time: a reused pid.
                    RunnerRecord("reused", stranger.pid, created - 1000),
                ],
            )
        )
        daemon = start_daemon()
        assert leftover.wait(10) == -signal.SIGKILL
        assert stranger.poll() is None
        (record,) = daemon.events("predecessor_runners_killed")
        assert record["pids"] == [leftover.pid]
    finally:
        for proc in (leftover, stranger):
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_models_come_back_after_the_daemon_is_killed(
    tmp_path: Path, start_daemon: DaemonFactory
) -> None:
    first = start_daemon()
    client = Client(first.socket_path)
    client.load("builtin:tiny", "a")
    client.load("builtin:tiny", "b", max_tokens=7)
    saved = json.loads(state_path(first.socket_path).read_text())
    assert sorted(m["name"] for m in saved["models"]) == ["a", "b"]
    assert len(saved["runners"]) >= 2
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    # A new daemon on the same socket (as launchd or systemd would start it).
    second = DaemonProcess(first.socket_path).start()
    try:
        client = Client(second.socket_path)
        assert sorted(r.name for r in client.status().runners) == ["a", "b"]
        _, done = client.generate_text("b", PROMPT, max_tokens=50)  # waits for the load
        assert done.generation_tokens == 7  # the settings came back too
        client.unload("a")
        saved = json.loads(state_path(first.socket_path).read_text())
        assert [m["name"] for m in saved["models"]] == ["b"]
    finally:
        assert second.terminate() == 0


def test_restore_on_start_can_be_turned_off(start_daemon: DaemonFactory, tmp_path: Path) -> None:
    first = start_daemon()
    Client(first.socket_path).load("builtin:tiny")
    assert first.terminate() == 0  # a clean stop keeps the desired models too
    config = tmp_path / "norestore.toml"
    config.write_text("restore_on_start = false\n")
    second = DaemonProcess(first.socket_path, config).start()
    try:
        assert Client(second.socket_path).status().runners == []
    finally:
        assert second.terminate() == 0


# --- the hot spare ----------------------------------------------------------------------


def test_load_takes_the_warm_spare_and_a_new_spare_follows(daemon: DaemonProcess) -> None:
    client = Client(daemon.socket_path)
    wait_for_spare(client, daemon)
    spare_pid = client.status().spare.pid  # type: ignore[union-attr]
    loaded = client.load("builtin:tiny")
    assert loaded.pid == spare_pid
    wait_for_spare(client, daemon)
    new_spare = client.status().spare
    assert new_spare is not None and new_spare.pid != spare_pid
    # A model with its own environment gets a fresh process instead.
    other = client.load("builtin:tiny", "other", env={"SOME_SETTING": "1"})
    assert other.pid != new_spare.pid
    assert client.status().spare.pid == new_spare.pid  # type: ignore[union-attr]


def test_hot_spare_can_be_turned_off(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon("hot_spare = false\n")
    client = Client(daemon.socket_path)
    client.load("builtin:tiny")
    assert client.status().spare is None
    assert len(psutil.Process(daemon.pid).children()) == 1


def wait_for_spare(client: Client, daemon: DaemonProcess) -> None:
    def warm() -> bool:
        spare = client.status().spare
        return spare is not None and spare.warm

    daemon.wait_until(warm)

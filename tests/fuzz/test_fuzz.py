"""Fuzzing, short version: a few hundred hostile cases against a live daemon
and real runners, with a fixed seed (the long run: ``bash run.sh fuzz N``).

FUZZ_DAEMON_CASES and FUZZ_RUNNER_CASES change the counts, FUZZ_SEED the seed.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
from fuzz_run import (
    CASE_BOUND_S,
    DAEMON_CONFIG,
    Case,
    FuzzResult,
    draw_cases,
    frame,
    fuzz_daemon,
    fuzz_runner,
    hello,
    read_answer,
    report,
)

from conftest import DaemonFactory
from ipc import Codec
from ipc.messages import ErrorReply, ServerMessage
from runner.main import EXIT_PROTOCOL
from supervisor.client import Client

SEED = int(os.environ.get("FUZZ_SEED", "6"))
DAEMON_CASES = int(os.environ.get("FUZZ_DAEMON_CASES", "100"))
RUNNER_CASES = int(os.environ.get("FUZZ_RUNNER_CASES", "20"))


def test_cases_are_the_same_for_the_same_seed() -> None:
    first = draw_cases("daemon", 40, SEED)
    assert draw_cases("daemon", 40, SEED) == first
    assert draw_cases("daemon", 40, SEED + 1) != first


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hostile_frames_and_random_bytes_never_crash_hang_or_leak_the_daemon(
    start_daemon: DaemonFactory,
) -> None:
    result = FuzzResult(SEED)
    fuzz_daemon(lambda: start_daemon(DAEMON_CONFIG), DAEMON_CASES, SEED, result)
    print(report(result))
    assert len(result.findings) == 0, "findings (the report is above)"
    assert result.batches >= 4
    kinds = {"raw", "hello", "framing", "frame", "request", "midstream"}
    assert {f"daemon:{kind}" for kind in kinds} <= set(result.cases)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hostile_frames_end_a_runner_with_its_protocol_code_or_leave_it_serving(
    tmp_path: Path,
) -> None:
    result = FuzzResult(SEED)
    fuzz_runner(RUNNER_CASES, SEED, result, tmp_path)
    print(report(result))
    assert len(result.findings) == 0, "findings (the report is above)"
    assert result.runner_outcomes[f"exit {EXIT_PROTOCOL}"] > 0
    served = sum(n for outcome, n in result.runner_outcomes.items() if outcome.startswith("Gen"))
    assert served > 0


# Found by the fuzzer: error replies quote the offending value (repr() of a
# model name, msgspec's message about a bad Hello field), up to 6 times longer
# than the request: 13697 U+2028 characters are 41 KB asked and an 82 KB reply,
# over the 64 KiB limit (with the default 16 MiB limit, 3 million of them do
# the same). The reply could not be framed, and the daemon died of it.
HUGE = "\u2028" * 13697


@pytest.mark.parametrize(
    "sent",
    [
        pytest.param(
            hello() + frame({"type": "generate", "name": HUGE, "prompt": "hi"}), id="model-name"
        ),
        pytest.param(
            frame({"type": "hello", "protocol_version": 1, "pid": 1, "role": HUGE})
            + frame({"type": "status"}),
            id="hello-role",
        ),
    ],
)
def test_an_error_about_a_huge_value_is_answered_and_the_daemon_keeps_serving(
    start_daemon: DaemonFactory, sent: bytes
) -> None:
    daemon = start_daemon(DAEMON_CONFIG)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(daemon.socket_path))
        sock.sendall(sent)
        bodies, how = read_answer(sock, Case("request", []), time.monotonic() + CASE_BOUND_S)
    assert how == "closed"
    assert len(bodies) == 2, "no reply after the Hello"
    codec: Codec[ServerMessage] = Codec(ServerMessage)
    reply = codec.decode(bodies[1])
    assert isinstance(reply, ErrorReply)
    assert reply.code in ("unknown_model", "bad_request", "protocol")
    assert Client(daemon.socket_path, timeout_s=10).status().supervisor.pid == daemon.pid

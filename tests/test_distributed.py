"""A model sharded over two rank processes with mx.distributed (ring over
loopback), supervised as one unit: load, output, status, and every way a
rank can die."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import psutil
import pytest

from conftest import DaemonFactory, assert_reaped, faults, runner, wait_exited
from supervisor.client import Client, ClientError
from supervisor.config import ConfigError, ModelConfig, load_config
from supervisor.memory.estimate import ALLOCATOR_SHARE_OF_WEIGHTS, Estimate
from supervisor.memory.ranks import group_estimate, room_problem
from supervisor.runners.placement import Place, free_ports, group_places

PROMPT = "Once upon a time"
# No hot spare: a group does not use it, and every runner importing mlx costs CPU.
FAST = "hot_spare = false\nrestart_backoff_s = 0.1\nrestart_backoff_cap_s = 0.4\n"
LONG = 100_000  # tokens: a stream that is still going when a rank is killed


def rank_pids(client: Client, name: str) -> list[int]:
    pids = [rank.pid for rank in runner(client, name).ranks]
    assert all(pid is not None for pid in pids)
    return [pid for pid in pids if pid is not None]


def serving_again(client: Client, name: str, old: list[int]) -> bool:
    info = runner(client, name)
    pids = [rank.pid for rank in info.ranks]
    return info.state == "ready" and None not in pids and not set(pids) & set(old)


def signal_mid_stream(client: Client, name: str, pid: int, signum: signal.Signals) -> ClientError:
    """Send ``signum`` to ``pid`` once ``name`` streams text; the error the stream ends with."""
    with (
        client.generate(name, PROMPT, max_tokens=LONG) as gen,
        pytest.raises(ClientError) as excinfo,
    ):
        sent = False
        for piece in gen:
            if piece and not sent:  # once: by the next piece it may be reaped
                os.kill(pid, signum)
                sent = True
    return excinfo.value


def ring_dirs(tmp: Path) -> list[str]:
    """The ring host files' directories (the daemon writes them) under ``tmp``."""
    return sorted(p.name for p in tmp.glob("mlx-supervisor-ring-*"))


FAKE_SSH = """#!/bin/sh
# ssh [options] HOST COMMAND, for the tests: COMMAND runs here, as on HOST.
while [ "$#" -gt 2 ]; do shift; done
exec /bin/sh -c "$2"
"""


@pytest.mark.slow
def test_requests_back_to_back_on_a_group_all_end_as_they_should(
    start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    # Each request starts while the last one's token computed ahead may still
    # be in flight on every rank: the ranks' agreement at the prefill's start
    # must not overlap that forward's own collectives (it did now and then,
    # and the ring summed flags with activations: a bogus "memory pressure on
    # another rank", or a chunk of 0 tokens).
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    client = Client(start_daemon(FAST, env={"TMPDIR": str(tmp)}).socket_path)
    client.load("builtin:tiny", "pair", ranks=2)
    for index in range(40):
        _, done = client.generate_text("pair", (PROMPT, "The capital of France is")[index % 2],
                                       max_tokens=8)  # fmt: skip
        assert (done.finish_reason, done.detail, done.generation_tokens) == ("length", None, 8)


def remote_pair(tmp_path: Path, ssh_script: str) -> tuple[Path, str]:
    """A hostfile of two ranks, the second on "node-b.test" reached through
    ``ssh_script`` (a stand-in ssh), and the daemon config that goes with it."""
    ssh = tmp_path / "fake-ssh"
    ssh.write_text(ssh_script)
    ssh.chmod(0o755)
    hostfile = tmp_path / "hosts.json"
    hosts = [
        {"ssh": "localhost", "ips": ["127.0.0.1"]},
        {"ssh": "node-b.test", "ips": ["127.0.0.1"]},
    ]
    hostfile.write_text(json.dumps({"hosts": hosts}))
    base = free_ports(1)[0] - 1  # rank 1 listens on base + 1 "there"
    return hostfile, f"ssh_command = [{str(ssh)!r}]\ndistributed_port_base = {base}\n"


@pytest.mark.slow
@pytest.mark.parametrize("model", ["builtin:tiny", "builtin:tiny-qwen3"])
def test_two_ranks_answer_as_one_process_does(
    start_daemon: DaemonFactory, tmp_path: Path, model: str
) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    client = Client(start_daemon(FAST, env={"TMPDIR": str(tmp)}).socket_path)
    client.load(model, "single")
    loaded = client.load(model, "pair", ranks=2)
    info = runner(client, "pair")
    assert info.state == "ready" and len(info.ranks) == 2
    assert [r.rank for r in info.ranks] == [0, 1]
    assert all(r.state == "ready" and r.host == "127.0.0.1" for r in info.ranks)
    pids = rank_pids(client, "pair")
    assert len(set(pids)) == 2 and info.pid == pids[0] == loaded.pid
    assert all(psutil.pid_exists(pid) for pid in pids)
    assert all(r.mlx_active_bytes for r in info.ranks), "each rank holds its shard"
    assert info.batching is False and info.batching_reason is not None
    assert "distributed" in info.batching_reason
    for prompt in (PROMPT, "The capital of France is"):
        single, single_done = client.generate_text("single", prompt, max_tokens=24)
        pair, pair_done = client.generate_text("pair", prompt, max_tokens=24)
        assert pair == single  # greedy, fp32: the same tokens
        assert pair_done.generation_tokens == single_done.generation_tokens == 24
    # A chat turn, and a stop string (the ranks stop at the same token).
    chat = [{"role": "user", "content": "Say something."}]
    single, _ = client.generate_text("single", None, messages=chat, max_tokens=12)
    pair, _ = client.generate_text("pair", None, messages=chat, max_tokens=12)
    assert pair == single
    stop = single[len(single) // 2 : len(single) // 2 + 2]
    pair, done = client.generate_text("pair", None, messages=chat, max_tokens=12, stop=[stop])
    assert done.finish_reason == "stop" and pair == single[: single.index(stop)]
    # Cancels reach the ranks at different moments, here as a request starts:
    # every rank still stops at the same point, and the next answer is right.
    for _ in range(3):
        with client.generate("pair", PROMPT, max_tokens=LONG) as gen:
            gen.cancel()
            list(gen)
        assert gen.done is not None and gen.done.finish_reason == "cancelled"
    pair, _ = client.generate_text("pair", PROMPT, max_tokens=24)
    single, _ = client.generate_text("single", PROMPT, max_tokens=24)
    assert pair == single and runner(client, "pair").restarts == 0
    # Unload: every rank reaped, and the ring's host file gone with the group.
    assert len(ring_dirs(tmp)) == 1
    client.unload("pair")
    for pid in pids:
        assert_reaped(pid)
    assert ring_dirs(tmp) == []


@pytest.mark.slow
def test_a_rank_killed_mid_stream_takes_the_group_down_and_it_comes_back(
    start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    # TMPDIR: the daemon is SIGKILLed at the end, with no chance to remove the
    # ring's host file; it goes with the test's own temporary directory.
    daemon = start_daemon(FAST, env={"TMPDIR": str(tmp_path)})
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", "pair", ranks=2)
    old = rank_pids(client, "pair")
    error = signal_mid_stream(client, "pair", old[1], signal.SIGKILL)
    assert error.code == "runner_died"
    assert "rank 1" in error.message and "SIGKILL" in error.message
    assert wait_exited(old, timeout_s=10) == []
    daemon.wait_until(lambda: serving_again(client, "pair", old))
    info = runner(client, "pair")
    assert info.restarts == 1
    exit_info = info.last_exit
    assert exit_info is not None and exit_info.rank == 1 and exit_info.signal == "SIGKILL"
    assert [r.rank for r in exit_info.ranks] == [0, 1]
    survivor = exit_info.ranks[0]
    # Rank 0 was inside a collective: it saw its peer go.
    assert survivor.cause_class == "peer_lost", survivor
    for pid in old:
        assert_reaped(pid)
    text, done = client.generate_text("pair", PROMPT, max_tokens=8)
    assert done.generation_tokens == 8 and text
    # The daemon killed: every rank goes (pipe EOF, parent-death signal)
    # without anyone reaping them first.
    pids = rank_pids(client, "pair")
    assert len(ring_dirs(tmp_path)) == 1
    os.kill(daemon.pid, signal.SIGKILL)
    daemon.wait()
    assert wait_exited(pids, timeout_s=5) == []


@pytest.mark.slow
def test_a_frozen_rank_is_killed_by_the_watchdog_and_the_group_restarted(
    start_daemon: DaemonFactory,
) -> None:
    daemon = start_daemon(FAST + "ping_timeout_s = 1.0\nstall_kill_grace_s = 0.3\n")
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", "pair", ranks=2)
    old = rank_pids(client, "pair")
    started = time.monotonic()
    # Rank 0 then blocks in its next collective: nothing there times out.
    error = signal_mid_stream(client, "pair", old[1], signal.SIGSTOP)
    assert error.code == "runner_died"
    assert "rank 1" in error.message and "no answer to pings" in error.message
    assert time.monotonic() - started < 30, "the watchdog, not a collective, decided"
    assert wait_exited(old, timeout_s=10) == []
    daemon.wait_until(lambda: serving_again(client, "pair", old))
    (stall,) = daemon.events("runner_stalled")
    assert stall["rank"] == 1
    _, done = client.generate_text("pair", PROMPT, max_tokens=4)
    assert done.generation_tokens == 4


def test_groups_that_cannot_load_fail_without_a_hang_and_the_daemon_goes_on(
    start_daemon: DaemonFactory,
) -> None:
    client = Client(start_daemon(FAST).socket_path)
    # Ranks that die before they are warm (before this, the load waited forever).
    with pytest.raises(ClientError) as excinfo:
        client.load("builtin:tiny", "pair", ranks=2, env=faults("exit_at_import"))
    assert excinfo.value.code == "load_failed"
    assert "rank" in excinfo.value.message
    assert client.status().runners == []
    # builtin:tiny has 4 attention heads: 3 ranks cannot split them.
    with pytest.raises(ClientError) as excinfo:
        client.load("builtin:tiny", "triple", ranks=3)
    assert excinfo.value.code == "load_failed"
    assert "divide by 3" in excinfo.value.message
    assert client.status().runners == []


def test_a_group_is_estimated_as_its_ranks_hold_it() -> None:
    one = Estimate(
        weights_bytes=1000,
        kv_cache_bytes=200,
        activation_bytes=50,
        overhead_bytes=300,
        vision_bytes=0,
        total_bytes=1550,
        context_tokens=4096,
        vision=False,
        weights_source="safetensors",
        path=None,
    )
    assert group_estimate(one, 1) == one
    two = group_estimate(one, 2)
    # Weights and KV split between the ranks, and so is the part of the overhead
    # that grows with the weights (2% of them: 20); activations and the rest of
    # the overhead (runtime, tokenizer) per rank.
    share = round(ALLOCATOR_SHARE_OF_WEIGHTS * 1000)
    assert two.total_bytes == 1000 + 200 + 2 * 50 + 2 * (300 - share) + share
    assert msgspec.structs.replace(two, activation_bytes=50, overhead_bytes=300,
                                   total_bytes=1550) == one  # fmt: skip


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(4)
    assert len(set(ports)) == 4 and all(1024 <= p < 65536 for p in ports)
    # All four at once, as a group's ranks listen on them (no SO_REUSEADDR: a
    # port free_ports still held, or one another process has, is refused).
    listeners = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in ports]
    try:
        for sock, port in zip(listeners, ports, strict=True):
            sock.bind(("127.0.0.1", port))
            sock.listen()
    finally:
        for sock in listeners:
            sock.close()


@pytest.mark.slow
def test_a_rank_on_another_host_runs_through_ssh_and_answers_as_one_process_does(
    start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    hostfile, config = remote_pair(tmp_path, FAKE_SSH)
    daemon = start_daemon(FAST + config)
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", "single")
    client.load("builtin:tiny", "pair", hostfile=str(hostfile))
    info = runner(client, "pair")
    assert [(r.rank, r.host, r.state) for r in info.ranks] == [
        (0, "127.0.0.1", "ready"),
        (1, "node-b.test", "ready"),
    ]
    (spawned,) = [e for e in daemon.events("runner_spawned") if e.get("host") == "node-b.test"]
    assert "node-b.test" in spawned["argv"]  # ssh's destination
    single, _ = client.generate_text("single", PROMPT, max_tokens=16)
    pair, _ = client.generate_text("pair", PROMPT, max_tokens=16)
    assert pair == single
    pids = [pid for r in info.ranks if (pid := r.pid) is not None]
    client.unload("pair")
    assert wait_exited(pids, timeout_s=10) == []


def test_a_remote_ranks_environment_travels_on_its_pipe_never_in_an_argv(
    start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    # ssh puts its command line in the argv of ssh here and of the shell
    # there, which every user of either machine can read: a token in the
    # model's env must not be in it. It reaches the rank before anything
    # else runs there (its fault injection, read at start, is set by it).
    hostfile, config = remote_pair(tmp_path, FAKE_SSH.replace("exec /bin/sh", "/bin/sh"))
    daemon = start_daemon(FAST + config)  # (that ssh stays, with its argv, as ssh does)
    client = Client(daemon.socket_path)
    secret = "hf_s3cret-token-value"
    env = {"HF_TOKEN": secret, "MLX_SUPERVISOR_FAULTS": "crash_at_token=1000000:SIGKILL"}
    client.load("builtin:tiny", "pair", hostfile=str(hostfile), env=env)
    descendants = psutil.Process(daemon.pid).children(recursive=True)
    argvs = [" ".join(p.cmdline()) for p in descendants if p.is_running()]
    assert any("node-b.test" in argv for argv in argvs)  # the ssh session is there
    assert not [argv for argv in argvs if secret in argv]
    ranks = {record.get("rank") for record in daemon.events("fault_injection_enabled")}
    assert ranks == {0, 1}  # the remote rank had its environment before its start
    text, _ = client.generate_text("pair", PROMPT, max_tokens=4)
    assert text
    pids = [pid for r in runner(client, "pair").ranks if (pid := r.pid) is not None]
    client.unload("pair")
    assert wait_exited(pids, timeout_s=10) == []


def test_a_hostfile_that_cannot_serve_is_refused_at_load(tmp_path: Path) -> None:
    def places(hosts: object, ranks: int | None = None) -> list[Place]:
        path = tmp_path / "hosts.json"
        path.write_text(json.dumps(hosts))
        spec = ModelConfig(name="m", model="builtin:tiny", hostfile=str(path), ranks=ranks)
        return group_places(spec)

    here = {"ssh": "localhost", "ips": ["127.0.0.1"]}
    there = {"ssh": "mac-2.local", "ips": ["10.0.0.2"]}
    assert places([here, there]) == [Place(None, "127.0.0.1"), Place("mac-2.local", "10.0.0.2")]
    assert places({"hosts": [here, there]}, ranks=2)[1].host == "mac-2.local"
    with pytest.raises(ValueError, match="a group needs 2"):
        places([here])
    with pytest.raises(ValueError, match="ranks = 3"):
        places([here, there], ranks=3)
    with pytest.raises(ValueError, match="no ips"):
        places([here, {"ssh": "mac-3.local"}])
    with pytest.raises(ValueError, match="no ips"):  # loopback cannot reach another machine
        places([{"ssh": "localhost"}, there])
    with pytest.raises(ValueError, match="not a host name"):  # never an ssh option
        places([here, {"ssh": "-oProxyCommand=touch /tmp/x", "ips": ["10.0.0.3"]}])
    with pytest.raises(ValueError, match="not a host name"):
        places([here, {"ssh": "a b", "ips": ["10.0.0.3"]}])
    with pytest.raises(ValueError, match="cannot read hostfile"):
        places([{"host": "x"}])
    with pytest.raises(ValueError, match="cannot read hostfile"):
        group_places(ModelConfig(name="m", model="x", hostfile=str(tmp_path / "none.json")))


def test_a_hostfile_that_is_no_small_regular_file_is_refused_unread(tmp_path: Path) -> None:
    """A FIFO would block whoever opens it, a device or a huge file eat memory."""
    fifo = tmp_path / "hosts.fifo"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.json"
    with huge.open("wb") as f:
        f.truncate(10 << 20)  # sparse: no disk
    for path, words in ((fifo, "not a regular file"), (Path("/dev/zero"), "not a regular file"),
                        (huge, "over")):  # fmt: skip
        with pytest.raises(ValueError, match=words):
            group_places(ModelConfig(name="m", model="builtin:tiny", hostfile=str(path)))


def test_estimate_says_what_one_rank_holds() -> None:
    def total(*extra: str) -> int:
        done = subprocess.run(
            [sys.executable, "-m", "supervisor", "estimate", "builtin:tiny", "--json", *extra],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        return int(json.loads(done.stdout)["total_bytes"])

    whole, rank = total(), total("--ranks", "2")
    assert 0 < rank < whole


def test_a_config_whose_hostfile_cannot_serve_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    missing = tmp_path / "none.json"
    config.write_text(f'[[models]]\nname = "m"\nmodel = "builtin:tiny"\nhostfile = "{missing}"\n')
    with pytest.raises(ConfigError, match="cannot read hostfile"):
        load_config(config)


def test_another_machine_without_room_for_its_rank_is_named() -> None:
    gib = 1 << 30
    assert room_problem("mac-2", 64 * gib, 40 * gib, 20 * gib, None) is None
    problem = room_problem("mac-2", 64 * gib, 24 * gib, 20 * gib, None)  # guard: 6.4 GiB
    assert problem is not None and "mac-2" in problem and "20.0 GiB" in problem
    assert room_problem("mac-2", 64 * gib, 24 * gib, 20 * gib, 2 * gib) is None

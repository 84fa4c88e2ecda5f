"""A chat comes back warm after its runner's process ends: the prefix
cache's disk tier through a real daemon and real runners (builtin:tiny).

Each way a process ends is tried: a SIGKILL and the restart, an unload and a
load, a keep-alive expiry and a new load. The next turn finds the
chat's history on disk (``cached_tokens``) and answers with exactly the
tokens it gives with no cache at all. A runner killed while it writes a
block comes back and reads nothing half-written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import DaemonFactory, faults, runner
from ipc.messages import DiskCacheStats
from supervisor.client import Client
from supervisor.daemon.process import DaemonProcess

SYSTEM = "You answer questions about the sea, its tides, its fish and its storms. " * 12
TURNS = ["Why is the sea salty?", "And why does it have tides?", "Which fish live deepest?"]


def chat(turn: int, answers: list[str]) -> list[dict[str, str]]:
    """The messages of turn ``turn`` (from 0), with the answers given so far."""
    messages = [{"role": "system", "content": SYSTEM}]
    for question, answer in zip(TURNS[:turn], answers, strict=True):
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": answer}]  # fmt: skip
    return [*messages, {"role": "user", "content": TURNS[turn]}]


def disk(client: Client, name: str) -> DiskCacheStats:
    cache = runner(client, name).prefix_cache
    assert cache is not None and cache.disk is not None
    return cache.disk


def written(client: Client, name: str) -> bool:
    """The runner has written all it queued (and its next-turn prefill is done)."""
    info = runner(client, name)
    cache = info.prefix_cache
    turns = info.next_turn
    return (info.state == "ready" and cache is not None and cache.disk is not None
            and cache.disk.pending == 0 and cache.disk.entries > 0
            and (turns is None or turns.pending == 0))  # fmt: skip


def answer(client: Client, name: str, messages: list[dict[str, str]], **kw: Any) -> Any:
    return client.generate_text(name, messages=messages, max_tokens=12, **kw)


def first_turn(daemon: DaemonProcess, client: Client, name: str, wait: bool = True) -> str:
    """Answer the first turn; ``wait``: until the runner has written its blocks."""
    text, done = answer(client, name, chat(0, []))
    assert done.cached_tokens == 0
    if wait:
        daemon.wait_until(lambda: written(client, name), timeout_s=60)
    return str(text)


def assert_warm(client: Client, name: str, text: str) -> None:
    """Turn 2 starts from the disk's blocks and answers as with no cache."""
    cold, cold_done = answer(client, name, chat(1, [text]), cache=False)
    warm, done = answer(client, name, chat(1, [text]))
    assert warm == cold
    # All the history but what the template adds after the first answer: at most
    # the new user turn and the assistant's header are computed.
    history = cold_done.prompt_tokens - done.cached_tokens
    assert done.cached_tokens > 0.8 * cold_done.prompt_tokens, (history, done)
    stats = disk(client, name)
    assert stats.hits >= 1 and stats.tokens_restored >= done.cached_tokens
    assert stats.rejected == 0


def test_a_chat_is_warm_after_its_runner_is_killed(daemon: DaemonProcess, client: Client) -> None:
    client.load("builtin:tiny")
    text = first_turn(daemon, client, "tiny")
    pid = runner(client, "tiny").pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    daemon.wait_until(lambda: runner(client, "tiny").pid not in (None, pid)
                      and runner(client, "tiny").state == "ready", timeout_s=60)  # fmt: skip
    assert_warm(client, "tiny", text)


def test_a_chat_is_warm_after_an_unload_and_a_load_from_a_local_path(
    daemon: DaemonProcess, client: Client
) -> None:
    client.load("builtin:tiny")
    directory = disk(client, "tiny").directory
    assert directory is not None
    path = json.loads((Path(directory) / "identity.json").read_text())["model"]
    assert Path(path).is_dir()
    client.unload("tiny")
    client.load(path, "local")  # the same files, as a user's local directory
    text = first_turn(daemon, client, "local")
    client.unload("local")  # the blocks queued are written before the process ends
    client.load(path, "local")
    assert disk(client, "local").entries > 0
    assert_warm(client, "local", text)


def test_a_chat_is_warm_after_a_keep_alive_expiry_and_a_new_load(
    start_daemon: DaemonFactory,
) -> None:
    daemon = start_daemon('[[models]]\nname = "sea"\nmodel = "builtin:tiny"\nkeep_alive_s = 1.0\n')
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", "sea")
    text = first_turn(daemon, client, "sea", wait=False)  # the expiry's Shutdown writes them
    daemon.wait_until(lambda: all(r.name != "sea" for r in client.status().runners), timeout_s=60)
    client.load("builtin:tiny", "sea")
    assert_warm(client, "sea", text)


def test_a_runner_killed_while_it_writes_a_block_reads_nothing_half_written(
    start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon = start_daemon("")
    client = Client(daemon.socket_path)
    once = tmp_path / "killed-once"
    client.load("builtin:tiny", env=faults(f"kill_in_disk_write=renamed,once={once}"))
    pid = runner(client, "tiny").pid
    text, _done = answer(client, "tiny", chat(0, []))
    daemon.wait_until(lambda: runner(client, "tiny").pid not in (None, pid)
                      and runner(client, "tiny").state == "ready", timeout_s=60)  # fmt: skip
    assert once.exists()
    assert runner(client, "tiny").last_exit is not None
    cold, _ = answer(client, "tiny", chat(1, [text]), cache=False)
    warm, _again = answer(client, "tiny", chat(1, [text]))
    assert warm == cold
    assert disk(client, "tiny").rejected == 0


def test_cache_clear_drops_both_tiers_and_the_next_runner_starts_cold(
    daemon: DaemonProcess, client: Client
) -> None:
    client.load("builtin:tiny")
    text = first_turn(daemon, client, "tiny")
    stats = disk(client, "tiny")
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "cache", "clear", "tiny",
         "--socket", str(daemon.socket_path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"{stats.entries} blocks" in done.stdout
    assert not list(Path(str(stats.directory)).glob("blocks/*/*"))
    client.unload("tiny")
    client.load("builtin:tiny")
    _, turn = answer(client, "tiny", chat(1, [text]))
    assert turn.cached_tokens == 0


def test_a_model_can_keep_its_prefix_cache_off_disk(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(
        '[[models]]\nname = "ram"\nmodel = "builtin:tiny"\nprefix_cache_disk_bytes = 0\n'
    )
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", "ram")
    stats = disk(client, "ram")
    assert stats.reason is not None and "prefix_cache_disk_bytes" in stats.reason
    assert stats.directory is None

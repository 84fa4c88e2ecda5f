"""Many requests on one model, through a real daemon: side by side, queued
beyond max_concurrent, visible in status, and failing one by one."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import DaemonFactory
from ipc.messages import GenerationDone
from runner.builtin import ensure_builtin_model
from supervisor.client import Client, ClientError
from supervisor.config import HTTP_ENV
from supervisor.daemon.process import DaemonProcess
from test_recovery import FAST, faults, runner

PROMPTS = [
    "The supervisor restarts a runner that crashed",
    "Memory comes back when the process dies",
    "A prefix cache saves the prompt's work",
    "Four clients at once share one model",
]


class Streams:
    """Generations started together on threads; each one's outcome."""

    def __init__(self, client: Client, name: str, prompts: list[str], max_tokens: int) -> None:
        self.results: dict[int, GenerationDone | ClientError] = {}
        self.first_chunk = [threading.Event() for _ in prompts]
        self.threads = [
            threading.Thread(target=self._run, args=(client, name, i, p, max_tokens), daemon=True)
            for i, p in enumerate(prompts)
        ]
        for thread in self.threads:
            thread.start()

    def _run(self, client: Client, name: str, index: int, prompt: str, max_tokens: int) -> None:
        try:
            with client.generate(name, prompt, max_tokens=max_tokens) as gen:
                for _ in gen:
                    self.first_chunk[index].set()
            assert gen.done is not None
            self.results[index] = gen.done
        except ClientError as exc:
            self.results[index] = exc
        finally:
            self.first_chunk[index].set()

    def join(self, timeout_s: float = 120) -> dict[int, GenerationDone | ClientError]:
        for thread in self.threads:
            thread.join(timeout_s)
            assert not thread.is_alive(), "a generation hung"
        return self.results


def test_requests_beyond_max_concurrent_wait_and_status_shows_them(
    daemon: DaemonProcess, client: Client
) -> None:
    client.load("builtin:tiny", max_concurrent=2)
    info = runner(client, "tiny")
    assert (info.max_concurrent, info.batching, info.active_requests) == (2, True, 0)
    streams = Streams(client, "tiny", PROMPTS[:3], max_tokens=300)
    seen: list[tuple[int, int]] = []

    def two_running_one_waiting() -> bool:
        r = runner(client, "tiny")
        seen.append((r.active_requests, r.queue_depth))
        return (r.active_requests, r.queue_depth) == (2, 1)

    daemon.wait_until(two_running_one_waiting, timeout_s=60)
    assert runner(client, "tiny").state == "busy"
    results = streams.join()
    assert all(isinstance(r, GenerationDone) and r.generation_tokens == 300
               for r in results.values()), results  # fmt: skip
    assert max(active for active, _ in seen) <= 2
    info = runner(client, "tiny")
    assert (info.state, info.active_requests, info.queue_depth) == ("ready", 0, 0)


def test_the_prefix_cache_shows_in_status_and_clears_from_the_cli(
    daemon: DaemonProcess, client: Client
) -> None:
    client.load("builtin:tiny")
    _, first = client.generate_text("tiny", PROMPTS[0], max_tokens=8)
    _, again = client.generate_text("tiny", PROMPTS[0], max_tokens=8)
    assert first.cached_tokens == 0 and again.cached_tokens == again.prompt_tokens - 1

    cache = runner(client, "tiny").prefix_cache  # the runner reports before it says done
    assert cache is not None and cache.hits == 1
    assert cache is not None
    assert (cache.entries, cache.misses, cache.tokens_reused) == (1, 1, again.cached_tokens)
    assert 0 < cache.bytes <= cache.budget_bytes
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "cache", "clear", "tiny",
         "--socket", str(daemon.socket_path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "prefix cache cleared (1 entries" in done.stdout
    cache = runner(client, "tiny").prefix_cache
    assert cache is not None and (cache.entries, cache.bytes) == (0, 0)
    _, after = client.generate_text("tiny", PROMPTS[0], max_tokens=8)
    assert after.cached_tokens == 0
    with pytest.raises(ClientError) as excinfo:
        client.clear_cache("nope")
    assert excinfo.value.code == "unknown_model"


def test_stop_strings_cut_the_text_through_the_socket_and_the_cli(
    daemon: DaemonProcess, client: Client
) -> None:
    client.load("builtin:tiny")
    full, _ = client.generate_text("tiny", PROMPTS[1], max_tokens=30, cache=False)
    stop = full[len(full) // 2 :][:3]
    text, done = client.generate_text("tiny", PROMPTS[1], max_tokens=30, stop=[stop])
    assert text == full[: full.find(stop)] and done.finish_reason == "stop"
    printed = subprocess.run(
        [sys.executable, "-m", "supervisor", "generate", "tiny", PROMPTS[1], "--max-tokens",
         "30", "--stop", stop, "--json", "--socket", str(daemon.socket_path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    body, _, summary = printed.stdout.rstrip("\n").rpartition("\n")
    assert body == text and '"finish_reason": "stop"' in summary
    for bad in (["a", "b", "c", "d", "e"], [""], ["x" * 257]):
        with pytest.raises(ClientError) as excinfo:
            client.generate_text("tiny", PROMPTS[1], max_tokens=4, stop=bad)
        assert excinfo.value.code == "bad_request"
    assert client.generate_text("tiny", PROMPTS[1], max_tokens=30, cache=False)[0] == full


def test_per_model_switches_in_the_config(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(
        '[[models]]\nname = "plain"\nmodel = "builtin:tiny"\nprefix_cache = false\n'
        "max_concurrent = 1\n"
    )
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", "plain")
    info = runner(client, "plain")
    assert info.prefix_cache is None and info.batching is False
    assert (info.max_concurrent, info.batching_reason) == (1, "max_concurrent is 1")
    _, done = client.generate_text("plain", PROMPTS[0], max_tokens=4)
    _, again = client.generate_text("plain", PROMPTS[0], max_tokens=4)
    assert done.cached_tokens == again.cached_tokens == 0


def test_a_runner_killed_mid_batch_fails_the_started_requests_and_comes_back(
    start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon = start_daemon(FAST)
    client = Client(daemon.socket_path)
    once = tmp_path / "killed-once"
    client.load("builtin:tiny", env=faults(f"crash_at_token=400:SIGKILL,once={once}"))
    streams = Streams(client, "tiny", PROMPTS[:3], max_tokens=2000)
    results = streams.join()
    failures = [r for r in results.values() if isinstance(r, ClientError)]
    assert failures, results
    for failure in failures:  # every request had streamed: none replayed
        assert failure.code == "runner_died" and "SIGKILL" in failure.message
    daemon.wait_until(lambda: runner(client, "tiny").state == "ready", timeout_s=60)
    _, done = client.generate_text("tiny", PROMPTS[0], max_tokens=5)
    assert done.generation_tokens == 5
    assert client.status().counters["restarts"] == 1


def test_a_client_that_vanishes_mid_batch_cancels_only_its_request(
    daemon: DaemonProcess, client: Client
) -> None:
    client.load("builtin:tiny")
    streams = Streams(client, "tiny", PROMPTS[:2], max_tokens=400)
    assert streams.first_chunk[0].wait(60)
    gen = client.generate("tiny", PROMPTS[2], max_tokens=400)
    next(iter(gen))
    gen.close()  # vanish mid-stream

    def cancelled() -> bool:
        return any(e.get("finish_reason") == "cancelled" for e in daemon.events("generation_done"))

    daemon.wait_until(cancelled, timeout_s=60)
    results = streams.join()
    assert all(isinstance(r, GenerationDone) and r.generation_tokens == 400
               for r in results.values()), results  # fmt: skip
    daemon.wait_until(lambda: len(daemon.events("generation_done")) == 3, timeout_s=30)
    events: list[dict[str, Any]] = daemon.events("generation_done")  # type: ignore[assignment]
    assert sorted(e["finish_reason"] for e in events) == ["cancelled", "length", "length"]


@pytest.mark.slow
def test_an_on_demand_load_that_failed_with_no_one_left_waiting_is_tried_again(
    start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    ensure_builtin_model("builtin:tiny")  # made already: only the fault can stall the load
    hung = f"hang_at_load=c,once={tmp_path / 'hung-once'}"  # the first load hangs, no later one
    config = ("load_stall_s = 8.0\nstall_kill_grace_s = 0.3\n"  # a fresh load: under 8 s, busy
              f'[[models]]\nname = "m"\nmodel = "builtin:tiny"\n'
              f'env = {{ MLX_SUPERVISOR_FAULTS = "{hung}" }}\n')  # fmt: skip
    daemon = start_daemon(config, env={HTTP_ENV: "127.0.0.1:0"})
    client = Client(daemon.socket_path)
    url = client.status().supervisor.http
    body = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 2}
    with pytest.raises(httpx.TimeoutException):  # the client leaves while the load hangs
        httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
    daemon.wait_until(lambda: any(r.state in ("crashed", "failed") for r in client.status().runners)
                      or bool(daemon.events("load_on_demand_retried")), timeout_s=30)  # fmt: skip
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 2

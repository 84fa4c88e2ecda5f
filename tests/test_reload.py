"""Reloading the config while the daemon runs (``mlx-supervisor reload``,
SIGHUP): models added, removed and changed, a broken file refused whole,
aliases, and the defaults every request gets from its model's config. Real
daemons, real runners of builtin:tiny, the real socket, CLI and OpenAI client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from conftest import DaemonFactory, faults, runner
from ipc.messages import (
    ChatMessage,
    GenerateRequest,
    GenerationDone,
    ReloadReply,
    SamplingParams,
)
from supervisor.cli.main import main as cli_main
from supervisor.client import Client, ClientError, commands
from supervisor.config import HTTP_ENV, ModelConfig
from supervisor.daemon.process import DaemonProcess
from supervisor.daemon.state import DaemonState, RunnerRecord, StateFile, state_path
from supervisor.registry.defaults import given, with_model_defaults

CHAT = [{"role": "user", "content": "Hello there, how are you?"}]
LONG_SYSTEM_PROMPT = (
    "You are a pirate of the seven seas. Answer every question as a pirate would, with "
    "nautical words, and never admit that you are a language model running on a laptop."
)


def model(name: str, *lines: str, ref: str = "builtin:tiny") -> str:
    """One ``[[models]]`` table, with extra TOML ``lines``."""
    return "\n".join(["[[models]]", f'name = "{name}"', f'model = "{ref}"', *lines, ""])


DAEMON = "hot_spare = false\n"  # one process fewer on a shared machine: loads start a runner


def start(start_daemon: DaemonFactory, config: str, **kwargs: Any) -> tuple[DaemonProcess, Client]:
    daemon = start_daemon(config, **kwargs)
    assert daemon.config_path is not None
    return daemon, Client(daemon.socket_path, timeout_s=60)


def rewrite(daemon: DaemonProcess, config: str) -> None:
    """Write the daemon's config file anew (TOML or not: a test may break it)."""
    assert daemon.config_path is not None
    daemon.config_path.write_text(config)


def wait_ready(daemon: DaemonProcess, client: Client, name: str) -> None:
    def ready() -> bool:
        found = [r for r in client.status().runners if r.name == name]
        assert not found or found[0].state not in ("failed", "crashed"), found[0].failure
        return bool(found) and found[0].state == "ready"

    daemon.wait_until(ready, timeout_s=60)


def logged(daemon: DaemonProcess, event: str, count: int = 1) -> list[dict[str, object]]:
    """The daemon's log records of ``event`` once there are ``count`` (its log
    is read as it comes: a reply may come before the line that logs it)."""
    daemon.wait_until(lambda: len(daemon.events(event)) >= count, timeout_s=30)
    return daemon.events(event)


def names(client: Client) -> set[str]:
    return {r.name for r in client.status().runners}


def chat(client: Client, name: str, **kwargs: Any) -> tuple[str, GenerationDone]:
    return client.generate_text(name, messages=kwargs.pop("messages", CHAT), **kwargs)


# --- added, removed --------------------------------------------------------------


def test_an_added_model_preloads_and_serves_and_a_removed_idle_one_unloads_at_once(
    start_daemon: DaemonFactory,
) -> None:
    daemon, client = start(start_daemon, DAEMON + model("a", "preload = true"))
    wait_ready(daemon, client, "a")
    pid_a = runner(client, "a").pid

    rewrite(daemon, DAEMON + model("a", "preload = true") + model("b", "preload = true"))
    reply = client.reload()
    assert reply.ok and reply.added == ["b"] and reply.preloading == ["b"]
    assert reply.removed == [] and reply.changed == []
    wait_ready(daemon, client, "b")
    text, done = client.generate_text("b", "Once upon a time", max_tokens=4)
    assert done.generation_tokens > 0 and text
    assert runner(client, "a").pid == pid_a  # untouched

    rewrite(daemon, DAEMON + model("b", "preload = true"))
    reply = client.reload()
    assert reply.ok and reply.removed == ["a"] and reply.unloaded == ["a"] and not reply.unloading
    assert names(client) == {"b"}  # unloaded before the reply came
    assert pid_a is not None and not _alive(pid_a)
    with pytest.raises(ClientError) as unknown:
        client.generate_text("a", "Once upon a time", max_tokens=4)
    assert unknown.value.code == "unknown_model"
    (unloaded,) = logged(daemon, "model_unloaded")
    assert unloaded["model"] == "a"
    assert unloaded["reason"] == "removed from the config"
    reloaded = logged(daemon, "config_reloaded", count=2)[-1]
    assert reloaded["removed"] == ["a"] and reloaded["unloaded"] == ["a"]


def test_a_removed_busy_model_finishes_its_request_then_unloads(
    start_daemon: DaemonFactory,
) -> None:
    slow = f"env = {{ {_faults_toml('slow_prefill=0.02')} }}"  # a prompt of ~150 tokens: ~3 s
    daemon, client = start(start_daemon, DAEMON + model("a", "preload = true", slow))
    wait_ready(daemon, client, "a")
    results: list[GenerationDone] = []
    errors: list[BaseException] = []

    def busy() -> None:
        try:
            results.append(client.generate_text("a", "word " * 150, max_tokens=3)[1])
        except BaseException as exc:  # reported below
            errors.append(exc)

    worker = threading.Thread(target=busy)
    worker.start()
    try:
        daemon.wait_until(lambda: runner(client, "a").active_requests == 1, timeout_s=30)
        rewrite(daemon, DAEMON)
        reply = client.reload()
        assert reply.ok and reply.removed == ["a"] and reply.unloading == ["a"], reply
        assert "a" in names(client)  # still serving its request
        with pytest.raises(ClientError) as refused:
            client.generate_text("a", "Hi", max_tokens=2)
        assert refused.value.code == "unknown_model" and "removed from the config" in str(
            refused.value
        )
    finally:
        worker.join(60)
    assert not errors, errors
    (done,) = results
    assert done.finish_reason in ("length", "stop") and done.generation_tokens > 0
    daemon.wait_until(lambda: "a" not in names(client), timeout_s=30)
    (unloaded,) = logged(daemon, "model_unloaded")
    assert unloaded["reason"] == "removed from the config"


def test_an_alias_moved_from_a_removed_busy_model_names_the_new_one_at_once(
    start_daemon: DaemonFactory,
) -> None:
    """A's alias moves to B while A, removed, still serves its last request:
    the alias names B (loaded), not "A was removed"."""
    slow = f"env = {{ {_faults_toml('slow_prefill=0.02')} }}"
    daemon, client = start(start_daemon, DAEMON + model("a", "preload = true", slow,
                                                        'aliases = ["chat"]'))  # fmt: skip
    wait_ready(daemon, client, "a")
    errors: list[BaseException] = []

    def busy() -> None:
        try:
            client.generate_text("a", "word " * 150, max_tokens=3)
        except BaseException as exc:  # reported below
            errors.append(exc)

    worker = threading.Thread(target=busy)
    worker.start()
    try:
        daemon.wait_until(lambda: runner(client, "a").active_requests == 1, timeout_s=30)
        rewrite(daemon, DAEMON + model("b", 'aliases = ["chat"]'))
        reply = client.reload()
        assert reply.ok and reply.removed == ["a"] and reply.unloading == ["a"], reply
        other = Client(daemon.socket_path, timeout_s=60)
        assert other.load("builtin:tiny", "b").name == "b"
        _, done = other.generate_text("chat", "Once upon a time", max_tokens=2)
        assert done.generation_tokens > 0 and "a" in names(client)  # a still serves its own
    finally:
        worker.join(60)
    assert not errors, errors


def _faults_toml(spec: str) -> str:
    ((key, value),) = faults(spec).items()
    return f'{key} = "{value}"'


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --- changed settings ------------------------------------------------------------


def test_sampling_defaults_and_system_prompt_apply_to_the_next_request(
    start_daemon: DaemonFactory,
) -> None:
    daemon, client = start(start_daemon, DAEMON + model("a", "preload = true"))
    wait_ready(daemon, client, "a")
    own_system = [{"role": "system", "content": "Be brief."}, *CHAT]
    greedy, plain = chat(client, "a", max_tokens=8)
    greedy_own_system, with_own_system = chat(client, "a", messages=own_system, max_tokens=8)
    _, raw = client.generate_text("a", "Once upon a time", max_tokens=4)
    pid = runner(client, "a").pid

    rewrite(daemon, DAEMON + model(
        "a", "preload = true", "temperature = 5.0", "seed = 7", "default_max_tokens = 5",
        f'system_prompt = "{LONG_SYSTEM_PROMPT}"',
    ))  # fmt: skip
    reply = client.reload()
    (change,) = reply.changed
    assert change.name == "a" and change.loaded and change.next_load == []
    assert change.now == ["default_max_tokens", "seed", "system_prompt", "temperature"]

    # No sampling given: the model's temperature, seed and length; its system prompt first.
    sampled, done = chat(client, "a", cache=False)
    assert done.prompt_tokens > plain.prompt_tokens + 20  # the pirate came first
    assert done.generation_tokens <= 5 and done.finish_reason == "length"
    again, _ = chat(client, "a", cache=False)
    assert again == sampled  # the configured seed: the same draw
    greedy_pirate, pirate = chat(client, "a", temperature=0.0, max_tokens=5)
    assert pirate.prompt_tokens == done.prompt_tokens
    assert sampled != greedy_pirate  # temperature 5 over the whole vocabulary: not the argmax
    # The request's own settings win: its temperature 0, its length, its system message.
    text, own = chat(client, "a", messages=own_system, temperature=0.0, max_tokens=8)
    assert (text, own.prompt_tokens) == (greedy_own_system, with_own_system.prompt_tokens)
    # A raw prompt gets no system prompt.
    _, raw_after = client.generate_text("a", "Once upon a time", temperature=0.0, max_tokens=4)
    assert raw_after.prompt_tokens == raw.prompt_tokens
    assert runner(client, "a").pid == pid  # no restart: applied to the loaded model

    rewrite(daemon, DAEMON + model("a", "preload = true"))  # the defaults taken away again
    assert client.reload().changed[0].now == [
        "default_max_tokens", "seed", "system_prompt", "temperature",
    ]  # fmt: skip
    text, back = chat(client, "a", max_tokens=8)
    assert (text, back.prompt_tokens) == (greedy, plain.prompt_tokens)


def test_runner_settings_wait_for_the_next_load_and_daemon_keys_say_when(
    start_daemon: DaemonFactory,
) -> None:
    daemon, client = start(start_daemon, DAEMON + model("a", "preload = true"))
    wait_ready(daemon, client, "a")
    before = runner(client, "a")
    assert before.kv_bits is None and before.max_concurrent == 8
    daemon_keys = DAEMON + "max_queue = 9\nmax_concurrent = 2\nrunner_stderr_lines = 40\n"

    rewrite(daemon, daemon_keys + model("a", "preload = true", "kv_bits = 8", "pinned = true"))
    reply = client.reload()
    (change,) = reply.changed
    assert (change.now, change.next_load) == (["pinned"], ["kv_bits"])
    assert (reply.daemon_now, reply.daemon_next_load) == (["max_queue"], ["max_concurrent"])
    assert reply.needs_restart == ["runner_stderr_lines"]
    now = runner(client, "a")
    assert now.pinned and now.kv_bits is None and now.pid == before.pid  # kv_bits: not yet
    (reloaded,) = logged(daemon, "config_reloaded")
    assert reloaded["changed"] == {"a": {"loaded": True, "now": ["pinned"],
                                         "next_load": ["kv_bits"]}}  # fmt: skip
    assert reloaded["needs_restart"] == ["runner_stderr_lines"]

    # tiny's heads are too narrow for a quantized KV cache: take it back before the next
    # load, and lower the model's cap, which its runner holds from its load.
    rewrite(daemon, daemon_keys + model("a", "preload = true", "pinned = true", "max_tokens = 3"))
    reply = client.reload()
    assert (reply.changed[0].now, reply.changed[0].next_load) == ([], ["kv_bits", "max_tokens"])
    assert reply.daemon_now == reply.daemon_next_load == []
    assert reply.needs_restart == ["runner_stderr_lines"]  # still: until the daemon restarts
    _, done = client.generate_text("a", "Once upon a time", max_tokens=6)
    assert done.max_tokens_clamped_to is None and done.generation_tokens == 6  # not yet

    assert before.pid is not None
    os.kill(before.pid, signal.SIGKILL)  # its restart is its next load
    daemon.wait_until(lambda: runner(client, "a").restarts == 1, timeout_s=30)
    wait_ready(daemon, client, "a")
    after = runner(client, "a")
    assert after.kv_bits is None and after.max_concurrent == 2 and after.pinned
    _, done = client.generate_text("a", "Once upon a time", max_tokens=6)
    assert done.max_tokens_clamped_to == 3 and done.generation_tokens == 3
    assert len(logged(daemon, "settings_applied_at_load")) == 1


def test_the_daemons_max_tokens_caps_http_requests_from_the_next_load_as_the_reply_says(
    start_daemon: DaemonFactory,
) -> None:
    """An HTTP request that names no max_tokens runs to the cap: the one its
    model's runner was loaded with, until its next load, as the reload's
    reply says (daemon_next_load), not the new one at once."""
    config = DAEMON + "max_tokens = 12\n" + model("a", "preload = true")
    daemon, client = start(start_daemon, config, env={HTTP_ENV: "127.0.0.1:0"})
    url = client.status().supervisor.http
    assert url is not None
    wait_ready(daemon, client, "a")

    def completion_tokens() -> int:
        response = httpx.post(f"{url}/v1/completions", timeout=60,
                              json={"model": "a", "prompt": "Once upon a time"})  # fmt: skip
        assert response.status_code == 200, response.text
        return int(response.json()["usage"]["completion_tokens"])

    assert completion_tokens() == 12
    rewrite(daemon, DAEMON + "max_tokens = 4\n" + model("a", "preload = true"))
    reply = client.reload()
    assert reply.daemon_next_load == ["max_tokens"], reply
    assert completion_tokens() == 12  # its runner's cap: until its next load
    pid = runner(client, "a").pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    daemon.wait_until(lambda: runner(client, "a").restarts == 1, timeout_s=30)
    wait_ready(daemon, client, "a")
    assert completion_tokens() == 4


# --- refused -------------------------------------------------------------------------


BROKEN = [  # (the [[models]] that break a config, the key the refusal names, words in it)
    (model("a", "temperatur = 0.5"), "models[1].temperatur", "unknown field"),
    (model("a", "top_p = 1.5"), "models[1].top_p", "<= 1.0"),
    (model("a", 'aliases = ["added"]'), "models", "repeated: added"),
    (model("a", 'aliases = ["x/y"]'), "models[1].aliases", "hold no '/'"),
    (model("a", "max_tokens = 8", "default_max_tokens = 9"), "models[1].default_max_tokens",
     "above the model's cap"),
    ("[[models]\n", None, "at line"),  # no TOML
]  # fmt: skip


def test_a_broken_config_is_refused_whole_and_the_old_one_keeps_serving(
    start_daemon: DaemonFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    daemon, client = start(start_daemon, DAEMON + model("a"))
    client.load("builtin:tiny", "a")
    pid = runner(client, "a").pid
    for count, (broken, key, words) in enumerate(BROKEN, start=1):
        rewrite(daemon, DAEMON + "max_queue = 3\n" + model("added") + broken)
        reply = client.reload()
        assert not reply.ok and reply.key == key, reply
        assert reply.error is not None and words in reply.error, reply.error
        assert str(daemon.config_path) in reply.error
        assert reply.added == reply.changed == reply.daemon_now == []
        refused = logged(daemon, "config_reload_refused", count)
        assert len(refused) == count and refused[-1]["key"] == key
    _, done = client.generate_text("a", "Once upon a time", max_tokens=3)
    assert done.generation_tokens > 0 and runner(client, "a").pid == pid
    assert names(client) == {"a"} and not daemon.events("config_reloaded")

    # The CLI says it for people (exit 1, the key first) and for scripts (--json).
    rewrite(daemon, DAEMON + model("a", "top_p = 1.5"))
    assert cli_main(["reload", "--socket", str(daemon.socket_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: reload refused (key models[0].top_p): invalid config "), err
    assert err.rstrip().endswith("the running config is unchanged")
    assert cli_main(["reload", "--json", "--socket", str(daemon.socket_path)]) == 1
    printed = json.loads(capsys.readouterr().out)
    assert printed["ok"] is False and printed["key"] == "models[0].top_p"
    # Pointed at the broken file itself, the CLI still asks the daemon (which judges it).
    rewrite(daemon, f'socket_path = "{daemon.socket_path}"\n' + model("a", "top_k = -1"))
    assert cli_main(["reload", "--config", str(daemon.config_path)]) == 1
    assert "(key models[0].top_k)" in capsys.readouterr().err


def test_a_config_that_is_not_utf8_is_refused_and_the_daemon_serves_on(
    start_daemon: DaemonFactory,
) -> None:
    daemon, client = start(start_daemon, DAEMON + model("a"))
    assert daemon.config_path is not None
    daemon.config_path.write_bytes(DAEMON.encode() + b"# caf\xe9 in Latin-1\n")
    reply = client.reload()
    assert not reply.ok and reply.error is not None and "not UTF-8" in reply.error, reply
    assert reply.removed == [] and client.status().supervisor.pid == daemon.pid
    assert logged(daemon, "config_reload_refused")[0]["path"] == str(daemon.config_path)


def test_a_sighup_while_the_daemon_starts_leaves_it_starting(tmp_path: Path) -> None:
    """A SIGHUP before the daemon listens for it (a reload right after a
    start) must not end it, as SIGHUP's default action would. The start is
    held where it waits for a predecessor's leftover runner it has killed: a
    child of this test, which the test reaps only once the signal is sent."""
    socket_path = tmp_path / "d.sock"
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    daemon = DaemonProcess(socket_path)
    failures: list[BaseException] = []

    def start_daemon_process() -> None:
        try:
            daemon.start()
        except BaseException as exc:  # reported below
            failures.append(exc)

    killed = threading.Thread(  # returns once the daemon has killed it, leaving it unreaped
        target=os.waitid, args=(os.P_PID, leftover.pid, os.WEXITED | os.WNOWAIT), daemon=True
    )
    starting = threading.Thread(target=start_daemon_process)
    try:
        created = psutil.Process(leftover.pid).create_time()
        runners = [RunnerRecord("old", leftover.pid, created)]
        StateFile(state_path(socket_path)).save(DaemonState(1, str(socket_path), runners))
        killed.start()
        starting.start()
        killed.join(30)
        assert not killed.is_alive(), "the daemon did not kill its predecessor's runner"
        assert daemon.process is not None
        daemon.process.send_signal(signal.SIGHUP)  # it waits for the runner to go now
        leftover.wait(10)
        starting.join(60)
        assert not failures, failures
        assert Client(socket_path).status().supervisor.pid == daemon.pid
    finally:
        leftover.kill()
        leftover.wait()
        starting.join(60)
        if daemon.process is not None and daemon.process.poll() is None:
            assert daemon.terminate() == 0


def test_sighup_reloads_as_the_command_does(start_daemon: DaemonFactory) -> None:
    daemon, client = start(start_daemon, DAEMON + model("a", "preload = true"))
    wait_ready(daemon, client, "a")
    _, plain = chat(client, "a", max_tokens=2)

    rewrite(daemon, DAEMON + model("a", "preload = true", f'system_prompt = "{LONG_SYSTEM_PROMPT}"')
            + model("b", "preload = true"))  # fmt: skip
    assert daemon.process is not None
    daemon.process.send_signal(signal.SIGHUP)
    (reloaded,) = logged(daemon, "config_reloaded")
    assert reloaded["added"] == ["b"] and reloaded["preloading"] == ["b"]
    assert reloaded["changed"] == {"a": {"loaded": True, "now": ["system_prompt"], "next_load": []}}
    wait_ready(daemon, client, "b")
    _, pirate = chat(client, "a", max_tokens=2)
    assert pirate.prompt_tokens > plain.prompt_tokens + 20

    rewrite(daemon, "bogus_key = 1\n")
    daemon.process.send_signal(signal.SIGHUP)
    assert logged(daemon, "config_reload_refused")[0]["key"] == "bogus_key"
    assert names(client) == {"a", "b"}  # the running config stays
    # The command and the CLI give the same answer to the same file.
    reply = client.reload()
    assert not reply.ok and reply.key == "bogus_key"


# --- aliases -----------------------------------------------------------------------


def test_aliases_resolve_through_the_socket_and_the_openai_front(
    start_daemon: DaemonFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    config = DAEMON + model("a", 'aliases = ["fast", "tiny-chat"]')
    daemon, client = start(start_daemon, config, env={HTTP_ENV: "127.0.0.1:0"})
    url = client.status().supervisor.http
    assert url is not None
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)

    listed = {m.id: m for m in api.models.list().data}
    assert {"a", "fast", "tiny-chat"} <= set(listed)
    assert (listed["fast"].model_extra or {})["alias_of"] == "a"
    assert api.models.retrieve("tiny-chat").id == "tiny-chat"

    # Load on demand by an alias: the model loads under its own name.
    messages: Any = CHAT
    answer = api.chat.completions.create(model="fast", messages=messages, max_tokens=3)
    assert answer.model == "a" and answer.usage is not None
    assert answer.usage.completion_tokens > 0
    assert names(client) == {"a"}
    _, done = client.generate_text("tiny-chat", "Once upon a time", max_tokens=3)
    assert done.generation_tokens > 0

    # A reload adds an alias to the loaded model: it resolves at once, everywhere.
    rewrite(daemon, DAEMON + model("a", 'aliases = ["fast", "tiny-chat", "quick"]'))
    reply = client.reload()
    assert reply.changed[0].now == ["aliases"] and reply.changed[0].loaded
    assert cli_main(["reload", "--socket", str(daemon.socket_path)]) == 0
    assert "nothing changed" in capsys.readouterr().out
    _, done = client.generate_text("quick", "Once upon a time", max_tokens=3)
    assert done.generation_tokens > 0
    response = httpx.post(f"{url}/v1/completions", timeout=60,
                          json={"model": "quick", "prompt": "Hi", "max_tokens": 2})  # fmt: skip
    assert response.status_code == 200 and response.json()["model"] == "a"
    assert client.unload("quick").name == "a"
    assert names(client) == set()


# --- the defaults, alone (no daemon) -------------------------------------------------


def test_model_defaults_fill_only_what_the_client_left_unset() -> None:
    spec = ModelConfig(name="a", model="builtin:tiny", temperature=0.7, top_k=40,
                       default_max_tokens=64, system_prompt="Be nice.")  # fmt: skip
    messages = [ChatMessage("user", "Hi")]

    asked = GenerateRequest("a", messages=messages, sampling=SamplingParams(temperature=0.0),
                            sampling_given=given(temperature=0.0, top_p=None))  # fmt: skip
    applied = with_model_defaults(asked, spec)
    assert applied.sampling.temperature == 0.0  # the client's, though it is the default value
    assert (applied.sampling.top_k, applied.sampling.max_tokens) == (40, 64)
    assert applied.messages == [ChatMessage("system", "Be nice."), *messages]

    # A client that does not say: what differs from SamplingParams' defaults is its own.
    legacy = with_model_defaults(
        GenerateRequest("a", prompt="Hi", sampling=SamplingParams(max_tokens=5, top_k=3)), spec
    )
    assert (legacy.sampling.temperature, legacy.sampling.top_k) == (0.7, 3)
    assert legacy.sampling.max_tokens == 5 and legacy.messages is None and legacy.prompt == "Hi"

    system = [ChatMessage("system", "Mine."), *messages]
    kept = with_model_defaults(GenerateRequest("a", messages=system, sampling_given=()), spec)
    assert kept.messages == system
    bare = GenerateRequest("a", prompt="Hi", sampling_given=("temperature", "top_k", "max_tokens"))
    assert with_model_defaults(bare, ModelConfig(name="a", model="m")) is bare


def test_a_clients_own_sampling_params_are_all_its_choice() -> None:
    """``generate(sampling=...)``: every field is the caller's (an explicit
    greedy request stays greedy), unless it names the fields it chose."""
    spec = ModelConfig(name="a", model="builtin:tiny", temperature=0.8, top_p=0.9,
                       default_max_tokens=7)  # fmt: skip
    whole = commands.generate("a", "Hi", sampling=SamplingParams(temperature=0.0, max_tokens=30))
    applied = with_model_defaults(whole, spec).sampling
    assert (applied.temperature, applied.top_p, applied.max_tokens) == (0.0, 1.0, 30)
    named = commands.generate("a", "Hi", sampling=SamplingParams(temperature=0.0),
                              sampling_given=("temperature",))  # fmt: skip
    applied = with_model_defaults(named, spec).sampling
    assert (applied.temperature, applied.top_p, applied.max_tokens) == (0.0, 0.9, 7)


def test_reload_reply_round_trips_for_the_admin_api() -> None:
    import msgspec

    reply = ReloadReply(ok=False, path="/x.toml", error="bad", key="models[0].top_p")
    assert msgspec.json.decode(msgspec.json.encode(reply), type=ReloadReply) == reply

"""Memory safety in layers, end to end: real daemons, real runners, real memory.

``memory_override_mb`` makes the daemon believe the machine is small. With
``pressure_threshold_pct = 100`` and ``memory_headroom_bytes = 0`` what fits
is plain arithmetic over the estimator's figures (which the tests compute
with the same estimator), so each test chooses the sizes that make its case.
"""

from __future__ import annotations

import threading
import time

import pytest

from conftest import DaemonFactory, faults, runner
from supervisor.client import Client, ClientError
from supervisor.daemon.process import DaemonProcess
from supervisor.memory.estimate import (
    RUNTIME_DEFAULT_BYTES,
    Estimate,
    estimate_reference,
    with_runtime,
)

MiB = 1 << 20
PROMPT = "The quick brown fox"


def estimate(model: str, context: int | None = None) -> Estimate:
    found = estimate_reference(model, context)
    assert found is not None
    return found


def context_for(model: str, target_bytes: int) -> int:
    """The context (tokens) that makes ``model``'s estimate closest to, not above, target."""
    low, high = 1, 10_000_000
    while low < high:
        mid = (low + high + 1) // 2
        if estimate(model, mid).total_bytes <= target_bytes:
            low = mid
        else:
            high = mid - 1
    return low


def memory_config(override_mb: int, extra: str = "") -> str:
    return (
        f"memory_override_mb = {override_mb}\n"
        "pressure_threshold_pct = 100.0\n"
        "memory_headroom_bytes = 0\n"
        "memory_guard_bytes = 0\n"
        "hot_spare = false\n"
        "restart_backoff_s = 0.1\n" + extra
    )


def events_for(daemon: DaemonProcess, event: str, model: str) -> list[dict[str, object]]:
    return [r for r in daemon.events(event) if r.get("model") == model]


def estimate_record(daemon: DaemonProcess, model: str) -> dict[str, object]:
    """The estimate admission planned ``model``'s latest runner with (the daemon's log)."""
    records = events_for(daemon, "model_estimate", model)
    assert records, f"no model_estimate for {model}"
    return records[-1]


def test_admission_refuses_with_numbers_and_spawns_nothing(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(memory_config(1000))
    client = Client(daemon.socket_path)
    with pytest.raises(ClientError) as refused:
        client.load("builtin:small", context_tokens=200_000)
    assert refused.value.code == "insufficient_memory"
    message = refused.value.message
    assert "needs" in message and "available" in message and "GiB" in message, message
    assert "nothing idle to evict" in message
    # The parts it was planned with: the runtime (and where that figure came from), headroom.
    assert "runtime" in message and "nothing measured yet" in message, message
    assert "headroom" in message, message
    assert daemon.events("runner_spawned") == []
    assert client.status().runners == []
    assert client.status().counters.get("admission_refused") == 1


def test_lru_idle_model_evicted_to_make_room_pinned_kept(start_daemon: DaemonFactory) -> None:
    tiny = estimate("builtin:tiny").total_bytes
    total_mb = (3 * tiny + 400 * MiB) // MiB
    daemon = start_daemon(memory_config(total_mb))
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", "a", pinned=True)
    client.load("builtin:tiny", "b")
    client.generate_text("a", PROMPT, max_tokens=2)  # a used last: b is the LRU one ...
    # ... but a is pinned anyway. Now a model that fits only once one tiny is gone.
    target = total_mb * MiB - tiny - tiny // 2
    context = context_for("builtin:small", target)
    loaded = client.load("builtin:small", "big", context_tokens=context)
    assert loaded.name == "big"
    names = {r.name: r.state for r in client.status().runners}
    assert names == {"a": "ready", "big": "ready"}, names
    evicting = [r for r in daemon.events("model_evicting")]
    assert [r["model"] for r in evicting] == ["b"]
    assert "to make room for big" in str(evicting[0]["reason"])
    assert client.status().counters.get("evicted") == 1
    big = runner(client, "big")
    assert big.memory_budget_bytes is not None
    # The daemon's estimate: this one's, with the runtime it measured (a's runner at its start).
    record = estimate_record(daemon, "big")
    assert record["overhead_source"] == "runner", record
    runtime = int(str(record["runtime_bytes"]))
    assert big.estimate_bytes == with_runtime(estimate("builtin:small", context), runtime,
                                              "runner").total_bytes  # fmt: skip


def test_a_load_that_cannot_fit_even_with_every_idle_model_gone_evicts_nothing(
    start_daemon: DaemonFactory,
) -> None:
    tiny = estimate("builtin:tiny").total_bytes
    total_mb = (3 * tiny + 400 * MiB) // MiB
    daemon = start_daemon(memory_config(total_mb))
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", "a")
    client.load("builtin:tiny", "b")
    pids = {r.name: r.pid for r in client.status().runners}
    context = context_for("builtin:small", total_mb * MiB + 64 * MiB)  # over the whole machine
    with pytest.raises(ClientError) as refused:
        client.load("builtin:small", "big", context_tokens=context)
    assert refused.value.code == "insufficient_memory"
    message = refused.value.message
    assert "if every idle model were unloaded" in message, message
    assert daemon.events("model_evicting") == []
    assert {r.name: r.pid for r in client.status().runners} == pids
    assert {r.state for r in client.status().runners} == {"ready"}
    assert client.status().counters.get("evicted") is None


def test_the_estimate_plans_the_warm_spares_measured_runtime(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon("ping_timeout_s = 1.0\n")  # the hot spare is on by default
    client = Client(daemon.socket_path)

    def spare_warm() -> bool:
        spare = client.status().spare
        return spare is not None and spare.warm and spare.rss_bytes is not None

    daemon.wait_until(spare_warm)
    spare = client.status().spare
    assert spare is not None and spare.rss_bytes is not None
    client.load("builtin:tiny")
    record = estimate_record(daemon, "tiny")
    assert record["overhead_source"] == "spare", record
    runtime = int(str(record["runtime_bytes"]))
    assert 0.8 * spare.rss_bytes <= runtime <= 1.25 * spare.rss_bytes, (runtime, spare)
    info = runner(client, "tiny")
    assert info.estimate_bytes == record["total_bytes"]
    # Granted: the estimate plus the model's own headroom, a share of it.
    headroom = int(str(record["headroom_bytes"]))
    assert 0 < headroom < int(str(record["total_bytes"])) // 4
    assert info.memory_budget_bytes == info.estimate_bytes + headroom


def test_before_any_spare_the_first_runner_measures_the_runtime(
    start_daemon: DaemonFactory,
) -> None:
    daemon = start_daemon("hot_spare = false\n")
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", "a")
    first = estimate_record(daemon, "a")
    assert first["overhead_source"] == "default", first
    assert first["runtime_bytes"] == RUNTIME_DEFAULT_BYTES
    daemon.wait_until(lambda: bool(daemon.events("runtime_measured")))
    client.load("builtin:tiny", "b")
    second = estimate_record(daemon, "b")
    assert second["overhead_source"] == "runner", second
    runtime = int(str(second["runtime_bytes"]))
    a = runner(client, "a")
    assert a.rss_bytes is not None
    # a's runner at its start, mlx imported: more than nothing, less than it holds loaded.
    assert 20 * MiB < runtime < a.rss_bytes, (runtime, a.rss_bytes)


def test_busy_and_pinned_models_are_never_evicted(start_daemon: DaemonFactory) -> None:
    tiny = estimate("builtin:tiny").total_bytes
    total_mb = (3 * tiny + 400 * MiB) // MiB
    daemon = start_daemon(memory_config(total_mb))
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", "pinned", pinned=True)
    client.load("builtin:tiny", "busy")
    context = context_for("builtin:small", total_mb * MiB - tiny - tiny // 2)
    with client.generate("busy", PROMPT, max_tokens=400) as gen:
        first = next(gen)  # it is streaming now
        with pytest.raises(ClientError) as refused:
            client.load("builtin:small", "big", context_tokens=context)
        rest = "".join(gen)
    assert refused.value.code == "insufficient_memory"
    assert "nothing idle to evict" in refused.value.message
    assert gen.done is not None and gen.done.finish_reason == "length", gen.done
    assert first + rest
    assert daemon.events("model_evicting") == []
    assert {r.name for r in client.status().runners} == {"pinned", "busy"}


def test_max_loaded_models_evicts_the_least_recently_used(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon("max_loaded_models = 2\nhot_spare = false\n")
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", "a")
    client.load("builtin:tiny", "b")
    client.generate_text("a", PROMPT, max_tokens=2)  # b is now the least recently used
    client.load("builtin:tiny", "c")
    assert {r.name for r in client.status().runners} == {"a", "c"}
    evicting = daemon.events("model_evicting")
    assert [r["model"] for r in evicting] == ["b"]
    assert "max_loaded_models" in str(evicting[0]["reason"])
    unloaded = [r for r in daemon.events("model_unloaded") if r.get("model") == "b"]
    assert unloaded and "evicted" in str(unloaded[0]["reason"])


def test_keep_alive_unloads_an_idle_model_but_not_a_pinned_one(
    start_daemon: DaemonFactory,
) -> None:
    daemon = start_daemon("hot_spare = false\n")
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", "kept", keep_alive_s=0.5, pinned=True)
    client.load("builtin:tiny", "expiring", keep_alive_s=0.5)
    assert runner(client, "expiring").keep_alive_s == 0.5
    daemon.wait_until(lambda: bool(events_for(daemon, "model_unloaded", "expiring")), 30)
    reason = str(events_for(daemon, "model_unloaded", "expiring")[0]["reason"])
    assert reason.startswith("expired"), reason
    status = client.status()
    assert [r.name for r in status.runners] == ["kept"]
    assert status.counters.get("expired") == 1


@pytest.mark.slow
def test_keep_alive_counts_from_the_end_of_the_last_request(start_daemon: DaemonFactory) -> None:
    # Each request (a slow prefill) lasts longer than the keep-alive: counted
    # from the load or from a request's start, the model would expire between
    # two requests or as soon as the last one ended; counted from the end of
    # the last one, it stays a whole keep-alive after it.
    keep_alive_s = 1.0
    daemon = start_daemon("hot_spare = false\n")
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", keep_alive_s=keep_alive_s, prefix_cache=False,
                env=faults("slow_prefill=0.015"))  # fmt: skip
    ended = 0.0
    for i in range(3):
        started = time.monotonic()
        _, done = client.generate_text("tiny", f"{i}: {PROMPT * 12}", max_tokens=2)
        ended = time.monotonic()
        assert ended - started > 1.2 * keep_alive_s, (ended - started, done)

    def unloading() -> bool:
        return all(r.state == "stopping" for r in client.status().runners if r.name == "tiny")

    daemon.wait_until(unloading, 30)
    idle_s = time.monotonic() - ended
    assert idle_s >= 0.7 * keep_alive_s, f"unloaded {idle_s:.2f}s after the last request ended"
    daemon.wait_until(lambda: bool(events_for(daemon, "model_unloaded", "tiny")), 30)
    reason = str(events_for(daemon, "model_unloaded", "tiny")[0]["reason"])
    assert reason.startswith("expired"), reason
    assert client.status().counters.get("expired") == 1


def test_memory_gate_waits_for_an_unloaded_runner_before_the_next_spawn(
    start_daemon: DaemonFactory,
) -> None:
    daemon = start_daemon("hot_spare = false\nping_timeout_s = 1.0\n")
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", "first")
    client.generate_text("first", PROMPT, max_tokens=4)
    daemon.wait_until(lambda: runner(client, "first").rss_bytes is not None)
    client.unload("first")
    client.load("builtin:tiny", "second")
    gates = daemon.events("memory_gate_passed")
    assert gates, "no memory gate between the unload and the next spawn"
    assert gates[-1]["departed"] == ["first"]
    assert int(str(gates[-1]["footprint_bytes"])) > 10 * MiB
    spawned = [r for r in daemon.records() if r.get("event") in ("memory_gate_passed",
                                                                 "runner_spawned")]  # fmt: skip
    order = [(r["event"], r.get("model")) for r in spawned]
    assert order.index(("memory_gate_passed", None)) < order.index(("runner_spawned", "second"))


def test_load_guard_stops_a_load_that_eats_the_machine_without_a_restart_loop(
    start_daemon: DaemonFactory,
) -> None:
    # Admission keeps room for the estimate and the guard; a load that takes
    # more than its estimate (here: a hog before the weights) is the guard's.
    small = estimate("builtin:small", 256).total_bytes
    guard = 256 * MiB
    total_mb = (small + guard) // MiB + 100
    config = memory_config(total_mb).replace("memory_guard_bytes = 0",
                                             f"memory_guard_bytes = {guard}")  # fmt: skip
    daemon = start_daemon(config)
    client = Client(daemon.socket_path)
    with pytest.raises(ClientError) as failed:
        client.load("builtin:small", context_tokens=256, env=faults(f"hog_at_load={small // MiB}"))
    assert failed.value.code == "load_failed"
    assert "memory guard" in failed.value.message and "layer" in failed.value.message
    assert len(daemon.events("runner_spawned")) == 1
    died = daemon.events("runner_died")
    assert died and died[0]["cause_class"] == "memory_guard", died
    audits = daemon.events("exit_audit")
    assert audits and audits[-1].get("cause_class") == "memory_guard"
    assert int(str(audits[-1]["active_bytes"])) >= small // 2  # measured before the drop


def test_admission_keeps_room_for_the_guard(start_daemon: DaemonFactory) -> None:
    tiny = estimate("builtin:tiny").total_bytes
    guard = 512 * MiB
    total_mb = (tiny + guard) // MiB - 50  # the estimate fits, the estimate + guard does not
    config = memory_config(total_mb).replace("memory_guard_bytes = 0",
                                             f"memory_guard_bytes = {guard}")  # fmt: skip
    daemon = start_daemon(config)
    with pytest.raises(ClientError) as refused:
        Client(daemon.socket_path).load("builtin:tiny")
    assert refused.value.code == "insufficient_memory"
    assert "must stay free for the guards" in refused.value.message
    assert daemon.events("runner_spawned") == []


def test_generation_guard_ends_a_runaway_request_and_the_runner_stays_up(
    start_daemon: DaemonFactory,
) -> None:
    tiny = estimate("builtin:tiny").total_bytes
    daemon = start_daemon(memory_config(4096))
    client = Client(daemon.socket_path)
    hog_mb = 2 * tiny // MiB + 64  # far over its budget (its estimate)
    client.load("builtin:tiny", env=faults(f"hog_at_token=20:{hog_mb}"))
    before = runner(client, "tiny")
    assert before.memory_budget_bytes == tiny
    _, done = client.generate_text("tiny", PROMPT, max_tokens=200)
    assert done.finish_reason == "memory_pressure", done
    assert done.detail and "budget" in done.detail, done.detail
    assert 20 <= done.generation_tokens < 200
    after = runner(client, "tiny")
    assert after.pid == before.pid and after.state == "ready"
    _, again = client.generate_text("tiny", PROMPT, max_tokens=8)  # the hog is gone with it
    assert again.finish_reason == "length"


def test_requests_over_the_token_cap_are_clamped_and_told(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon("hot_spare = false\nmax_tokens = 12\n")
    client = Client(daemon.socket_path)
    client.load("builtin:tiny")
    _, done = client.generate_text("tiny", PROMPT, max_tokens=500)
    assert done.max_tokens_clamped_to == 12
    assert done.generation_tokens <= 12
    _, small = client.generate_text("tiny", PROMPT, max_tokens=5)
    assert small.max_tokens_clamped_to is None


def test_restart_after_a_death_goes_through_admission_and_fails_when_full(
    start_daemon: DaemonFactory,
) -> None:
    tiny = estimate("builtin:tiny").total_bytes
    total_mb = (2 * tiny + 600 * MiB) // MiB
    context = context_for("builtin:small", total_mb * MiB - tiny // 2)
    daemon = start_daemon(
        memory_config(total_mb).replace("restart_backoff_s = 0.1", "restart_backoff_s = 4.0")
    )
    client = Client(daemon.socket_path)
    client.load("builtin:tiny", "victim", env=faults("crash_at_token=2:SIGSEGV"))
    for _ in range(2):  # the first restart is at once; the second waits out the backoff
        with pytest.raises(ClientError):
            client.generate_text("victim", PROMPT, max_tokens=8)
    info = runner(client, "victim")
    assert info.last_exit is not None
    assert info.last_exit.cause_class == "segfault", info.last_exit
    # While it waits out its backoff, a pinned model takes what it would need.
    client.load("builtin:small", "hog", pinned=True, context_tokens=context)
    daemon.wait_until(lambda: runner(client, "victim").state == "failed", 60)
    failed = runner(client, "victim")
    assert failed.failure is not None
    assert "insufficient memory" in failed.failure, failed.failure
    assert len(events_for(daemon, "runner_spawned", "victim")) == 2


def test_status_shows_the_memory_picture(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(memory_config(8192, "ping_timeout_s = 1.0\n"))
    client = Client(daemon.socket_path)
    client.load("builtin:tiny")
    daemon.wait_until(lambda: runner(client, "tiny").mlx_active_bytes is not None)
    status = client.status()
    system = status.system
    assert system.memory_total_bytes == 8192 * MiB
    assert system.override_mb == 8192
    assert system.threshold_pct == 100.0
    assert 0 <= system.memory_available_bytes <= system.memory_total_bytes
    assert 0.0 <= system.pressure_pct <= 100.0
    info = status.runners[0]
    assert info.estimate_bytes == estimate("builtin:tiny").total_bytes
    assert info.memory_budget_bytes == info.estimate_bytes
    assert info.mlx_active_bytes is not None and info.mlx_active_bytes > 0
    assert info.mlx_peak_bytes is not None and info.mlx_peak_bytes >= info.mlx_active_bytes


def test_default_thresholds_follow_the_machine_size(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon("hot_spare = false\n", env={"OVERRIDE_MEMORY_MB": str(40 * 1024)})
    system = Client(daemon.socket_path).status().system
    assert system.override_mb == 40 * 1024 and system.threshold_pct == 75.0


def test_a_bad_override_stops_the_daemon_with_a_clear_error(tmp_path: object) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "supervisor", "serve", "--socket", "/nonexistent/x.sock"],
        env={**__import__("os").environ, "OVERRIDE_MEMORY_MB": "lots"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert "OVERRIDE_MEMORY_MB" in result.stderr


def test_concurrent_loads_do_not_both_take_the_same_memory(start_daemon: DaemonFactory) -> None:
    tiny = estimate("builtin:tiny").total_bytes
    total_mb = (tiny + tiny // 2) // MiB + 1  # room for one tiny, not two
    daemon = start_daemon(memory_config(total_mb))
    results: dict[str, str] = {}

    def load(name: str) -> None:
        try:
            Client(daemon.socket_path).load("builtin:tiny", name, pinned=True)
            results[name] = "loaded"
        except ClientError as exc:
            results[name] = exc.code

    threads = [threading.Thread(target=load, args=(n,)) for n in ("x", "y")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results.values()) == ["insufficient_memory", "loaded"], results

"""The runner's memory limits and guards (src/runner/guard.py).

The decisions are tested with numbers; the glue with real mlx in this
process (limits set, a real load stopped at a layer, a real request stopped
by a real hog) and once through a real runner process (exit status 73, the
exit audit, Pong figures).
"""

from __future__ import annotations

import gc
import importlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from ipc.messages import (
    EngineReport,
    EngineSettings,
    ExitAudit,
    Generate,
    GenerationDone,
    Heartbeat,
    LoadFailed,
    LoadModel,
    LoadProgress,
    MemoryPlan,
    Ping,
    Pong,
    Ready,
    SamplingParams,
    Shutdown,
    Started,
    TextChunk,
)
from runner import engine as engine_module
from runner import guard as guard_module
from runner.engine import Engine
from runner.faults import Faults
from runner.guard import (
    CACHE_FRACTION_OF_LIMIT,
    CHECK_EVERY_TOKENS,
    MemoryGuard,
    MemoryGuardError,
    MemorySample,
    MemoryView,
    assess,
    choose_memory_limits,
    describe_pressure,
    limit_floor_bytes,
    measure_memory,
    memory_view,
)
from runner.loading import LoadedModel, load_model
from test_runner_process import spawn_runner

MiB = 1 << 20
GiB = 1 << 30
PROMPT = "The quick brown fox"


def plan(**fields: Any) -> MemoryPlan:
    values: dict[str, Any] = {"total_bytes": 64 * GiB, "guard_bytes": 6 * GiB}
    values.update(fields)
    return MemoryPlan(**values)


# --- limits: the four candidates ----------------------------------------------------------


def test_smallest_valid_candidate_wins_and_every_candidate_is_reported() -> None:
    limits = choose_memory_limits(plan(), remaining_bytes=40 * GiB, max_recommended_bytes=48 * GiB)
    assert limits is not None
    by_name = {c.name: c.limit_bytes for c in limits.candidates}
    assert by_name == {
        "fraction_of_total": int(64 * GiB * 0.85),
        "total_minus_reserve": 58 * GiB,
        "max_recommended_working_set": 48 * GiB,
        "available_minus_margin": 34 * GiB,
    }
    assert limits.winner == "available_minus_margin"
    assert limits.memory_limit_bytes == 34 * GiB
    assert limits.cache_limit_bytes == int(34 * GiB * CACHE_FRACTION_OF_LIMIT)
    assert limits.wired_limit_bytes == 34 * GiB  # Metal: the limit, the plan names none


def test_candidates_at_or_below_the_floor_and_missing_ones_are_skipped() -> None:
    floor = limit_floor_bytes(64 * GiB)
    assert floor == 256 * MiB  # the reference's 2 GiB at 512 GiB, scaled
    assert limit_floor_bytes(1 * GiB) == 64 * MiB
    limits = choose_memory_limits(
        plan(), remaining_bytes=6 * GiB + floor, max_recommended_bytes=None
    )
    assert limits is not None
    by_name = {c.name: c for c in limits.candidates}
    assert not by_name["available_minus_margin"].valid  # exactly the floor: nonsense
    assert not by_name["max_recommended_working_set"].valid  # no Metal here
    assert by_name["max_recommended_working_set"].raw_bytes is None
    assert limits.winner == "fraction_of_total"
    assert limits.wired_limit_bytes is None  # no working set: the wired limit is left alone


def test_the_budget_caps_every_candidate_and_is_the_limit_when_none_is_valid() -> None:
    capped = choose_memory_limits(
        plan(budget_bytes=3 * GiB), remaining_bytes=40 * GiB, max_recommended_bytes=48 * GiB
    )
    assert capped is not None
    assert all(c.limit_bytes == 3 * GiB for c in capped.candidates)
    assert capped.memory_limit_bytes == 3 * GiB
    assert capped.winner == "fraction_of_total"  # the first of the equal smallest
    # A machine with nothing left: the adaptive candidate is nonsense, the budget holds.
    tiny = plan(total_bytes=64 * MiB, guard_bytes=0, budget_bytes=16 * MiB)
    fallback = choose_memory_limits(tiny, remaining_bytes=0, max_recommended_bytes=None)
    assert fallback is not None
    assert (fallback.winner, fallback.memory_limit_bytes) == ("budget", 16 * MiB)
    no_budget = plan(total_bytes=64 * MiB, guard_bytes=0)
    assert choose_memory_limits(no_budget, remaining_bytes=0, max_recommended_bytes=None) is None


def test_the_wired_limit_is_the_smallest_of_limit_plan_and_working_set() -> None:
    limits = choose_memory_limits(
        plan(wired_limit_bytes=20 * GiB), remaining_bytes=60 * GiB, max_recommended_bytes=48 * GiB
    )
    assert limits is not None
    assert (limits.winner, limits.memory_limit_bytes) == ("max_recommended_working_set", 48 * GiB)
    assert limits.wired_limit_bytes == 20 * GiB


# --- the view and the decisions ------------------------------------------------------------


def sample(**fields: int) -> MemorySample:
    values = {
        "rss_bytes": 1 * GiB,
        "active_bytes": 2 * GiB,
        "cache_bytes": 1 * GiB,
        "peak_bytes": 3 * GiB,
        "available_bytes": 40 * GiB,
        "total_bytes": 64 * GiB,
    }
    values.update(fields)
    return MemorySample(**values)


def test_footprint_is_rss_or_mlx_active_plus_cache_whichever_is_larger() -> None:
    assert sample().footprint_bytes == 3 * GiB
    assert sample(rss_bytes=5 * GiB).footprint_bytes == 5 * GiB


def test_remaining_under_an_override_counts_other_runners_and_this_one() -> None:
    real = memory_view(sample(), plan())
    assert (real.total_bytes, real.remaining_bytes) == (64 * GiB, 40 * GiB)
    assert real.pressure_pct == pytest.approx(37.5)
    small = plan(total_bytes=8 * GiB, override=True, others_bytes=2 * GiB)
    view = memory_view(sample(), small)
    assert view.remaining_bytes == 8 * GiB - 2 * GiB - 3 * GiB
    assert view.pressure_pct == pytest.approx(62.5)
    full = memory_view(sample(rss_bytes=9 * GiB), small)
    assert (full.remaining_bytes, full.pressure_pct) == (0, 100.0)
    # The real machine still bounds it: an override never invents memory.
    assert memory_view(sample(available_bytes=1 * GiB), small).remaining_bytes == 1 * GiB
    # No plan: the machine's own total.
    assert memory_view(sample(), None).total_bytes == 64 * GiB


def test_each_check_runs_only_when_its_number_is_set() -> None:
    view = MemoryView(total_bytes=64 * GiB, remaining_bytes=4 * GiB, footprint_bytes=10 * GiB)
    verdict = assess(view, plan(threshold_pct=90.0, budget_bytes=8 * GiB))
    assert (verdict.warn, verdict.low_memory, verdict.over_budget) == (True, True, True)
    assert verdict.critical
    calm = assess(view, plan(guard_bytes=0, threshold_pct=95.0))
    assert not calm.warn and not calm.critical  # guard 0, no budget: nothing to enforce
    budget_only = assess(view, plan(guard_bytes=0, budget_bytes=9 * GiB))
    assert budget_only.over_budget and not budget_only.low_memory
    assert not assess(view, None).critical  # no plan: guards off


def test_the_stop_detail_and_the_guard_error_name_the_numbers() -> None:
    view = MemoryView(
        total_bytes=64 * GiB, remaining_bytes=int(0.4 * GiB), footprint_bytes=int(3.1 * GiB)
    )
    detail = describe_pressure(
        view, plan(guard_bytes=1 * GiB, budget_bytes=int(2.5 * GiB)), "at token 48"
    )
    assert detail == (
        "memory pressure: 0.4 GiB left (guard 1.0 GiB), footprint 3.1 GiB over budget "
        "2.5 GiB; request stopped at token 48"
    )
    error = MemoryGuardError(
        layer=45,
        layers=182,
        remaining=int(3.2 * GiB),
        threshold=5 * GiB,
        footprint=int(508.8 * GiB),
        budget=None,
        total=512 * GiB,
    )
    assert str(error) == (
        "memory guard: remaining memory 3.2 GiB is below the safety threshold 5.0 GiB at layer "
        "45/182 (footprint 508.8 GiB, budget none, total 512.0 GiB)"
    )
    assert isinstance(error, RuntimeError)
    over = MemoryGuardError(
        layer=3,
        layers=9,
        remaining=30 * GiB,
        threshold=0,
        footprint=5 * GiB,
        budget=4 * GiB,
        total=64 * GiB,
    )
    assert over.reason.startswith("footprint 5.0 GiB is over the budget 4.0 GiB at layer 3/9")


# --- the glue, with real mlx ---------------------------------------------------------------


@pytest.fixture
def mlx_limits_restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Put MLX's limits and mlx-lm's wired-limit function back after a test."""
    for name in ("mlx_lm.utils", "mlx_lm.generate"):
        module = importlib.import_module(name)
        original = module.maybe_set_recommended_wired_limit
        monkeypatch.setattr(module, "maybe_set_recommended_wired_limit", original)
    memory_limit = mx.get_memory_limit()
    cache_limit = mx.set_cache_limit(0)
    mx.set_cache_limit(cache_limit)
    yield
    mx.set_memory_limit(memory_limit)
    mx.set_cache_limit(cache_limit)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("builtin:tiny", lambda phase, done, total: None)


def room_plan(extra_bytes: int, **fields: Any) -> MemoryPlan:
    """A plan for the real machine whose budget is what we hold now plus ``extra_bytes``.

    MLX's buffer cache is emptied first: buffers earlier tests left there
    (they share this process) would be reused by the next allocations, which
    would then not grow the footprint the budget is measured against."""
    gc.collect()
    mx.clear_cache()
    now = measure_memory()
    return MemoryPlan(
        total_bytes=now.total_bytes, budget_bytes=now.footprint_bytes + extra_bytes, **fields
    )


def generate(
    model: LoadedModel,
    guard: MemoryGuard,
    *,
    faults: str = "",
    max_tokens: int = 64,
    cap: int | None = None,
    sent: list[Any] | None = None,
) -> GenerationDone:
    """One request through an in-process engine (no prefix cache), to its end."""
    frames: list[Any] = sent if sent is not None else []
    engine = Engine(
        model.model,
        model.tokenizer,
        EngineSettings(prefix_cache=False),
        guard=guard,
        faults=Faults(faults),
        send=frames.append,
        is_cancelled=lambda request_id: False,
        on_finished=lambda request_id, tokens: None,
        max_tokens_cap=cap,
    )
    engine.submit(Generate(1, prompt=PROMPT, sampling=SamplingParams(max_tokens=max_tokens)))
    while not engine.idle:
        engine.step()
    return next(f for f in frames if isinstance(f, GenerationDone))


@pytest.mark.usefixtures("mlx_limits_restored")
def test_limits_are_set_and_mlx_lm_no_longer_raises_the_wired_limit() -> None:
    guard = MemoryGuard(room_plan(256 * MiB, guard_bytes=64 * MiB))
    limits = guard.apply_limits()
    assert limits is not None
    assert limits.memory_limit_bytes == guard.plan.budget_bytes  # type: ignore[union-attr]
    assert mx.get_memory_limit() == limits.memory_limit_bytes
    assert mx.set_cache_limit(limits.cache_limit_bytes) == limits.cache_limit_bytes
    assert limits.wired_limit_bytes is None  # the CPU backend has no working set
    for name in ("mlx_lm.utils", "mlx_lm.generate"):
        replaced = importlib.import_module(name).maybe_set_recommended_wired_limit
        assert replaced.__module__ == "runner.guard"
        assert replaced() is None  # so mlx-lm's wired_limit() changes nothing


def test_load_guard_stops_a_load_at_the_first_layer_when_memory_is_short() -> None:
    seen: list[tuple[str, int, int, int | None]] = []
    total = measure_memory().total_bytes
    guard = MemoryGuard(MemoryPlan(total_bytes=total, guard_bytes=total))  # can never be met

    def progress(phase: str, done: int, layers: int) -> None:
        remaining = guard.last_view.remaining_bytes if guard.last_view else None
        seen.append((phase, done, layers, remaining if phase == "weights" else None))

    with pytest.raises(MemoryGuardError) as stopped:
        load_model("builtin:tiny", progress, guard)
    error = stopped.value
    assert (error.layer, error.threshold) == (1, total)
    assert error.layers > 1 and 0 < error.remaining < total
    assert str(error).startswith("memory guard: remaining memory ")
    assert f"at layer 1/{error.layers}" in str(error)
    # The layer's progress went out first, with the guard's view of what was left.
    assert seen[-1] == ("weights", 1, error.layers, error.remaining)


def test_load_guard_stops_a_load_over_its_budget() -> None:
    total = measure_memory().total_bytes
    guard = MemoryGuard(MemoryPlan(total_bytes=total, budget_bytes=MiB))  # below what we hold
    with pytest.raises(MemoryGuardError, match=r"over the budget .* at layer 1/"):
        load_model("builtin:tiny", lambda phase, done, total: None, guard)


def test_load_with_room_passes_every_layer(tiny: LoadedModel) -> None:
    guard = MemoryGuard(room_plan(512 * MiB, guard_bytes=64 * MiB))
    loaded = load_model("builtin:tiny", lambda phase, done, total: None, guard)
    assert loaded.param_bytes == tiny.param_bytes
    assert guard.figures.active_bytes > 0 and guard.last_view is not None


@pytest.mark.parametrize("full_every_s", [0.0, 3600.0], ids=["measured", "estimated"])
def test_runaway_request_is_stopped_with_the_numbers_and_the_next_one_is_served(
    tiny: LoadedModel, full_every_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every check measured in full, or none after the prefill's: MLX's own
    counters show the hog at the first check after it either way."""
    monkeypatch.setattr(guard_module, "FULL_MEASURE_INTERVAL_S", full_every_s)
    guard = MemoryGuard(room_plan(128 * MiB))
    done = generate(tiny, guard, faults="hog_at_token=5:512", max_tokens=64)
    assert done.finish_reason == "memory_pressure", done
    assert done.generation_tokens == CHECK_EVERY_TOKENS  # the first check after the hog
    assert done.detail is not None
    assert "over budget" in done.detail and done.detail.endswith("request stopped at token 16")
    assert done.peak_memory_bytes >= 512 * MiB
    again = generate(tiny, guard, max_tokens=40)  # the hog went with its request
    assert (again.finish_reason, again.generation_tokens, again.detail) == ("length", 40, None)


def test_the_estimate_carries_the_last_view_forward_by_mlx_growth(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    measured: list[MemorySample] = []

    def measure() -> MemorySample:
        measured.append(measure_memory())
        return measured[-1]

    monkeypatch.setattr(guard_module, "FULL_MEASURE_INTERVAL_S", 3600.0)
    guard = MemoryGuard(room_plan(1 * GiB), measure=measure)
    assert guard.estimate() is None  # nothing measured yet
    view = guard.refresh()
    held = mx.ones((64 * MiB,), dtype=mx.uint8)
    mx.eval(held)
    estimate = guard.estimate()
    assert estimate is not None and len(measured) == 1
    assert estimate.footprint_bytes >= view.footprint_bytes + 64 * MiB
    assert estimate.remaining_bytes <= view.remaining_bytes - 64 * MiB
    assert estimate.total_bytes == view.total_bytes
    monkeypatch.setattr(guard_module, "FULL_MEASURE_INTERVAL_S", 0.0)
    assert guard.estimate() is None  # stale: the next check measures
    del held


def test_checks_between_full_measurements_read_only_mlx(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """64 tokens, checks at 16, 32 and 48 (64 ends the request): each is a
    full measurement when the interval is 0, none when it is long."""
    monkeypatch.setattr(engine_module, "HEARTBEAT_INTERVAL_S", 3600.0)  # heartbeats measure too
    counts = {}
    for full_every_s in (0.0, 3600.0):
        monkeypatch.setattr(guard_module, "FULL_MEASURE_INTERVAL_S", full_every_s)
        calls = [0]

        def measure(calls: list[int] = calls) -> MemorySample:
            calls[0] += 1
            return measure_memory()

        guard = MemoryGuard(room_plan(512 * MiB), measure=measure)
        done = generate(tiny, guard, max_tokens=64)
        assert (done.finish_reason, done.generation_tokens) == ("length", 64)
        counts[full_every_s] = calls[0]
    assert counts[0.0] - counts[3600.0] == 3, counts


EMERGENCY_SCENARIO = """
import json, sys
sys.path.insert(0, sys.argv[1])
import mlx.core as mx
import test_runner_guard as t
tiny = t.load_model("builtin:tiny", lambda *a: None)
held = [mx.ones((256 * t.MiB,), dtype=mx.uint8)]  # what a cache would hold
mx.eval(held[0])
guard = t.MemoryGuard(t.room_plan(-64 * t.MiB))  # over budget with it, within without
calls = []
def evict():
    calls.append("evict")
    held.clear()
guard.add_cleanup_hook(evict)
done = t.generate(tiny, guard, max_tokens=40)
print(json.dumps({"calls": calls, "finish": done.finish_reason, "tokens": done.generation_tokens}))
"""


def test_emergency_cleanup_runs_the_hooks_first_and_the_request_carries_on() -> None:
    """In a process of its own: the footprint follows RSS, and what earlier tests
    leave in a shared process (heap the allocator keeps) can hide both the
    allocation and its release."""
    tests_dir = str(Path(__file__).parent)
    ran = subprocess.run([sys.executable, "-c", EMERGENCY_SCENARIO, tests_dir],
                         capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    result = json.loads(ran.stdout.strip().splitlines()[-1])
    assert result == {"calls": ["evict"], "finish": "length", "tokens": 40}


def test_requests_over_the_token_cap_are_clamped_and_told(tiny: LoadedModel) -> None:
    guard = MemoryGuard()
    over = generate(tiny, guard, max_tokens=500, cap=12)
    assert (over.generation_tokens, over.max_tokens_clamped_to) == (12, 12)
    under = generate(tiny, guard, max_tokens=5, cap=12)
    assert (under.generation_tokens, under.max_tokens_clamped_to) == (5, None)


def test_heartbeats_carry_memory_figures(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_module, "HEARTBEAT_INTERVAL_S", 0.0)
    sent: list[Any] = []
    generate(tiny, MemoryGuard(), max_tokens=20, sent=sent)
    beats = [m for m in sent if isinstance(m, Heartbeat)]
    assert {b.phase for b in beats} == {"prefill", "decode"}
    assert all(b.memory is not None and b.memory.active_bytes > 0 for b in beats)
    chunks = [m for m in sent if isinstance(m, TextChunk)]
    assert chunks and chunks[-1].generation_tokens == 20


# --- through a real runner process -----------------------------------------------------------


def test_runner_stopped_by_its_load_guard_exits_73_with_a_memory_guard_audit() -> None:
    proc, channel = spawn_runner()
    try:
        assert isinstance(channel.recv(), Started)
        total = measure_memory().total_bytes
        channel.send(
            LoadModel(
                "tiny", "builtin:tiny", memory=MemoryPlan(total_bytes=total, guard_bytes=total)
            )
        )
        events = [channel.recv()]
        while not isinstance(events[-1], ExitAudit):
            events.append(channel.recv())
        failed = next(e for e in events if isinstance(e, LoadFailed))
        assert failed.error.startswith("memory guard: remaining memory")
        assert "at layer 1/" in failed.error
        weights = [e for e in events if isinstance(e, LoadProgress) and e.phase == "weights"]
        assert weights and weights[-1].remaining_bytes is not None
        audit = events[-1]
        assert isinstance(audit, ExitAudit)
        assert audit.cause_class == "memory_guard"
        assert audit.cause.startswith("memory_guard: remaining memory")
        assert (audit.tokens_served, audit.requests_served) == (0, 0)
        assert proc.wait(timeout=10) == 73
    finally:
        channel.close()
        proc.kill()
        proc.wait()


def test_pongs_carry_the_latest_figures_and_the_audit_counts_what_was_served() -> None:
    proc, channel = spawn_runner()
    try:
        assert isinstance(channel.recv(), Started)
        channel.send(Ping(1))
        before = channel.recv()
        # No model yet: only what setting the device up left (bytes, on the CPU).
        assert isinstance(before, Pong) and before.memory.active_bytes < 1 << 20
        channel.send(LoadModel("tiny", "builtin:tiny", max_tokens_cap=8))
        while not isinstance(event := channel.recv(), Ready):
            assert isinstance(event, LoadProgress), event
        channel.send(Ping(2))
        pong = channel.recv()
        assert isinstance(pong, Pong) and pong.seq == 2
        assert pong.memory.active_bytes >= event.param_bytes
        for request_id in (1, 2):
            channel.send(
                Generate(request_id, prompt=PROMPT, sampling=SamplingParams(max_tokens=100))
            )
            while not isinstance(done := channel.recv(), GenerationDone):
                pass
            assert done.max_tokens_clamped_to == 8
        channel.send(Shutdown("test"))
        while not isinstance(audit := channel.recv(), ExitAudit):
            assert isinstance(audit, EngineReport), audit
        assert (audit.tokens_served, audit.requests_served) == (16, 2)
        assert audit.peak_bytes >= event.param_bytes and audit.cause_class is None
        assert proc.wait(timeout=10) == 0
    finally:
        channel.close()
        proc.kill()
        proc.wait()

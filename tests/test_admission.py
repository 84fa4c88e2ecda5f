"""Admission's rule as pure arithmetic: what fits, and what would fit with the idle models gone.

The daemon-level behaviour (real runners under ``memory_override_mb``) is in test_memory.py;
these pin the numbers the refusal before any eviction is decided on.
"""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.memory.admission import has_room, less_committed, with_unloaded
from supervisor.memory.monitor import MemorySnapshot

MiB = 1 << 20


@dataclass
class Model:
    """A loaded model as admission sees one (the registry's entries have these properties)."""

    name: str
    footprint_bytes: int
    budget_bytes: int | None
    evictable: bool = True
    holds_runner: bool = True
    last_used: float = 0.0
    wired_limit_bytes: int | None = None


def snapshot(total_mb: int, available_mb: int, threshold_pct: float = 100.0) -> MemorySnapshot:
    return MemorySnapshot(
        total_bytes=total_mb * MiB,
        available_bytes=available_mb * MiB,
        real_total_bytes=total_mb * MiB,
        real_available_bytes=available_mb * MiB,
        override_mb=total_mb,
        threshold_pct=threshold_pct,
        runners_bytes=(total_mb - available_mb) * MiB,
        taken_at=0.0,
    )


def test_grants_not_in_use_count_as_taken() -> None:
    now = snapshot(1000, 300)
    idle = Model("idle", 200 * MiB, 250 * MiB)
    busy = Model("busy", 100 * MiB, 300 * MiB, evictable=False)
    assert less_committed(now, [idle, busy]).available_bytes == (300 - 50 - 200) * MiB
    assert has_room(now, [idle, busy], 50 * MiB, 0)
    assert not has_room(now, [idle, busy], 51 * MiB, 0)
    assert not has_room(now, [idle, busy], 40 * MiB, 20 * MiB)  # the guard's share stays free


def test_unloading_idle_models_gives_back_their_footprint_and_their_grant() -> None:
    now = snapshot(1000, 300)
    idle = Model("idle", 200 * MiB, 250 * MiB)
    busy = Model("busy", 100 * MiB, 300 * MiB, evictable=False)

    after, remaining = with_unloaded(now, [idle, busy], [idle])

    assert after.available_bytes == 500 * MiB
    assert after.runners_bytes == 500 * MiB
    assert remaining == [busy]
    # 250 MiB more than now: its 200 MiB footprint and its 50 MiB grant above it.
    assert less_committed(after, remaining).available_bytes == 300 * MiB
    assert has_room(after, remaining, 300 * MiB, 0)
    assert not has_room(after, remaining, 301 * MiB, 0)


def test_what_comes_back_never_exceeds_the_machine_and_the_threshold_still_holds() -> None:
    now = snapshot(1000, 900, threshold_pct=70.0)
    idle = Model("idle", 400 * MiB, None)

    after, remaining = with_unloaded(now, [idle], [idle])

    assert after.available_bytes == 1000 * MiB
    assert remaining == []
    assert has_room(after, remaining, 700 * MiB, 0)
    assert not has_room(after, remaining, 701 * MiB, 0)  # past the 70% threshold


def test_a_model_without_a_runner_gives_nothing_back() -> None:
    now = snapshot(1000, 300)
    gone = Model("gone", 0, None, holds_runner=False)
    after, _ = with_unloaded(now, [gone], [gone])
    assert after.available_bytes == now.available_bytes

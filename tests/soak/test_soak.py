"""The crash-recovery soak, short version (SOAK_DURATION_S, default 15 s: long
enough for the RSS check's samples after warm-up, about 40 s in all)."""

from __future__ import annotations

import os

import pytest
from soak_run import report, run_soak

DURATION_S = float(os.environ.get("SOAK_DURATION_S", "15"))


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(DURATION_S + 300)
def test_runners_killed_at_random_under_load_nothing_hangs_leaks_or_is_lost() -> None:
    result = run_soak(DURATION_S, seed=1234)
    print(report(result))
    failed = {k: d for k, (ok, d) in result.invariants.items() if not ok}
    assert not failed, failed
    # The growth check compared RSS after warm-up with RSS at the end: it had the samples.
    assert len(result.samples) >= 10, f"{len(result.samples)} samples: no RSS check"
    assert len(result.kills) >= DURATION_S / 5, "the chaos loop barely ran"
    assert result.requests["completed"] > 0
    assert result.counters.get("restarts", 0) > 0
    # Detection is event-driven: generous bounds that only catch a slow poll or a hang.
    assert sorted(result.detection_ms)[len(result.detection_ms) // 2] < 500

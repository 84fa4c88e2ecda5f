"""The restart policy on its own: strategy, intensity, backoff, window reset."""

from __future__ import annotations

from ipc.messages import ExitInfo
from supervisor.registry.restart import RestartIntensity, RestartTracker

KILLED = ExitInfo(code=None, signal="SIGKILL", cause="killed by SIGKILL")
CLEAN = ExitInfo(code=0, signal=None, cause="exit 0")
INTENSITY = RestartIntensity(max_restarts=4, window_s=60, backoff_s=0.5, backoff_cap_s=1.5)


def test_first_restart_is_immediate_then_backoff_doubles_then_budget_is_spent() -> None:
    tracker = RestartTracker("always", INTENSITY)
    delays = [tracker.decide(KILLED, now=t).delay_s for t in (0.0, 1.0, 2.0, 3.0)]
    assert delays == [0.0, 0.5, 1.0, 1.5]  # capped
    final = tracker.decide(KILLED, now=4.0)
    assert final.delay_s is None and final.budget_spent
    assert "4 restarts within 60s" in final.reason and "SIGKILL" in final.reason


def test_budget_comes_back_after_a_quiet_window() -> None:
    tracker = RestartTracker("always", INTENSITY)
    for t in (0.0, 1.0, 2.0, 3.0):
        tracker.decide(KILLED, now=t)
    assert tracker.decide(KILLED, now=30.0).delay_s is None
    # 60 s after the last restart the window is empty: a fresh budget, no backoff.
    assert tracker.recent(63.1) == 0
    assert tracker.decide(KILLED, now=63.1).delay_s == 0.0


def test_strategies() -> None:
    assert RestartTracker("never", INTENSITY).decide(KILLED, 0).delay_s is None
    assert RestartTracker("on-failure", INTENSITY).decide(CLEAN, 0).delay_s is None
    assert RestartTracker("on-failure", INTENSITY).decide(KILLED, 0).delay_s == 0.0
    assert RestartTracker("always", INTENSITY).decide(CLEAN, 0).delay_s == 0.0
    code_1 = ExitInfo(code=1, signal=None, cause="exit 1")
    assert RestartTracker("on-failure", INTENSITY).decide(code_1, 0).delay_s == 0.0

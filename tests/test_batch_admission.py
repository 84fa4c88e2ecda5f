"""The admission timer alone: how long requests on an idle engine wait for
company, and what it learns that from, on a clock the test moves.

The engine's own tests (tests/test_engine.py) drive the same rules through
real requests on a real model; here each rule is pinned to its numbers.
"""

from __future__ import annotations

import pytest

from runner.batch_admission import (
    ADMISSION_CAP_S,
    ADMISSION_FIRST_S,
    BURST_DECAY,
    PREFILL_RATE_WEIGHT,
    AdmissionTimer,
)

SHARE = 0.02  # the daemon's default batch_wait_share
T0 = 1000.0  # the first request's arrival in each test


class Clock:
    """A clock that moves only when the test says."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def tokens_for(expected_s: float, rate: float = 100.0) -> float:
    """Prompt tokens that prefill in ``expected_s`` at ``rate`` tokens/s."""
    return expected_s * rate


def measured(clock: Clock | None = None, rate: float = 100.0) -> AdmissionTimer:
    """A timer that has timed one prefill, at ``rate`` tokens/s."""
    timer = AdmissionTimer(SHARE, clock or Clock())
    timer.record_prefill(100, 100 / rate)
    return timer


def lone_wait(timer: AdmissionTimer, expected_s: float = 0.04) -> float:
    """The wait of a request that arrives now, expected to prefill in ``expected_s``."""
    now = timer.clock()
    return timer.wait_s(now, lambda: tokens_for(expected_s), now)


def learn_burst(timer: AdmissionTimer, spread: float, first: float = T0) -> None:
    """A lone request started from idle after a wait, and one sent with it
    came ``spread`` after it."""
    timer.on_start(first, started=1, waited=True)
    timer.on_late_arrival(first + spread)


# --- whether to wait at all ---------------------------------------------------------


def test_only_requests_that_would_share_a_batch_wait_for_company() -> None:
    timer = AdmissionTimer(SHARE)
    assert timer.waits_for_company(1, 8, batchable=True)
    assert timer.waits_for_company(7, 8, batchable=True)
    assert not timer.waits_for_company(0, 8, batchable=True)  # nobody waits
    assert not timer.waits_for_company(8, 8, batchable=True)  # a full batch starts at once
    assert not timer.waits_for_company(1, 1, batchable=True)  # a batch of one is full
    assert not timer.waits_for_company(2, 8, batchable=False)  # one runs alone: nobody joins
    assert not AdmissionTimer(0.0).waits_for_company(1, 8, batchable=True)  # told not to


# --- the first prefill --------------------------------------------------------------


def test_before_the_first_prefill_requests_wait_the_first_wait_from_the_first_arrival() -> None:
    clock = Clock()
    timer = AdmissionTimer(SHARE, clock)
    asked: list[int] = []

    def tokens() -> float:
        asked.append(1)
        return 1e6  # a prefill of minutes, were the rate known

    assert timer.wait_s(T0, tokens) == ADMISSION_FIRST_S
    clock.now = T0 + 0.004
    assert timer.wait_s(T0, tokens) == pytest.approx(ADMISSION_FIRST_S - 0.004)
    clock.now = T0 + 1.0
    assert timer.wait_s(T0, tokens) == 0.0  # never less than nothing
    assert asked == []  # the tokens are not counted while there is no rate to divide them by


def test_a_prefill_too_short_to_time_spends_the_first_wait_and_gives_no_rate() -> None:
    timer = AdmissionTimer(SHARE, Clock())
    timer.record_prefill(7, 0.5)  # too few tokens to time
    assert timer.prefill_tps is None
    assert lone_wait(timer) == 0.0  # not the first wait again: no burst learned, no wait
    zero = AdmissionTimer(SHARE, Clock())
    zero.record_prefill(100, 0.0)  # no time measured
    assert zero.prefill_tps is None and lone_wait(zero) == 0.0


def test_without_a_rate_a_learned_burst_is_waited_within_the_first_wait() -> None:
    timer = AdmissionTimer(SHARE, Clock())
    timer.record_prefill(1, 0.001)
    learn_burst(timer, 0.004)
    assert lone_wait(timer) == pytest.approx(0.004)
    wide = AdmissionTimer(SHARE, Clock())
    wide.record_prefill(1, 0.001)
    learn_burst(wide, 0.03)
    assert lone_wait(wide) == pytest.approx(ADMISSION_FIRST_S)


# --- the share of the expected prefill ----------------------------------------------


def test_the_prefill_rate_is_a_running_estimate_weighted_to_the_newest() -> None:
    timer = AdmissionTimer(SHARE)
    assert timer.prefill_tps is None
    timer.record_prefill(100, 1.0)
    assert timer.prefill_tps == 100.0  # the first rate as it is
    timer.record_prefill(200, 1.0)
    assert timer.prefill_tps == pytest.approx(100.0 + PREFILL_RATE_WEIGHT * (200.0 - 100.0))
    timer.record_prefill(7, 0.001)  # too short to time: the estimate stays
    assert timer.prefill_tps == pytest.approx(130.0)


def test_requests_wait_a_share_of_the_prefill_they_all_expect_up_to_the_cap() -> None:
    clock = Clock()
    timer = measured(clock, rate=100.0)
    assert timer.wait_s(T0, lambda: 100) == pytest.approx(SHARE * 1.0)  # 1 s of prefill
    assert timer.wait_s(T0, lambda: 200) == pytest.approx(SHARE * 2.0)  # one more to share
    assert timer.wait_s(T0, lambda: 1000) == ADMISSION_CAP_S  # 10 s of prefill: the cap
    clock.now = T0 + 0.015
    assert timer.wait_s(T0, lambda: 100) == pytest.approx(0.005)  # counted from the first
    assert timer.wait_s(T0, lambda: 100, now=T0) == pytest.approx(SHARE * 1.0)  # or from `now`


# --- the burst spread ---------------------------------------------------------------


def test_a_request_just_too_late_for_its_company_sets_the_burst_spread() -> None:
    timer = measured()
    assert timer.burst_s == 0.0
    learn_burst(timer, 0.006)
    assert timer.burst_s == pytest.approx(0.006)
    timer.on_late_arrival(T0 + 0.004)  # a sooner latecomer: the widest spread stays
    assert timer.burst_s == pytest.approx(0.006)
    # The next start waits for it (2% of 40 ms alone would be 0.8 ms).
    assert lone_wait(timer, expected_s=0.04) == pytest.approx(0.006)


def test_the_burst_wait_is_never_longer_than_the_prefill_expected() -> None:
    timer = measured()
    learn_burst(timer, 0.006)
    assert lone_wait(timer, expected_s=0.002) == pytest.approx(0.002)
    # and never over the cap, however slow the prefill
    assert lone_wait(timer, expected_s=100.0) == ADMISSION_CAP_S


def test_only_a_request_within_the_cap_of_the_first_arrival_is_late_for_it() -> None:
    timer = measured()
    timer.on_start(T0, started=1, waited=True)
    timer.on_late_arrival(T0 + ADMISSION_CAP_S + 0.01)  # another user, later
    timer.on_late_arrival(T0 - 0.001)  # arrived before the first: not late for it
    assert timer.burst_s == 0.0
    timer.on_late_arrival(T0 + ADMISSION_CAP_S)  # the longest spread that counts
    assert timer.burst_s == pytest.approx(ADMISSION_CAP_S)
    assert lone_wait(timer, expected_s=1.0) == pytest.approx(ADMISSION_CAP_S)


def test_lone_starts_that_nobody_comes_late_for_unlearn_the_spread_by_halves() -> None:
    timer = measured()
    learn_burst(timer, 0.008)
    assert lone_wait(timer) == pytest.approx(0.008)  # someone came late: not halved
    timer.on_start(T0 + 1, started=1, waited=True)  # lone, and nobody comes late
    assert lone_wait(timer) == pytest.approx(0.008 * BURST_DECAY)
    assert timer.burst_s == pytest.approx(0.008)  # halved once the start is over
    timer.on_start(T0 + 2, started=1, waited=True)
    assert timer.burst_s == pytest.approx(0.008 * BURST_DECAY)
    assert lone_wait(timer) == pytest.approx(0.008 * BURST_DECAY**2)


def test_a_burst_the_wait_caught_whole_keeps_the_spread() -> None:
    timer = measured()
    learn_burst(timer, 0.006)
    for burst in range(3):
        timer.on_start(T0 + 1 + burst, started=3, waited=True)  # all three caught
        assert timer.burst_s == pytest.approx(0.006)
        assert lone_wait(timer) == pytest.approx(0.006)


def test_a_start_that_did_not_wait_for_company_teaches_nothing() -> None:
    timer = measured()
    learn_burst(timer, 0.006)
    timer.on_start(T0 + 1, started=1, waited=False)  # e.g. a seeded request was in line
    timer.on_late_arrival(T0 + 1.002)  # not late for a start that did not wait
    assert timer.burst_s == pytest.approx(0.006)
    assert lone_wait(timer) == pytest.approx(0.006)  # and no lone start to halve it
    timer.on_start(T0 + 2, started=0, waited=True)  # only a request that runs alone started
    timer.on_late_arrival(T0 + 2.004)
    assert timer.burst_s == pytest.approx(0.006)
    assert lone_wait(timer) == pytest.approx(0.006)


def test_without_a_burst_the_wait_is_the_share_of_the_prefill() -> None:
    timer = measured()
    timer.on_start(T0, started=1, waited=True)
    assert lone_wait(timer, expected_s=0.04) == pytest.approx(SHARE * 0.04)

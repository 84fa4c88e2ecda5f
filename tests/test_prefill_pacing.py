"""The prefill pacer alone: how many prompt tokens a step takes, from the rate measured."""

from __future__ import annotations

import pytest

from runner.prefill_pacing import (
    FIRST_STEP_TOKENS,
    MAX_STEP_TOKENS,
    MIN_STEP_TOKENS,
    PrefillPacer,
)


def test_the_first_step_is_small_and_its_time_unknown() -> None:
    pacer = PrefillPacer(target_s=1.0)
    assert pacer.step_tokens() == FIRST_STEP_TOKENS
    assert pacer.expected_s(FIRST_STEP_TOKENS) is None


def test_steps_follow_the_measured_rate_to_the_target_time() -> None:
    pacer = PrefillPacer(target_s=1.5)
    pacer.record(32, 2.0)  # 16 tokens/s: a big model on a CPU
    assert pacer.step_tokens() == 24
    assert pacer.expected_s(24) == pytest.approx(1.5)


def test_a_fast_model_takes_mlx_lms_whole_step_and_a_slow_one_the_floor() -> None:
    fast = PrefillPacer(target_s=1.0)
    fast.record(32, 0.004)  # 8,000 tokens/s
    assert fast.step_tokens() == MAX_STEP_TOKENS
    slow = PrefillPacer(target_s=1.0)
    slow.record(32, 64.0)  # half a token a second
    assert slow.step_tokens() == MIN_STEP_TOKENS


def test_a_batch_shares_the_step_among_its_prompts() -> None:
    pacer = PrefillPacer(target_s=1.0)
    pacer.record(400, 1.0)
    assert pacer.step_tokens(sequences=4) == 100
    assert pacer.step_tokens(target_s=0.05) == 20  # a step that must give way soon


def test_the_rate_follows_a_slowing_prefill_within_a_few_steps() -> None:
    pacer = PrefillPacer(target_s=1.0)
    pacer.record(100, 1.0)
    for _ in range(4):  # the context grows: attention makes each token dearer
        pacer.record(pacer.step_tokens(), pacer.step_tokens() / 50)
    assert pacer.rate_tps == pytest.approx(50, rel=0.1)


def test_steps_too_short_to_time_are_added_up_and_the_first_step_grows_meanwhile() -> None:
    # A fast model: 32 tokens in 0.5 ms, too short to time alone. The next
    # step is twice as long, and the two together are timed.
    pacer = PrefillPacer(target_s=1.0)
    pacer.record(FIRST_STEP_TOKENS, 0.0005)
    assert pacer.rate_tps is None
    assert pacer.step_tokens() == 2 * FIRST_STEP_TOKENS
    pacer.record(2 * FIRST_STEP_TOKENS, 0.001)
    assert pacer.rate_tps is None
    pacer.record(4 * FIRST_STEP_TOKENS, 0.002)
    assert pacer.rate_tps == pytest.approx(7 * FIRST_STEP_TOKENS / 0.0035)
    assert pacer.step_tokens() == MAX_STEP_TOKENS
    pacer.record(0, 1.0)  # nothing computed: nothing learned
    assert pacer.rate_tps == pytest.approx(7 * FIRST_STEP_TOKENS / 0.0035)

"""How many prompt tokens a prefill step computes: about ``target_s`` of work.

mlx-lm prefills in steps of 2,048 tokens. On a big model, or any model on a
CPU, one such step can run for minutes without a word to the supervisor,
which then takes the runner for a hung one; a Cancel waits for it, other
requests in the batch wait for it, and on a Mac one Metal command stream
that runs for seconds is killed by the GPU's watchdog
(``kIOGPUCommandBufferCallbackErrorTimeout``). So the engine asks the pacer
how many tokens to compute next: the rate measured on this model so far
times the target time, between a floor and mlx-lm's step. Before anything
is measured it starts small and doubles the step until one is long enough
to time (on a fast model a first step takes microseconds).

A pure object, fed measurements: testable without mlx.
"""

from __future__ import annotations

__all__ = ["PrefillPacer"]

MAX_STEP_TOKENS = 2048
"""mlx-lm's default prefill step: a step never computes more than this."""
FIRST_STEP_TOKENS = 32
"""Before the rate is known: small, so that even a very slow model reports
soon, and its rate is learned from it."""
MIN_STEP_TOKENS = 8
"""However slow the model: a step smaller than this wastes more on its own
overhead than it gains in reporting."""
RATE_WEIGHT = 0.5
"""The newest step's share in the running rate: the rate falls as the
context grows (attention), and follows it within a step or two."""
MIN_TIMED_S = 0.002
"""Less work than this is not timed alone (the clock's noise dominates):
short steps are added up until they reach it."""


class PrefillPacer:
    """Sizes prefill steps from the rate measured on this model.

    Args:
        target_s: how long one step should take.
        max_tokens: the most tokens one step computes.
    """

    def __init__(self, target_s: float, max_tokens: int = MAX_STEP_TOKENS) -> None:
        self.target_s = target_s
        self.max_tokens = max_tokens
        self.rate_tps: float | None = None  # prompt tokens per second, a running estimate
        self._first_tokens = min(FIRST_STEP_TOKENS, max_tokens)  # doubles until timed
        self._untimed = (0, 0.0)  # tokens and seconds of steps too short to time alone

    def step_tokens(self, sequences: int = 1, target_s: float | None = None) -> int:
        """Tokens of each of ``sequences`` prompts to compute in the next step
        (a batch computes them side by side, so each gets a share), to take
        about ``target_s`` (default: the pacer's target)."""
        target_s = self.target_s if target_s is None else target_s
        if self.rate_tps is None:
            return self._first_tokens
        share = self.rate_tps * target_s / max(sequences, 1)
        return max(MIN_STEP_TOKENS, min(int(share), self.max_tokens))

    def expected_s(self, tokens: int) -> float | None:
        """How long computing ``tokens`` prompt tokens should take (None: not
        known yet)."""
        if self.rate_tps is None:
            return None
        return tokens / self.rate_tps

    def record(self, tokens: int, elapsed_s: float) -> None:
        """A step computed ``tokens`` prompt tokens in ``elapsed_s``."""
        if tokens <= 0:
            return
        tokens += self._untimed[0]
        elapsed_s += self._untimed[1]
        if elapsed_s < MIN_TIMED_S:
            self._untimed = (tokens, elapsed_s)
            self._first_tokens = min(self._first_tokens * 2, self.max_tokens)
            return
        self._untimed = (0, 0.0)
        rate = tokens / elapsed_s
        old = self.rate_tps
        self.rate_tps = rate if old is None else old + RATE_WEIGHT * (rate - old)

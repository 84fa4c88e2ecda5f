"""The restart policy: when a runner that died on its own is started again.

OTP vocabulary: each model is a child with a *restart strategy*
(``always``, ``on-failure``, ``never``) and a *restart intensity*: at most
``max_restarts`` restarts within ``restart_window_s``; one more and the model
is ``failed`` until an explicit load. The window slides, so a runner that
stays up for a whole window has its budget back (exo's never resets).
The first restart in a window is immediate (as in OTP); each further one
waits ``restart_backoff_s``, doubling up to a cap, so a crash loop backs off
(:class:`~supervisor.waiting.Backoff`, as the hot spare's retries).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ipc.messages import ExitInfo, RestartStrategy
from supervisor.waiting import Backoff


@dataclass(frozen=True)
class RestartIntensity:
    """Limits on restarts; see the module docstring."""

    max_restarts: int = 5
    window_s: float = 60.0
    backoff_s: float = 0.5
    backoff_cap_s: float = 30.0

    @property
    def backoff(self) -> Backoff:
        return Backoff(self.backoff_s, self.backoff_cap_s)


def is_failure(exit: ExitInfo) -> bool:
    """A signal or a non-zero exit code."""
    return exit.signal is not None or exit.code != 0


@dataclass(frozen=True)
class RestartDecision:
    """``delay_s`` is None when the runner must not be restarted; ``reason``
    says why, and ``budget_spent`` whether the restart intensity was reached."""

    delay_s: float | None
    reason: str
    budget_spent: bool = False


class RestartTracker:
    """Remembers recent restarts of one model and decides on the next.

    Args:
        strategy: the model's restart strategy.
        intensity: the budget and backoff.
    """

    def __init__(self, strategy: RestartStrategy, intensity: RestartIntensity) -> None:
        self.strategy = strategy
        self.intensity = intensity
        self._recent: deque[float] = deque()

    def recent(self, now: float) -> int:
        """Restarts within the window ending at ``now``."""
        window_start = now - self.intensity.window_s
        while self._recent and self._recent[0] <= window_start:
            self._recent.popleft()
        return len(self._recent)

    def decide(self, exit: ExitInfo, now: float) -> RestartDecision:
        """Whether and when to restart after ``exit``; records the restart if so.

        ``now`` is a monotonic time in seconds.
        """
        if self.strategy == "never":
            return RestartDecision(None, "restart strategy is never")
        if self.strategy == "on-failure" and not is_failure(exit):
            return RestartDecision(None, "exited cleanly and the strategy is on-failure")
        count = self.recent(now)
        if count >= self.intensity.max_restarts:
            return RestartDecision(
                None,
                f"restart intensity reached: {count} restarts within "
                f"{self.intensity.window_s:g}s (last: {exit.cause})",
                budget_spent=True,
            )
        delay = 0.0 if count == 0 else self.intensity.backoff.delay_s(count)
        self._recent.append(now)
        return RestartDecision(delay, f"restart {count + 1} in {delay:g}s after: {exit.cause}")

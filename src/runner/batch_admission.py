"""How long requests that find the engine idle wait for company before they start.

Clients that send at once reach the runner milliseconds apart; a prefill
started for the first few makes the rest wait for all of it. So the requests
wait, from the first one's arrival, for ``wait_share`` of the prefill they
all expect (at most ADMISSION_CAP_S): each newcomer lengthens the wait a
little, as it is one more prefill to share. A full batch starts at once.

On a fast model that share is a fraction of a millisecond, while clients
that send together reach the runner a few milliseconds apart (their own
connects, the daemon's relay). So the timer also learns that spread: a
request that arrives after the requests it came with have started (within
ADMISSION_CAP_S of the first) sets it, and the next start waits for it,
never longer than the prefill it expects (waiting longer would cost more
than the prefill a latecomer waits for). A burst the wait caught whole
keeps it; a lone request that nobody follows halves it.

A pure object, fed what the engine sees (arrivals, starts from idle,
prefill times): testable without mlx, on a clock of the test's own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "ADMISSION_CAP_S",
    "ADMISSION_FIRST_S",
    "BURST_DECAY",
    "PREFILL_RATE_WEIGHT",
    "AdmissionTimer",
]

ADMISSION_CAP_S = 0.05
"""Requests on an idle engine wait for company at most ``wait_share`` of
their expected prefill time, and never longer than this (see
:meth:`AdmissionTimer.wait_s`). A fast prefill waits ~nothing."""
ADMISSION_FIRST_S = 0.01
"""The wait before a runner's first prefill, whose speed is not known yet:
on a big model the clients that sent beside the first would otherwise wait
for all of its prefill (seconds), on a small one it costs 10 ms once."""
BURST_DECAY = 0.5
"""Each lone start from idle (one request, and no late one after it) keeps
this share of the learned burst spread (see :meth:`AdmissionTimer.wait_s`):
a lone user pays a learned wait once, then half of it, and so on."""
PREFILL_RATE_WEIGHT = 0.3  # of the newest solo prefill in the running estimate
MIN_TIMED_TOKENS = 8
"""A prefill of fewer computed tokens is too short to time: it says nothing
of the rate (but it does end the first-prefill wait)."""


@dataclass(frozen=True)
class _IdleStart:
    """The engine's last start from idle after an admission wait: what a
    latecomer is measured against."""

    first: float  # the first waiting request's arrival
    lone: bool  # it started one batchable request: nobody had come with it


class AdmissionTimer:
    """The admission wait of an idle engine, and the prefill rate and burst
    spread it learns the wait from.

    Args:
        wait_share: the share of the expected prefill to wait for company
            (0: requests never wait).
        clock: the clock arrivals are read on (``time.perf_counter``, as the
            runner stamps requests); ``now`` defaults to it.
    """

    def __init__(self, wait_share: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.wait_share = wait_share
        self.clock = clock
        self._prefill_tps: float | None = None  # prefill tokens/s, a running estimate
        self._prefilled_once = False  # the first-prefill wait (ADMISSION_FIRST_S) is spent
        # Bursts: how far apart requests sent together reached us, learned from
        # those that came just after their company had started without them.
        self._burst_s = 0.0
        self._idle_start: _IdleStart | None = None
        self._late_since_start = False

    @property
    def prefill_tps(self) -> float | None:
        """Prompt tokens computed per second, a running estimate (None until
        a prefill long enough to time)."""
        return self._prefill_tps

    @property
    def burst_s(self) -> float:
        """The burst spread learned so far: how far apart requests sent
        together reach the runner."""
        return self._burst_s

    def waits_for_company(self, waiting: int, capacity: int, batchable: bool) -> bool:
        """Whether ``waiting`` requests on an idle engine wait for more: not
        when they fill a batch of ``capacity``, nor when one of them cannot
        batch (not ``batchable``: it runs alone, so nobody would join it),
        nor when the timer is told never to wait."""
        return 0 < waiting < capacity and self.wait_share > 0 and batchable

    def wait_s(self, since: float, tokens: Callable[[], float], now: float | None = None) -> float:
        """How much longer requests that wait for company (see
        :meth:`waits_for_company`), the first of which arrived at ``since``,
        wait before they start (0: start now).

        ``tokens`` gives the prompt tokens they will compute between them;
        it is called only once a prefill rate is known (counting them may
        cost the engine a prefix-cache lookup). See the module's docstring
        for the rules."""
        burst_s = self._burst_next()
        if not self._prefilled_once:  # the runner's first prefill: its speed is not known yet
            window_s = ADMISSION_FIRST_S
        elif self._prefill_tps is None:  # only prefills too short to time: fast ones
            window_s = min(burst_s, ADMISSION_FIRST_S)
        else:
            expected_s = tokens() / self._prefill_tps
            window_s = min(
                ADMISSION_CAP_S,
                max(self.wait_share * expected_s, min(burst_s, expected_s)),
            )
        now = self.clock() if now is None else now
        return max(0.0, window_s - (now - since))

    def on_late_arrival(self, received: float) -> None:
        """A request reached the runner at ``received`` while the requests
        of the last start from idle run: if that was within ADMISSION_CAP_S
        of the first one's arrival, it was sent with them and came just too
        late, and how late it came is the burst spread to wait for."""
        start = self._idle_start
        if start is None:
            return
        # Submitted after the start, so too late for it, even if the reader
        # thread had it a moment before the main loop started the others.
        if start.first <= received <= start.first + ADMISSION_CAP_S:
            self._burst_s = max(self._burst_s, received - start.first)
            self._late_since_start = True

    def on_start(self, first_arrival: float, started: int, waited: bool) -> None:
        """The engine started requests from idle: ``started`` batchable ones
        (a request that runs alone for want of a batch does not count), the
        first in line having arrived at ``first_arrival``. Only a start that
        ``waited`` for company teaches: not one with a seeded request in
        line (it did not wait), nor one whose first request had waited
        behind another run (it waited for that run, not for company)."""
        self._burst_s = self._burst_next()  # the last start's lesson, now that it is over
        self._late_since_start = False
        if waited and started:
            self._idle_start = _IdleStart(first_arrival, lone=started == 1)
        else:
            self._idle_start = None

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """A request's prefill computed ``tokens`` prompt tokens in
        ``seconds``: fold its rate into the estimate waits are sized by. In
        a batch the time covers the others' prefills too: the rate is then
        low, and the wait it gives long (within the cap), which errs on the
        side of batching."""
        self._prefilled_once = True
        if tokens < MIN_TIMED_TOKENS or seconds <= 0:
            return
        rate = tokens / seconds
        old = self._prefill_tps
        self._prefill_tps = rate if old is None else old + PREFILL_RATE_WEIGHT * (rate - old)

    def _burst_next(self) -> float:
        """The burst spread the next start from idle waits for: halved if the
        last one started a lone request that nobody came late for."""
        start = self._idle_start
        if start is not None and start.lone and not self._late_since_start:
            return self._burst_s * BURST_DECAY
        return self._burst_s

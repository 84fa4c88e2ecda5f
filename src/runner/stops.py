"""Stop strings: a request's text is cut before the first one, and no part of
one ever reaches the client.

Text that could be the start of a stop string is held back until the next
tokens tell; a frame only carries ``job.text[:job.ready]``.
"""

from __future__ import annotations

from runner.job import Job

__all__ = ["add_text", "partial_stop"]


def add_text(job: Job, segment: str) -> bool:
    """Add ``segment`` to the job's text; True if a stop string now
    appears in it (the text is cut before it).

    Text that could be the start of a stop string is held back until the
    next tokens tell: a client never sees part of a stop string."""
    stops = job.request.sampling.stop
    before = len(job.text)
    job.text += segment
    if not stops:
        job.ready = len(job.text)
        return False
    found = [(i, s) for s in stops if (i := job.text.find(s, max(0, before - len(s) + 1))) >= 0]
    if found:
        at, job.stop_string = min(found)
        job.text = job.text[:at]
        job.ready = len(job.text)
        return True
    job.ready = len(job.text) - max(partial_stop(job.text, s) for s in stops)
    return False


def partial_stop(text: str, stop: str) -> int:
    """The length of the longest end of ``text`` that begins ``stop`` (short of
    all of it). Only the places in the last ``len(stop) - 1`` characters where
    ``stop``'s first character stands are tried: a few per token, not one per
    length of ``stop``."""
    at = text.find(stop[0], max(0, len(text) - len(stop) + 1))
    while at != -1:
        if stop.startswith(text[at:]):
            return len(text) - at
        at = text.find(stop[0], at + 1)
    return 0

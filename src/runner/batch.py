"""Requests in a batch, through mlx-lm's ``BatchGenerator`` (continuous
batching, as mlx_lm.server does it): a new request joins after its prefill,
a finished one leaves, each keeps its own sampler, logits processors, token
limit and stop.

A lone request moves into a batch where it left off when a second comes (its
cache cut back by the one token it had computed ahead). One request's
failure ends that request only; a failed batch step fails them all (the
batch's state is lost).

The methods here are :class:`~runner.engine.Engine`'s, kept in a module of
their own: the engine inherits them, and they read and write its state
(declared below: what they use of it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import structlog
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from ipc.messages import FinishReason
from runner.faults import Faults
from runner.guard import CHECK_EVERY_TOKENS
from runner.job import Job
from runner.prefill_pacing import MAX_STEP_TOKENS, PrefillPacer
from runner.prefix_cache import PromptCache
from runner.solo import Solo

__all__ = ["BatchPath"]

log = structlog.get_logger("runner.batch")


class BatchPath:
    """The engine's steps for the requests in its batch (``Engine.batch``,
    ``Engine.in_batch``)."""

    # The engine's state these steps use (set by Engine.__init__).
    model: Any
    new_cache: Callable[[], PromptCache]  # a fresh cache (quantized with kv_bits)
    max_concurrent: int
    batch: Any  # a BatchGenerator while requests run in a batch
    in_batch: dict[int, Job]  # by uid
    solo: Solo | None
    pacer: PrefillPacer
    faults: Faults
    is_cancelled: Callable[[int], bool]
    _stop_tokens: list[list[int]]
    _steps: int  # batch steps since the batch opened
    _progress: int

    if TYPE_CHECKING:  # the engine's methods these steps call

        def _batchable(self, job: Job) -> bool: ...
        def _fetch(self, job: Job) -> PromptCache | None: ...
        def _on_token(
            self, job: Job, token: int, batch_finish: str | None, logprobs: Any
        ) -> FinishReason | None: ...
        def _flush_all(self) -> None: ...
        def _finish(
            self, job: Job, finish: FinishReason, cache: PromptCache | None = None
        ) -> None: ...
        def _fail(self, job: Job, exc: BaseException) -> None: ...
        def _announce(self, phase: str, step_s: float | None) -> None: ...

    def _open_batch(self) -> Any:
        if self.batch is None:
            self.batch = BatchGenerator(
                self.model,
                stop_tokens=self._stop_tokens,
                completion_batch_size=self.max_concurrent,
                prefill_batch_size=self.max_concurrent,
                prefill_step_size=MAX_STEP_TOKENS,
            )
            self._steps = 0
        return self.batch

    def _join_batch(self, job: Job) -> None:
        batch = self._open_batch()
        cache = self._fetch(job)
        (uid,) = batch.insert(
            [job.prompt[job.cached_tokens :]],
            max_tokens=[job.max_tokens],
            # Always a cache: BatchGenerator's own would be 16-bit in a quantized batch.
            caches=[cache if cache is not None else self.new_cache()],
            all_tokens=[job.prompt[: job.cached_tokens]],
            samplers=[job.sampler],
            logits_processors=[job.processors],
        )
        job.uid, job.batched, job.started = uid, True, time.perf_counter()
        self.in_batch[uid] = job
        self._flush_all()  # a prefill comes next: no text waits behind it

    def _move_solo_to_batch(self, solo: Solo) -> bool:
        """Move the lone request into a batch where it left off; False when
        its cache cannot be cut back by the token it computed ahead."""
        job = solo.job
        if not self._batchable(job) or not can_trim_prompt_cache(solo.cache):
            return False
        if solo.steps is not None:
            solo.steps.close()
        self.solo = None
        try:
            uid = self._insert_moved(solo)
        except Exception as exc:  # it cannot go on: it fails, alone
            self._fail(job, exc)
            return True
        job.uid, job.batched = uid, True
        self.in_batch[uid] = job
        self._flush_all()
        log.debug("moved_to_batch", request_id=job.request_id, tokens=len(job.tokens))
        return True

    def _insert_moved(self, solo: Solo) -> int:
        job = solo.job
        batch = self._open_batch()
        if not job.tokens:  # no token yet: it joins with the prompt it has left
            done = job.cached_tokens + solo.prefilled
            (uid,) = batch.insert(
                [solo.rest[solo.prefilled :]],
                max_tokens=[job.max_tokens],
                caches=[solo.cache if done else self.new_cache()],
                all_tokens=[job.prompt[:done]],
                samplers=[job.sampler],
                logits_processors=[job.processors],
            )
        else:
            # generate_step has fed the last token it gave us into the cache:
            # cut it back, and let the batch feed it again. (A speculative
            # generation may have left that token out already: cut to size.
            # Only there: some cache classes' size() is 0.)
            cut = 1
            if solo.draft_cache is not None:
                cut = solo.cache[0].size() - (len(job.prompt) + len(job.tokens) - 1)
            trim_prompt_cache(solo.cache, cut)
            (uid,) = batch.insert(
                [[job.tokens[-1]]],
                max_tokens=[job.max_tokens - len(job.tokens)],
                caches=[solo.cache],
                all_tokens=[job.prompt + job.tokens[:-1]],
                samplers=[job.sampler],
                logits_processors=[job.processors],
            )
        return int(uid)

    def _step_batch(self, batch: Any) -> None:
        prefilling = [job for job in self.in_batch.values() if job.first_token_at is None]
        try:
            if prefilling:
                prompt_responses, responses = self._step_batch_prefill(batch, prefilling)
            else:
                prompt_responses, responses = batch.next()
        except Exception as exc:  # the batch's state is lost: every request in it fails
            log.exception("batch_step_failed")
            jobs = list(self.in_batch.values())
            self._close_batch()
            for job in jobs:
                self._fail(job, exc)
            return
        self._steps += 1
        if prompt_responses:
            self._progress += 1
        for r in responses:
            found = self.in_batch.get(r.uid)
            if found is None:
                continue
            job = found
            try:
                finish = self._on_token(job, r.token, r.finish_reason, r.logprobs)
            except Exception as exc:
                self._remove_from_batch([job])
                self._fail(job, exc)
                continue
            if finish is not None:
                del self.in_batch[r.uid]
                cache = r.prompt_cache if r.finish_reason is not None else None
                if cache is None:  # ended here, not by the batch: take it out
                    cache = self._remove_from_batch([job]).get(r.uid)
                self._finish(job, finish, cache=cache)
        self._check_batch(bool(prompt_responses))
        if not self.in_batch:
            self._close_batch()

    def _step_batch_prefill(self, batch: Any, prefilling: list[Job]) -> Any:
        """A batch step while prompts are prefilled: a chunk of each (and a
        decode step of the others), sized by the pacer and timed."""
        batch.prefill_step_size = self.pacer.step_tokens(len(prefilling))
        self._announce("prefill", self.pacer.expected_s(batch.prefill_step_size * len(prefilling)))
        for job in prefilling:
            job.prefill_chunks += 1
        with batch.stats() as stats:
            self.faults.prefill_chunk(max(job.prefill_chunks for job in prefilling),
                                      batch.prefill_step_size * len(prefilling))  # fmt: skip
            step = batch.next()
        self.pacer.record(stats.prompt_tokens, stats.wall_time - stats.decode_time)
        return step

    def _check_batch(self, prefilled: bool) -> None:
        """Cancels every step; memory every CHECK_EVERY_TOKENS steps and after
        each prefill chunk (``prefilled``). Memory stops the newest request first."""
        cancelled = [j for j in self.in_batch.values() if self.is_cancelled(j.request_id)]
        if cancelled:
            caches = self._remove_from_batch(cancelled)
            for job in cancelled:
                cache = caches.get(job.uid) if job.uid is not None else None
                self._finish(job, "cancelled", cache=cache)
        if not self.in_batch or (self._steps % CHECK_EVERY_TOKENS and not prefilled):
            return
        newest: Job = max(self.in_batch.values(), key=lambda j: j.uid or 0)
        where = f"at batch step {self._steps}"
        detail = newest.guard.check(where) if prefilled else newest.guard.at_cadence(where)
        if detail is not None:
            self._remove_from_batch([newest])
            newest.detail = detail
            self._finish(newest, "memory_pressure")
            self._steps -= 1  # check again at the next step

    def _remove_from_batch(self, jobs: Sequence[Job]) -> dict[int, PromptCache]:
        """Take ``jobs`` out of the batch; returns the caches of those that
        generated something (uid -> cache)."""
        if self.batch is None:
            return {}
        uids = [j.uid for j in jobs if j.uid is not None]
        for uid in uids:
            self.in_batch.pop(uid, None)
        keep = {j.uid for j in jobs if j.tokens and j.use_cache}
        extracted = self.batch.remove(uids, return_prompt_caches=bool(keep))
        return {uid: cache for uid, (cache, _) in extracted.items() if uid in keep}

    def _close_batch(self) -> None:
        if self.batch is not None:
            self.batch.close()
            self.batch = None
            self.in_batch.clear()

"""A request's answer: each token it makes on its way to the client, and its end.

A token goes through the request's detokenizer, then (a chat's) output
splitter (:mod:`runner.output`): reasoning and tool calls to their own
fields of the frames, the answer's text on to the stop strings
(:mod:`runner.stops`). What it made goes out in ``TextChunk`` frames, with
the log probabilities of its tokens: the first at once, later ones at most
every ``stream_interval_s``. At its end the request stores its cache and
sends its ``GenerationDone`` (or ``GenerationFailed``).

The methods here are :class:`~runner.engine.Engine`'s, kept in a module of
their own: the engine inherits them, and they read and write its state
(declared below: what they use of it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import structlog

from ipc.messages import ChatMessage, FinishReason, GenerationDone, GenerationFailed, TextChunk
from runner.batch_admission import AdmissionTimer
from runner.faults import Faults
from runner.guard import MemoryGuard
from runner.job import Job
from runner.next_turn import NextTurnPrefill
from runner.output import Parts
from runner.prefix_cache import PrefixCache, PromptCache
from runner.sampling import TokenTexts, read_logprobs, token_logprobs
from runner.stops import add_text

__all__ = ["AnswerPath"]

log = structlog.get_logger("runner.answer")


class AnswerPath:
    """The engine's steps for each running request's output, and its end."""

    # The engine's state these steps use (set by Engine.__init__).
    tokenizer: Any
    guard: MemoryGuard
    faults: Faults
    send: Callable[[Any], None]
    on_finished: Callable[[int, int | None], None]
    stream_interval_s: float
    admission: AdmissionTimer
    prefix_cache: PrefixCache | None
    next_turn: NextTurnPrefill | None
    _token_texts: TokenTexts
    _progress: int

    if TYPE_CHECKING:  # the engine's methods these steps call

        def _running(self) -> list[Job]: ...
        def _report(self) -> None: ...

    # --- tokens out ----------------------------------------------------------

    def _on_token(
        self, job: Job, token: int, batch_finish: str | None, logprobs: Any
    ) -> FinishReason | None:
        """Take one generated token (and the log probabilities mlx-lm gave
        with it): its output on its way to the client; the finish, if any.

        Raises what the request's logits processors raised (while making the
        token after it): the request fails there, alone."""
        if job.processor_error is not None:
            raise job.processor_error
        if job.first_token_at is None:
            job.first_token_at = time.perf_counter()
            # In a batch the time covers the others' prefills too (see record_prefill).
            self.admission.record_prefill(len(job.prompt) - job.cached_tokens,
                                          job.first_token_at - job.started)  # fmt: skip
        job.tokens.append(token)
        count = len(job.tokens)
        self._progress += 1
        self.faults.at_token(count)
        sampling = job.request.sampling
        finish: FinishReason | None = None
        if token in self.tokenizer.eos_token_ids or batch_finish == "stop":
            finish = "stop"
            job.detokenizer.finalize()
        else:
            if sampling.logprobs:  # an end token is no part of the answer
                job.logprobs.append(token_logprobs(logprobs, token, sampling.top_logprobs))
            job.detokenizer.add_token(token)
            if count >= job.max_tokens or batch_finish == "length":
                finish = "length"
                job.detokenizer.finalize()
        if self._take_output(job, job.detokenizer.last_segment, token, finish is not None):
            finish = "stop"
        elif finish is not None:
            job.ready = len(job.text)  # no stop string came: what was held back is text
        if finish == "stop" and job.tool_calls:
            finish = "tool_calls"  # the answer ended after calling tools
        now = time.perf_counter()
        first = not job.shown and (job.ready > job.sent or job.reasoning
                                   or len(job.tool_calls) > job.sent_calls)  # fmt: skip
        if first or finish is not None or now - job.sent_at >= self.stream_interval_s:
            self._flush(job, now)
        return finish

    def _take_output(self, job: Job, segment: str, token: int, last: bool) -> bool:
        """Take the text ``token`` made (its ``last`` one: the splitter gives
        up what it held too): reasoning and tool calls wait for the next
        frame, the answer's text goes on through the stop strings. True if a
        stop string now ends the text."""
        splitter = job.splitter
        if splitter is None:
            return add_text(job, segment)
        parts = splitter.feed(segment, token)
        self._take_parts(job, parts)
        stopped = add_text(job, parts.content)
        if stopped or last:
            stopped = self._end_output(job, stopped=stopped)
        return stopped

    @staticmethod
    def _take_parts(job: Job, parts: Parts) -> None:
        job.reasoning += parts.reasoning
        job.tool_calls.extend(parts.tool_calls)

    def _end_output(self, job: Job, stopped: bool = False) -> bool:
        """The answer ends (its last token, a stop string, or none: cancelled,
        memory, a failure): its splitter gives up what it held, and the tool
        calls it broke. True if the answer ends at a stop string (``stopped``:
        it already did).

        Once a stop string ends the answer, what the splitter still held came
        after it and is dropped, a tool-call block still open with it; the
        blocks that closed broken before it are still the answer's."""
        splitter = job.splitter
        if splitter is None or job.output_ended:
            return stopped
        rest, invalid = splitter.finish()
        job.output_ended = True
        if not stopped:
            self._take_parts(job, rest)
            stopped = add_text(job, rest.content)
        job.invalid_tool_call = splitter.broken if stopped else invalid
        return stopped

    def _flush(self, job: Job, now: float | None = None) -> None:
        """Send the text ``job`` made since its last frame, in one frame.

        The first token goes out at once, later ones at most every
        ``stream_interval_s`` (and all before the request ends or a prefill
        starts): a fast model's tokens then cost the supervisor and the
        client one frame each interval, not one per token."""
        calls = job.tool_calls[job.sent_calls :]
        if (job.sent_tokens == len(job.tokens) and job.sent == job.ready and not job.reasoning
                and not calls):  # fmt: skip
            return
        first = job.sent_tokens == 0  # the request's first frame: it tells the prompt's size
        job.sent_tokens = len(job.tokens)
        job.sent_at = time.perf_counter() if now is None else now
        text, job.sent = job.text[job.sent : job.ready], job.ready
        reasoning, job.reasoning = job.reasoning, ""
        logprobs = read_logprobs(job.logprobs, self._token_texts) if job.logprobs else []
        job.logprobs = []
        job.sent_calls = len(job.tool_calls)
        job.shown = job.shown or bool(text or reasoning or calls)
        self.send(TextChunk(job.request_id, text, job.sent_tokens, reasoning=reasoning,
                            tool_calls=calls or None, logprobs=logprobs or None,
                            prompt_tokens=len(job.prompt) if first else None,
                            cached_tokens=job.cached_tokens if first else None))  # fmt: skip

    def _flush_all(self) -> None:
        for job in self._running():
            self._flush(job)

    # --- ending requests -----------------------------------------------------

    def _finish(self, job: Job, finish: FinishReason, cache: PromptCache | None = None) -> None:
        """Store the request's cache, send its GenerationDone, log it."""
        self._end_output(job)
        job.ready = len(job.text)
        self._flush(job)
        if finish == "memory_pressure":
            self.guard.emergency_cleanup(f"request {job.request_id} stopped")
        elif cache is not None and job.tokens and job.use_cache and self.prefix_cache is not None:
            self.prefix_cache.store(job.cache_key + job.tokens, cache, job.key_space)
            messages = job.request.messages
            # (A chat with images is not prefilled for its next turn: the prefill has no images.)
            if (self.next_turn is not None and messages is not None and finish != "cancelled"
                    and job.invalid_tool_call is None and job.vision is None):  # fmt: skip
                # The answer as the client sends it back: its text, and its calls.
                answer = ChatMessage("assistant", job.text, tool_calls=job.tool_calls or None)
                self.next_turn.queue(messages, answer, job.request.chat, job.request.adapter)
        now = time.perf_counter()
        computed = len(job.prompt) - job.cached_tokens
        first = job.first_token_at
        prefill_s = (first - job.started) if first is not None and job.started else 0.0
        decode_s = (now - first) if first is not None else 0.0
        done = GenerationDone(
            request_id=job.request_id,
            prompt_tokens=len(job.prompt),
            generation_tokens=len(job.tokens),
            prompt_tps=computed / prefill_s if prefill_s > 0 else 0.0,
            generation_tps=len(job.tokens) / decode_s if decode_s > 0 else 0.0,
            ttft_s=(first - job.received) if first is not None else 0.0,
            peak_memory_bytes=int(mx.get_peak_memory()),
            finish_reason=finish,
            max_tokens_clamped_to=job.clamped_to,
            detail=job.detail,
            cached_tokens=job.cached_tokens,
            batched=job.batched,
            reasoning_tokens=job.splitter.reasoning_tokens if job.splitter is not None else 0,
            invalid_tool_call=job.invalid_tool_call,
            stop_string=job.stop_string if finish == "stop" else None,
            draft_tokens=job.draft_tokens,
            draft_accepted=job.draft_accepted,
        )
        # The engine's new figures first: a client that asks for the status as
        # soon as its request is done sees what the request did (the cache entry).
        self._report()
        self.send(done)  # the client before the log
        self.on_finished(job.request_id, len(job.tokens))
        log.info(
            "generation_done",
            request_id=job.request_id,
            tokens=done.generation_tokens,
            prompt_tokens=done.prompt_tokens,
            cached_tokens=done.cached_tokens,
            tps=round(done.generation_tps, 1),
            finish_reason=finish,
            batched=job.batched,
            max_tokens_clamped_to=job.clamped_to,
            detail=job.detail,
            draft_tokens=job.draft_tokens,
            draft_accepted=job.draft_accepted,
        )

    def _fail(self, job: Job, exc: BaseException) -> None:
        try:
            self._end_output(job)
        except Exception:  # the request fails anyway: what the splitter held is lost
            log.exception("output_end_failed", request_id=job.request_id)
        job.ready = len(job.text)
        self._flush(job)
        log.error("generation_failed", request_id=job.request_id, error=repr(exc))
        self._report()
        self.send(GenerationFailed(job.request_id, f"{type(exc).__name__}: {exc}"))
        self.on_finished(job.request_id, None)

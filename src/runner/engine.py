"""The runner's engine: requests served side by side, with a KV prefix cache.

A request runs one of two ways:

- **alone** (``_Solo``), through mlx-lm's ``generate_step``: the fastest
  path for one sequence, and the only one for a request with a seed or a
  model whose caches cannot be merged into a batch;
- **in a batch**, through mlx-lm's ``BatchGenerator`` (continuous batching,
  as mlx_lm.server does it): a new request joins after its prefill, a
  finished one leaves, each keeps its own sampler, token limit and stop.

A runner with nothing else to do serves a lone request alone. When a second
request comes while one runs alone, the lone one moves into a new batch
where it left off (its cache cut back by the one token it had computed
ahead) and the newcomer joins it. A request that cannot join a batch waits
until the batch drains, then runs alone: requests start in arrival order.

Every request looks up the prefix cache before it starts and, when it ends
(done or cancelled, after at least one token), stores the cache of its whole
sequence. One request's failure ends that request only.

After a chat answer, while no request waits or runs, the engine prefills the
start of that chat's next request (``_NextTurn``): the conversation with the
answer as the client will send it back, and the template's header of the
next user turn, as the template renders them. The next turn then computes
only its new user line. This is work done ahead in time a user spends
reading and typing; a request that comes in goes first (the next-turn work
stops at its chunk's end and keeps what it computed), and memory pressure
or an error just drops it.

Everything here runs on the runner's main thread; the pipe-reader thread
only reads :attr:`Engine.stats_snapshot` (for Pongs) and flags cancels.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import structlog
from mlx_lm.generate import BatchGenerator, generate_step, generation_stream
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import make_sampler

from ipc.messages import (
    EngineReport,
    EngineSettings,
    EngineStats,
    FinishReason,
    Generate,
    GenerationDone,
    GenerationFailed,
    Heartbeat,
    NextTurnStats,
    TextChunk,
)
from runner.distributed import Group
from runner.faults import Faults
from runner.guard import CHECK_EVERY_TOKENS, MemoryGuard, RequestGuard, assess
from runner.prefill_pacing import MAX_STEP_TOKENS, PrefillPacer
from runner.prefix_cache import PrefixCache, PromptCache, cache_nbytes, prefix_view

__all__ = ["Engine", "batchability", "build_prompt_tokens"]

log = structlog.get_logger("runner.engine")

HEARTBEAT_INTERVAL_S = 0.5
PREFIX_CACHE_SHARE = 0.25
"""The prefix cache's default budget: this share of the runner's memory
budget, or of the memory available at load when it has none."""
ADMISSION_CAP_S = 0.05
"""Requests on an idle engine wait for company at most ``batch_wait_share``
of their expected prefill time, and never longer than this (see
:meth:`Engine.admission_wait_s`). A fast prefill waits ~nothing."""
ADMISSION_FIRST_S = 0.01
"""The wait before a runner's first prefill, whose speed is not known yet:
on a big model the clients that sent beside the first would otherwise wait
for all of its prefill (seconds), on a small one it costs 10 ms once."""
BURST_DECAY = 0.5
"""Each lone start from idle (one request, and no late one after it) keeps
this share of the learned burst spread (see :meth:`Engine.admission_wait_s`):
a lone user pays a learned wait once, then half of it, and so on."""
PREFILL_RATE_WEIGHT = 0.3  # of the newest solo prefill in the running estimate
NEXT_TURN_CHUNK_S = 0.05
"""A next-turn prefill computes about this long at a time (by the prefill
rate measured): a request that comes in waits at most that for it."""
NEXT_TURN_PROBES = ("A", "B")
"""Two user lines that differ in their first character: the tokens that
both next-turn renders share are the ones any next turn starts with."""

Send = Callable[[Any], None]


def build_prompt_tokens(tokenizer: Any, request: Generate) -> list[int]:
    """The prompt's token ids: chat-templated messages, or raw text encoded as
    mlx-lm's ``stream_generate`` encodes it."""
    if request.messages is not None:
        turns = [{"role": m.role, "content": m.content} for m in request.messages]
        return list(tokenizer.apply_chat_template(turns, add_generation_prompt=True))
    if request.prompt is None:
        raise ValueError("a generate request needs a prompt or messages")
    bos = tokenizer.bos_token
    add_special = bos is None or not request.prompt.startswith(bos)
    return list(tokenizer.encode(request.prompt, add_special_tokens=add_special))


def batchability(model: Any) -> tuple[bool, str | None]:
    """Whether requests to ``model`` can share a batch, and if not why."""
    cache = make_prompt_cache(model)
    unmergeable = sorted({type(c).__name__ for c in cache if not hasattr(c, "merge")})
    if unmergeable:
        return False, f"its caches ({', '.join(unmergeable)}) cannot be merged into a batch"
    return True, None


def next_turn_prefix(tokenizer: Any, messages: Sequence[Any], answer: str) -> list[int]:
    """The tokens every next request of this chat starts with: ``messages``,
    then ``answer`` as the assistant's turn, then the template's header of
    the next user turn, as the chat template renders the history (which may
    differ from the tokens generated: a template may strip the answer, or
    drop its reasoning). The last shared token is left out: a real user
    line's first characters may tokenise together with it."""
    turns = [{"role": m.role, "content": m.content} for m in messages]
    turns.append({"role": "assistant", "content": answer})
    first, second = (
        list(tokenizer.apply_chat_template([*turns, {"role": "user", "content": probe}],
                                           add_generation_prompt=True))
        for probe in NEXT_TURN_PROBES
    )  # fmt: skip
    shared = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        shared += 1
    return first[: max(0, shared - 1)]


@dataclass(eq=False)
class Job:
    """One request inside the engine."""

    request: Generate
    received: float
    prompt: list[int]
    max_tokens: int
    clamped_to: int | None
    sampler: Any
    guard: RequestGuard
    detokenizer: Any
    use_cache: bool
    cached_tokens: int = 0
    to_compute: int | None = None  # prompt tokens to compute, as admission expects it
    held: bool = False  # it waited in line behind a run: not for company
    prefill_chunks: int = 0  # prefill steps it took part in
    tokens: list[int] = field(default_factory=list)  # generated so far (a stop token included)
    started: float = 0.0  # when its prefill began
    first_token_at: float | None = None
    uid: int | None = None  # its id in the batch
    batched: bool = False
    finish: FinishReason | None = None
    detail: str | None = None
    text: str = ""  # the text so far (cut before a stop string)
    ready: int = 0  # characters of ``text`` that may go out (none of a stop string's start)
    sent: int = 0  # characters of ``text`` sent
    sent_tokens: int = 0  # tokens its frames have covered
    sent_at: float = 0.0

    @property
    def request_id(self) -> int:
        return self.request.request_id


@dataclass(eq=False)
class _NextTurn:
    """A chat answered: its next turn's start waits to be prefilled.

    ``tokens`` is worked out at its first step (not on the answer's way
    out); ``cache`` holds ``tokens[:done]`` while it is being computed."""

    messages: Sequence[Any]
    answer: str
    tokens: list[int] | None = None
    cache: PromptCache | None = None
    done: int = 0


@dataclass(frozen=True)
class _IdleStart:
    """The engine's last start from idle after an admission wait: what a
    latecomer is measured against."""

    first: float  # the first waiting request's arrival
    lone: bool  # it started one batchable request: nobody had come with it


@dataclass(eq=False)
class _Solo:
    """A request running alone: its prompt prefilled a chunk at a time, then
    its tokens generated by ``generate_step``."""

    job: Job
    cache: PromptCache
    rest: list[int]  # the prompt tokens not taken from the prefix cache
    prefilled: int = 0  # of ``rest``, in the cache
    steps: Generator[tuple[Any, Any], None, None] | None = None  # once prefilled


class Engine:
    """Serves generation requests for one loaded model.

    Args:
        model, tokenizer: what mlx-lm loaded.
        settings: concurrency and prefix-cache settings from the LoadModel.
        guard: the runner's memory guard (its budget sizes the prefix cache).
        faults: fault injection.
        send: writes one frame to the supervisor.
        is_cancelled: whether a request was cancelled (read every step).
        on_finished: called with each request's id and generated tokens (None
            if it failed) once its last frame is sent.
        max_tokens_cap: the model's hard token cap.
        group: the distributed group this runner is a rank of, if any. Every
            rank serves the same requests, one at a time, and stops each at
            the same token; the prefix cache is off (its evictions follow
            each rank's own memory, which could part the ranks).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        settings: EngineSettings,
        *,
        guard: MemoryGuard,
        faults: Faults,
        send: Send,
        is_cancelled: Callable[[int], bool],
        on_finished: Callable[[int, int | None], None],
        max_tokens_cap: int | None,
        group: Group | None = None,
    ) -> None:
        self.model = model
        self.group = group
        self.tokenizer = tokenizer
        self.guard = guard
        self.faults = faults
        self.send = send
        self.is_cancelled = is_cancelled
        self.on_finished = on_finished
        self.max_tokens_cap = max_tokens_cap
        self.stream_interval_s = settings.stream_interval_s
        self.batch_wait_share = settings.batch_wait_share
        self.batching, self.batching_reason = batchability(model)
        if settings.max_concurrent <= 1 and self.batching:
            self.batching, self.batching_reason = False, "max_concurrent is 1"
        if group is not None:
            self.batching = False
            self.batching_reason = f"a distributed group ({group.size} ranks) serves one at a time"
        self.max_concurrent = max(1, settings.max_concurrent) if self.batching else 1
        self.prefix_cache: PrefixCache | None = None
        if settings.prefix_cache and group is None:
            budget = settings.prefix_cache_bytes
            if budget is None:
                budget = default_prefix_cache_bytes(guard)
            self.prefix_cache = PrefixCache(budget, settings.prefix_cache_entries)
            guard.add_cleanup_hook(self._evict_for_memory)
        self.pending: deque[Job] = deque()
        self.solo: _Solo | None = None
        self.batch: Any = None  # a BatchGenerator while requests run in a batch
        self.in_batch: dict[int, Job] = {}
        self._stop_tokens = [[t] for t in sorted(tokenizer.eos_token_ids)]
        self._samplers: dict[tuple[float, float], Any] = {}
        self._steps = 0
        self._prefill_tps: float | None = None  # prefill tokens/s, a running estimate
        self.pacer = PrefillPacer(settings.prefill_chunk_s)
        self._prefilled_once = False  # the first-prefill wait (ADMISSION_FIRST_S) is spent
        # Bursts: how far apart requests sent together reached us, learned from
        # those that came just after their company had started without them.
        self._burst_s = 0.0
        self._idle_start: _IdleStart | None = None
        self._late_since_start = False
        self._progress = 0
        self._last_beat = time.perf_counter()
        self.next_turn_prefill = settings.next_turn_prefill and self.prefix_cache is not None
        self.next_turns: deque[_NextTurn] = deque()
        self._next_turn_counts = {"prefilled": 0, "tokens": 0, "dropped": 0}
        self.stats_snapshot = self.stats()

    # --- the outside -----------------------------------------------------------

    @property
    def idle(self) -> bool:
        """No request waits or runs (next-turn prefills may)."""
        return not self.pending and self.solo is None and not self.in_batch

    @property
    def has_work(self) -> bool:
        """A request, or a next-turn prefill, waits or runs."""
        return not self.idle or bool(self.next_turns)

    @property
    def active(self) -> int:
        return (self.solo is not None) + len(self.in_batch)

    def admission_wait_s(self, now: float | None = None) -> float:
        """How much longer to wait for more requests before starting those
        waiting on an idle engine (0: start now).

        Clients that send at once reach the runner milliseconds apart; a
        prefill started for the first few makes the rest wait for all of it.
        So the requests wait, from the first one's arrival, for
        ``batch_wait_share`` of the prefill they all expect (at most
        ADMISSION_CAP_S): each newcomer lengthens the wait a little, as it
        is one more prefill to share. A full batch starts at once.

        On a fast model that share is a fraction of a millisecond, while
        clients that send together reach the runner a few milliseconds
        apart (their own connects, the daemon's relay). So the engine also
        learns that spread: a request that arrives after the requests it
        came with have started (within ADMISSION_CAP_S of the first) sets
        it, and the next start waits for it, never longer than the prefill
        it expects (waiting longer would cost more than the prefill a
        latecomer waits for). A burst the wait caught whole keeps it; a
        lone request that nobody follows halves it."""
        if self.solo is not None or self.batch is not None or not self._waits_for_company():
            return 0.0
        burst_s = self._burst_next()
        if not self._prefilled_once:  # the runner's first prefill: its speed is not known yet
            window_s = ADMISSION_FIRST_S
        elif self._prefill_tps is None:  # only prefills too short to time: fast ones
            window_s = min(burst_s, ADMISSION_FIRST_S)
        else:
            expected_s = sum(self._to_compute(job) for job in self.pending) / self._prefill_tps
            window_s = min(
                ADMISSION_CAP_S,
                max(self.batch_wait_share * expected_s, min(burst_s, expected_s)),
            )
        now = time.perf_counter() if now is None else now
        return max(0.0, window_s - (now - self.pending[0].received))

    def _waits_for_company(self) -> bool:
        """Whether the requests waiting on an idle engine wait for more: not
        when they fill a batch, nor when one of them cannot batch."""
        return (
            0 < len(self.pending) < self.max_concurrent
            and self.batch_wait_share > 0
            and all(self._batchable(job) for job in self.pending)
        )

    def _to_compute(self, job: Job) -> int:
        """The prompt tokens ``job`` will compute: what the prefix cache will not give it."""
        if job.to_compute is None:
            match = None
            if job.use_cache and self.prefix_cache is not None:
                match = self.prefix_cache.index.peek(job.prompt)
            job.to_compute = len(job.prompt) - (match.reuse if match is not None else 0)
        return job.to_compute

    def submit(self, request: Generate, received: float | None = None) -> None:
        """Queue ``request``, which reached the runner at ``received``
        (``time.perf_counter()``; default now); a request that cannot run
        fails at once."""
        received = time.perf_counter() if received is None else received
        try:
            job = self._make_job(request, received)
        except Exception as exc:  # the request cannot run (template, prompt, settings)
            log.error("generation_failed", request_id=request.request_id, error=repr(exc))
            error = f"{type(exc).__name__}: {exc}"
            self.send(GenerationFailed(request.request_id, error, invalid_request=True))
            self.on_finished(request.request_id, None)
            return
        self._note_arrival(received)
        job.held = self.solo is not None or self.batch is not None  # in line behind a run
        self._pause_next_turn()  # before admission looks up what the cache holds for it
        self.pending.append(job)

    def _note_arrival(self, received: float) -> None:
        """Learn the burst spread from a request that came just too late for
        the requests it was sent with (see :meth:`admission_wait_s`)."""
        start = self._idle_start
        if start is None or (self.solo is None and self.batch is None):
            return
        # Submitted after the start, so too late for it, even if the reader
        # thread had it a moment before the main loop started the others.
        if start.first <= received <= start.first + ADMISSION_CAP_S:
            self._burst_s = max(self._burst_s, received - start.first)
            self._late_since_start = True

    def _burst_next(self) -> float:
        """The burst spread the next start from idle waits for: halved if the
        last one started a lone request that nobody came late for."""
        start = self._idle_start
        if start is not None and start.lone and not self._late_since_start:
            return self._burst_s * BURST_DECAY
        return self._burst_s

    def _note_idle_start(self, first: Job, waited: bool) -> None:
        """The engine started requests from idle, ``first`` first, after an
        admission wait or (``waited`` False) without one. Only a start that
        waited for company teaches: not one with a seeded request in line
        (it did not wait), nor one whose first request had waited behind
        another run."""
        started = (self.solo is not None and self._batchable(self.solo.job)) + len(self.in_batch)
        for job in self.pending:  # left in line: they wait for a run, not for company
            job.held = True
        self._burst_s = self._burst_next()  # the last start's lesson, now that it is over
        self._late_since_start = False
        if not (waited and started) or first.held:
            self._idle_start = None
        else:
            self._idle_start = _IdleStart(first.received, lone=started == 1)

    def step(self) -> None:
        """Do one unit of work: start what can start, then one decode step
        (or prefill chunk) of whatever runs; with no request, a chunk of a
        next-turn prefill."""
        self._start_pending()
        started = time.perf_counter()
        if self.solo is not None:
            self._step_solo(self.solo)
        elif self.batch is not None:
            self._step_batch(self.batch)
        elif self.next_turns and not self.pending:
            self._step_next_turn(self.next_turns[0])
        now = time.perf_counter()
        if self.idle:
            self.faults.end_request()
        elif now - self._last_beat >= HEARTBEAT_INTERVAL_S:
            self._last_beat = now
            self.guard.refresh()
            waiting = any(j.first_token_at is None for j in self._running())
            # The step just done says how long the next of its kind may take.
            self.send(Heartbeat("prefill" if waiting else "decode", self._progress,
                                self.guard.figures, now - started))  # fmt: skip

    def clear_cache(self) -> tuple[int, int]:
        """Drop the prefix cache; returns the entries and bytes dropped."""
        if self.prefix_cache is None:
            return 0, 0
        self._drop_next_turns()
        dropped = self.prefix_cache.clear()
        self._report()
        return dropped

    def fail_all(self, exc: BaseException) -> None:
        """Something broke outside any one request: every request in the
        engine fails with it, and the engine starts afresh (the runner lives)."""
        jobs = [*self._running(), *self.pending]
        self.pending.clear()
        self.solo = None
        self.in_batch.clear()
        self.batch = None
        for job in jobs:
            self._fail(job, exc)

    def stats(self) -> EngineStats:
        return EngineStats(
            active_requests=self.active,
            max_concurrent=self.max_concurrent,
            queued=len(self.pending),
            batching=self.batching,
            batching_reason=self.batching_reason,
            prefix_cache=None if self.prefix_cache is None else self.prefix_cache.stats(),
            next_turn=NextTurnStats(len(self.next_turns), **self._next_turn_counts)
            if self.next_turn_prefill else None,
        )  # fmt: skip

    # --- starting requests ---------------------------------------------------

    def _make_job(self, request: Generate, received: float) -> Job:
        sampling = request.sampling
        max_tokens, clamped_to = sampling.max_tokens, None
        if self.max_tokens_cap is not None and max_tokens > self.max_tokens_cap:
            max_tokens = clamped_to = self.max_tokens_cap
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if any(not stop for stop in sampling.stop):
            raise ValueError("a stop string is empty")
        prompt = build_prompt_tokens(self.tokenizer, request)
        if not prompt:
            raise ValueError("the prompt is empty")
        key = (sampling.temperature, sampling.top_p)
        sampler = self._samplers.get(key)
        if sampler is None:  # one object per setting: a batch that shares it samples at once
            sampler = self._samplers[key] = make_sampler(temp=key[0], top_p=key[1])
        return Job(
            request=request,
            received=received,
            prompt=prompt,
            max_tokens=max_tokens,
            clamped_to=clamped_to,
            sampler=sampler,
            guard=self.guard.start_request(request.request_id),
            detokenizer=self.tokenizer.detokenizer,
            use_cache=request.cache and self.prefix_cache is not None,
        )

    def _batchable(self, job: Job) -> bool:
        return self.batching and job.request.sampling.seed is None

    def _start_pending(self) -> None:
        """Start the waiting requests that can start, in arrival order; one
        that fails to start fails alone. Cancelled ones end wherever they are
        in line (in a group, where every rank agrees: at the prefill's start)."""
        if not self.pending:  # the usual case, every token
            return
        if self.group is None and any(self.is_cancelled(j.request_id) for j in self.pending):
            for job in [j for j in self.pending if self.is_cancelled(j.request_id)]:
                self.pending.remove(job)
                self._finish(job, "cancelled")
        idle = self.solo is None and self.batch is None
        first = self.pending[0] if idle and self.pending else None
        waited = first is not None and self._waits_for_company()
        self._start_in_line()
        if first is not None:
            self._note_idle_start(first, waited)

    def _start_in_line(self) -> None:
        """Start requests from the front of the line until one must wait."""
        while self.pending:
            job = self.pending[0]
            try:
                if not self._start_next(job):
                    return
            except Exception as exc:
                if self.group is not None:  # the ranks may part here: the group ends
                    raise
                log.exception("request_start_failed", request_id=job.request_id)
                if self.pending and self.pending[0] is job:
                    self.pending.popleft()
                if job.uid is not None:
                    self.in_batch.pop(job.uid, None)
                if self.solo is not None and self.solo.job is job:
                    self.solo = None
                self._fail(job, exc)

    def _start_next(self, job: Job) -> bool:
        """Start ``job`` (the first in line) if it can start now; False if it
        must wait (for room in the batch, or for the batch to drain)."""
        if self.group is None and self.is_cancelled(job.request_id):
            self.pending.popleft()
            self._finish(job, "cancelled")
            return True
        if self.solo is None and self.batch is None:
            more = len(self.pending) > 1 and self._batchable(self.pending[1])
            if self._batchable(job) and more:
                self._open_batch()
            else:
                self.pending.popleft()
                self._start_solo(job)
                return True
        if not self._batchable(job) or self.active >= self.max_concurrent:
            return False  # it waits for room, or for the batch to drain
        if self.solo is not None and not self._move_solo_to_batch(self.solo):
            return False
        self.pending.popleft()
        self._join_batch(job)
        return True

    def _fetch(self, job: Job) -> PromptCache | None:
        if not job.use_cache or self.prefix_cache is None:
            return None
        cache, reused = self.prefix_cache.fetch(job.prompt)
        job.cached_tokens = reused
        return cache

    def _start_solo(self, job: Job) -> None:
        cache = self._fetch(job)
        if cache is None:
            cache = make_prompt_cache(self.model)
        if job.request.sampling.seed is not None:
            mx.random.seed(job.request.sampling.seed)
        job.started = time.perf_counter()
        mx.reset_peak_memory()
        self.solo = _Solo(job, cache, job.prompt[job.cached_tokens :])

    def _prefill_solo(self, solo: _Solo) -> None:
        """One step of a lone request's prefill: a chunk of its prompt sized
        by the pacer, or, once all but the last token are in the cache, the
        start of its generation (``generate_step`` computes that token with
        the first sample). The guard and cancels are checked before each
        chunk; in a group every rank agrees on them and on the chunk's size."""
        job = solo.job
        left = len(solo.rest) - 1 - solo.prefilled
        done = job.cached_tokens + solo.prefilled
        stop = job.guard.check(f"in prefill ({done}/{len(job.prompt)} prompt tokens)")
        cancelled = self.is_cancelled(job.request_id)
        size = min(self.pacer.step_tokens(), left)
        if self.group is not None:  # every rank stops, and steps, alike
            # The last request's token computed ahead may still be in flight, its
            # forward's all_sums with it: ours must not overlap them (the ring
            # then sums one rank's flags with another's activations).
            mx.synchronize(generation_stream)
            elsewhere, cancelled, size = self.group.agree_with_step(stop is not None, cancelled,
                                                                    size)  # fmt: skip
            if elsewhere and stop is None:
                stop = "memory pressure on another rank of the group"
        if stop is not None or cancelled:
            self.solo = None
            job.detail = stop
            self._finish(job, "cancelled" if stop is None else "memory_pressure")
            return
        if left <= 0:
            solo.steps = generate_step(
                mx.array(solo.rest[solo.prefilled :]),
                self.model,
                max_tokens=job.max_tokens,
                sampler=job.sampler,
                prompt_cache=solo.cache,
            )
            return
        chunk = solo.rest[solo.prefilled : solo.prefilled + size]
        self._announce("prefill", self.pacer.expected_s(len(chunk)))
        job.prefill_chunks += 1
        started = time.perf_counter()
        self.faults.prefill_chunk(job.prefill_chunks, len(chunk))
        with mx.stream(generation_stream):
            self.model(mx.array(chunk)[None], cache=solo.cache)
            mx.eval([layer.state for layer in solo.cache])
        self.pacer.record(len(chunk), time.perf_counter() - started)
        mx.clear_cache()
        solo.prefilled += size
        self._progress += 1

    def _announce(self, phase: str, step_s: float | None) -> None:
        """A heartbeat before a step that may be long: at the usual interval,
        and always before one expected to outlast it (the supervisor gives a
        step a multiple of the time stated)."""
        now = time.perf_counter()
        long_step = step_s is not None and step_s >= HEARTBEAT_INTERVAL_S
        if long_step or now - self._last_beat >= HEARTBEAT_INTERVAL_S:
            self._last_beat = now
            self.send(Heartbeat(phase, self._progress, self.guard.figures, step_s))

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
            caches=[cache] if cache is not None else None,
            all_tokens=[job.prompt[: job.cached_tokens]],
            samplers=[job.sampler],
        )
        job.uid, job.batched, job.started = uid, True, time.perf_counter()
        self.in_batch[uid] = job
        self._flush_all()  # a prefill comes next: no text waits behind it

    def _move_solo_to_batch(self, solo: _Solo) -> bool:
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

    def _insert_moved(self, solo: _Solo) -> int:
        job = solo.job
        batch = self._open_batch()
        if not job.tokens:  # no token yet: it joins with the prompt it has left
            done = job.cached_tokens + solo.prefilled
            (uid,) = batch.insert(
                [solo.rest[solo.prefilled :]],
                max_tokens=[job.max_tokens],
                caches=[solo.cache] if done else None,
                all_tokens=[job.prompt[:done]],
                samplers=[job.sampler],
            )
        else:
            # generate_step has fed the last token it gave us into the cache:
            # cut it back, and let the batch feed it again.
            trim_prompt_cache(solo.cache, 1)
            (uid,) = batch.insert(
                [[job.tokens[-1]]],
                max_tokens=[job.max_tokens - len(job.tokens)],
                caches=[solo.cache],
                all_tokens=[job.prompt + job.tokens[:-1]],
                samplers=[job.sampler],
            )
        return int(uid)

    # --- stepping ------------------------------------------------------------

    def _running(self) -> list[Job]:
        jobs = list(self.in_batch.values())
        if self.solo is not None:
            jobs.append(self.solo.job)
        return jobs

    def _step_solo(self, solo: _Solo) -> None:
        job = solo.job
        if solo.steps is None:
            try:
                self._prefill_solo(solo)
            except Exception as exc:
                self.solo = None
                self._fail_solo(job, exc)
            return
        try:
            token, _ = next(solo.steps)
        except StopIteration:  # max_tokens reached (we stop before it does)
            self.solo = None
            self._finish(job, "length", cache=solo.cache)
            return
        except Exception as exc:
            self.solo = None
            self._fail_solo(job, exc)
            return
        try:
            finish = self._on_token(job, token, None)
        except Exception as exc:
            solo.steps.close()
            self.solo = None
            self._fail_solo(job, exc)
            return
        if finish is None:
            detail = job.guard.at_token(len(job.tokens))
            cancelled = self.is_cancelled(job.request_id)
            if self.group is not None:  # every rank stops at the same token
                memory, cancelled = self.group.agree(detail is not None, cancelled)
                if memory and detail is None:
                    detail = "memory pressure on another rank of the group"
            if detail is not None:
                job.detail, finish = detail, "memory_pressure"
            elif cancelled:
                finish = "cancelled"
        if finish is not None:
            solo.steps.close()
            self.solo = None
            self._finish(job, finish, cache=solo.cache)

    def _fail_solo(self, job: Job, exc: Exception) -> None:
        """The lone request failed. In a group the other ranks may be one
        collective further on, or gone: the group cannot go on, so the error
        leaves the engine (the runner exits and the group is restarted)."""
        if self.group is not None:
            raise exc
        self._fail(job, exc)

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
                finish = self._on_token(job, r.token, r.finish_reason)
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

    def _on_token(self, job: Job, token: int, batch_finish: str | None) -> FinishReason | None:
        """Take one generated token: text out to the client; the finish, if any."""
        if job.first_token_at is None:
            job.first_token_at = time.perf_counter()
            self._note_prefill(job)
        job.tokens.append(token)
        count = len(job.tokens)
        self._progress += 1
        self.faults.at_token(count)
        finish: FinishReason | None = None
        if token in self.tokenizer.eos_token_ids or batch_finish == "stop":
            finish = "stop"
            job.detokenizer.finalize()
        else:
            job.detokenizer.add_token(token)
            if count >= job.max_tokens or batch_finish == "length":
                finish = "length"
                job.detokenizer.finalize()
        if self._add_text(job, job.detokenizer.last_segment):
            finish = "stop"
        elif finish is not None:
            job.ready = len(job.text)  # no stop string came: what was held back is text
        now = time.perf_counter()
        first_text = job.sent == 0 and job.ready > 0
        if first_text or finish is not None or now - job.sent_at >= self.stream_interval_s:
            self._flush(job, now)
        return finish

    def _note_prefill(self, job: Job) -> None:
        """Fold a prefill's rate into the estimate admission waits by. In a
        batch the time covers the others' prefills too: the rate is then
        low, and the wait it gives long (within the cap), which errs on the
        side of batching."""
        self._prefilled_once = True
        computed = len(job.prompt) - job.cached_tokens
        elapsed = (job.first_token_at or 0.0) - job.started
        if computed < 8 or elapsed <= 0:
            return
        rate = computed / elapsed
        old = self._prefill_tps
        self._prefill_tps = rate if old is None else old + PREFILL_RATE_WEIGHT * (rate - old)

    def _flush(self, job: Job, now: float | None = None) -> None:
        """Send the text ``job`` made since its last frame, in one frame.

        The first token goes out at once, later ones at most every
        ``stream_interval_s`` (and all before the request ends or a prefill
        starts): a fast model's tokens then cost the supervisor and the
        client one frame each interval, not one per token."""
        if job.sent_tokens == len(job.tokens) and job.sent == job.ready:
            return
        job.sent_tokens = len(job.tokens)
        job.sent_at = time.perf_counter() if now is None else now
        text, job.sent = job.text[job.sent : job.ready], job.ready
        self.send(TextChunk(job.request_id, text, job.sent_tokens))

    @staticmethod
    def _add_text(job: Job, segment: str) -> bool:
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
        found = [i for s in stops if (i := job.text.find(s, max(0, before - len(s) + 1))) >= 0]
        if found:
            job.text = job.text[: min(found)]
            job.ready = len(job.text)
            return True
        job.ready = len(job.text) - max(_partial_stop(job.text, s) for s in stops)
        return False

    def _flush_all(self) -> None:
        for job in self._running():
            self._flush(job)

    # --- ending requests -----------------------------------------------------

    def _finish(self, job: Job, finish: FinishReason, cache: PromptCache | None = None) -> None:
        """Store the request's cache, send its GenerationDone, log it."""
        job.ready = len(job.text)
        self._flush(job)
        if finish == "memory_pressure":
            self.guard.emergency_cleanup(f"request {job.request_id} stopped")
        elif cache is not None and job.tokens and job.use_cache and self.prefix_cache is not None:
            self.prefix_cache.store(job.prompt + job.tokens, cache)
            chat = job.request.messages is not None
            if self.next_turn_prefill and chat and finish != "cancelled":
                self._queue_next_turn(job)
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
        )

    # --- next-turn prefill ---------------------------------------------------

    def _queue_next_turn(self, job: Job) -> None:
        """Queue the prefill of this chat's next turn; past ``max_concurrent``
        waiting, the oldest is dropped."""
        assert job.request.messages is not None
        if len(self.next_turns) >= self.max_concurrent:
            self._drop_next_turn(self.next_turns[0], "more chats answered than max_concurrent")
        self.next_turns.append(_NextTurn(job.request.messages, job.text))

    def _step_next_turn(self, turn: _NextTurn) -> None:
        """One chunk of the first waiting next-turn prefill (about
        NEXT_TURN_CHUNK_S of compute); stored when it is whole."""
        try:
            plan = self.guard.plan
            if plan is not None:
                verdict = assess(self.guard.refresh(), plan)
                if verdict.warn or verdict.critical:  # work ahead is the first to go
                    self._drop_next_turn(turn, "memory pressure")
                    self._report()
                    return
            if turn.cache is None and not self._resume_next_turn(turn):
                return
            assert turn.tokens is not None and turn.cache is not None
            size = self.pacer.step_tokens(target_s=NEXT_TURN_CHUNK_S)
            chunk = turn.tokens[turn.done : turn.done + size]
            started = time.perf_counter()
            with mx.stream(generation_stream):
                self.model(mx.array(chunk)[None], cache=turn.cache)
                mx.eval([layer.state for layer in turn.cache])
            self.pacer.record(len(chunk), time.perf_counter() - started)
            turn.done += len(chunk)
            self._next_turn_counts["tokens"] += len(chunk)
            if turn.done >= len(turn.tokens):
                self.next_turns.remove(turn)
                if self._store_next_turn(turn):
                    self._next_turn_counts["prefilled"] += 1
                else:
                    self._next_turn_counts["dropped"] += 1
                self._report()
        except Exception as exc:  # work done ahead never fails a request
            log.warning("next_turn_prefill_failed", error=repr(exc))
            self._drop_next_turn(turn, repr(exc))
            self._report()

    def _resume_next_turn(self, turn: _NextTurn) -> bool:
        """Work out the tokens (the first time) and start from the longest
        prefix the cache holds; False when there is nothing to do (the cache
        holds it all but a token), or it could not be kept (then dropped)."""
        prefix_cache = self.prefix_cache
        assert prefix_cache is not None
        if turn.tokens is None:
            turn.tokens = next_turn_prefix(self.tokenizer, turn.messages, turn.answer)
        match = prefix_cache.index.peek(turn.tokens)
        turn.done = match.reuse if match is not None else 0
        if turn.done >= len(turn.tokens) - 1:
            self.next_turns.remove(turn)
            if len(turn.tokens) > 1:
                self._next_turn_counts["prefilled"] += 1
            self._report()
            return False
        if match is not None:  # its bytes grow with its tokens: would it fit at all?
            expected = cache_nbytes(match.value) * len(turn.tokens) // len(match.key)
            if expected > prefix_cache.index.budget_bytes:
                self._drop_next_turn(turn, "larger than the prefix cache's budget")
                self._report()
                return False
        turn.cache = (prefix_view(match.value, match.reuse) if match is not None
                      else make_prompt_cache(self.model))  # fmt: skip
        return True

    def _pause_next_turn(self) -> None:
        """A request came in: the next-turn prefill under way stores what it
        computed (that request may be this very chat's next turn) and waits;
        it resumes from the cache when the engine is idle again."""
        turn = self.next_turns[0] if self.next_turns else None
        if turn is None or turn.cache is None:
            return
        try:
            self._store_next_turn(turn)
        except Exception as exc:  # work done ahead never fails a request
            log.warning("next_turn_prefill_failed", error=repr(exc))
            self._drop_next_turn(turn, repr(exc))

    def _store_next_turn(self, turn: _NextTurn) -> bool:
        """Keep what ``turn`` computed; False if the cache would not take it."""
        cache, turn.cache = turn.cache, None
        if cache is None or turn.tokens is None or self.prefix_cache is None or not turn.done:
            return False
        return self.prefix_cache.store(turn.tokens[: turn.done], cache)

    def _drop_next_turn(self, turn: _NextTurn, why: str) -> None:
        """Give ``turn`` up, and what it computed (a paused one stored that already)."""
        log.info("next_turn_prefill_dropped", why=why, tokens_done=turn.done)
        self._next_turn_counts["dropped"] += 1
        if turn in self.next_turns:
            self.next_turns.remove(turn)
        turn.cache = None

    def _drop_next_turns(self) -> None:
        """Forget every waiting next-turn prefill, and what they computed."""
        self._next_turn_counts["dropped"] += len(self.next_turns)
        self.next_turns.clear()

    def _fail(self, job: Job, exc: BaseException) -> None:
        job.ready = len(job.text)
        self._flush(job)
        log.error("generation_failed", request_id=job.request_id, error=repr(exc))
        self._report()
        self.send(GenerationFailed(job.request_id, f"{type(exc).__name__}: {exc}"))
        self.on_finished(job.request_id, None)

    def _report(self) -> None:
        self.stats_snapshot = self.stats()
        self.send(EngineReport(self.stats_snapshot))

    def _evict_for_memory(self) -> None:
        """The memory guard's first resort: the whole prefix cache goes (and
        the next turns waiting to be prefilled into it)."""
        self._drop_next_turns()
        if self.prefix_cache is not None and len(self.prefix_cache.index):
            freed = self.prefix_cache.evict(None)
            log.warning("prefix_cache_evicted_for_memory", freed_bytes=freed)
            self.stats_snapshot = self.stats()


def _partial_stop(text: str, stop: str) -> int:
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


def default_prefix_cache_bytes(guard: MemoryGuard) -> int:
    """A quarter of the runner's memory budget, or of what the machine has
    available now when there is no budget."""
    plan = guard.plan
    if plan is not None and plan.budget_bytes is not None:
        return int(plan.budget_bytes * PREFIX_CACHE_SHARE)
    view = guard.last_view if guard.last_view is not None else guard.refresh()
    return int(view.remaining_bytes * PREFIX_CACHE_SHARE)

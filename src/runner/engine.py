"""The runner's engine: requests served side by side, with a KV prefix cache.

A request runs one of two ways:

- **alone** (:mod:`runner.solo`), through mlx-lm's ``generate_step``: the
  fastest path for one sequence, and the only one for a request with a seed
  or a model whose caches cannot be merged into a batch;
- **in a batch** (:mod:`runner.batch`), through mlx-lm's ``BatchGenerator``
  (continuous batching, as mlx_lm.server does it): a new request joins after
  its prefill, a finished one leaves, each keeps its own sampler, logits
  processors, token limit and stop.

A runner with nothing else to do serves a lone request alone. When a second
request comes while one runs alone, the lone one moves into a new batch
where it left off (its cache cut back by the one token it had computed
ahead) and the newcomer joins it. A request that cannot join a batch waits
until the batch drains, then runs alone: requests start in arrival order.

Each request samples with its own settings: mlx-lm's sampler, shared by the
requests that ask for the same (:mod:`runner.sampling`), and its own logits
processors (penalties and ``logit_bias``, a grammar for structured output
and forced tool calls (:mod:`runner.constrained`), a reasoning budget). A
chat request's output goes through its splitter (:mod:`runner.output`):
reasoning and tool calls to their own fields of the frames, the answer's
text on to the stop strings.

Every request looks up the prefix cache before it starts and, when it ends
(done or cancelled, after at least one token), stores the cache of its whole
sequence. One request's failure ends that request only. With ``kv_bits`` every
cache, alone, in a batch and in the prefix cache, is quantized
(:mod:`runner.kv_quant`).

After a chat answer, while no request waits or runs, the engine prefills the
start of that chat's next request: the conversation with the
answer as the client will send it back, and the template's header of the
next user turn (see :mod:`runner.next_turn`).

Its other parts live beside it: each request's output and end
(:mod:`runner.answer`), how long requests on an idle engine wait for company
(:mod:`runner.batch_admission`), stop strings (:mod:`runner.stops`), and the
request record (:mod:`runner.job`).

Everything here runs on the runner's main thread; the pipe-reader thread
only reads :attr:`Engine.stats_snapshot` (for Pongs, with the disk tier's live
figures: :meth:`Engine.live_stats`) and flags cancels; the disk tier has its
own writer thread (:mod:`runner.disk_cache`).
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import msgspec
import structlog

from ipc.messages import (
    EngineReport,
    EngineSettings,
    EngineStats,
    Generate,
    GenerationFailed,
    Heartbeat,
)
from runner.adapters import Adapters
from runner.answer import AnswerPath
from runner.batch import BatchPath
from runner.batch_admission import AdmissionTimer
from runner.chat_template import render_chat, render_chat_text, template_turns
from runner.constrained import constraint_processor
from runner.disk_cache import open_disk_tier
from runner.distributed import Group
from runner.faults import Faults
from runner.guard import MemoryGuard
from runner.job import Job
from runner.kv_quant import make_cache
from runner.next_turn import NextTurnPrefill
from runner.output import OutputSplitter, reasoning_budget_processor
from runner.prefill_pacing import PrefillPacer
from runner.prefix_cache import PrefixCache, PromptCache
from runner.sampling import (
    LogitsProcessor,
    Sampler,
    SamplerKey,
    TokenTexts,
    check_logprobs,
    logits_processors_for,
    model_vocab_size,
    sampler_for,
)
from runner.solo import Solo, SoloPath
from runner.speculative import Draft
from runner.vision import VisionPrompt, has_images, image_processor, vision_prompt

__all__ = ["Engine", "batchability", "build_prompt_tokens"]

log = structlog.get_logger("runner.engine")

HEARTBEAT_INTERVAL_S = 0.5
PREFIX_CACHE_SHARE = 0.25
"""The prefix cache's default budget: this share of the runner's memory
budget, or of the memory available at load when it has none."""

Send = Callable[[Any], None]


def build_prompt_tokens(tokenizer: Any, request: Generate) -> list[int]:
    """The prompt's token ids: chat-templated messages (with the request's
    tools and template arguments, see :mod:`runner.chat_template`), or raw
    text encoded as mlx-lm's ``stream_generate`` encodes it.

    A raw prompt has no template to give tools or template arguments to, nor
    an answer read for tool calls: those options need messages. Its answer
    may still be held to a ``response_format`` (a grammar needs no template).

    Raises:
        ValueError: no prompt, a chat option on a raw prompt, a tool call's
            arguments that are not JSON, a template argument that is the
            call's own; the template's own errors come through as they are."""
    if request.messages is not None:
        return render_chat(tokenizer, template_turns(request.messages), request.chat)
    if request.prompt is None:
        raise ValueError("a generate request needs a prompt or messages")
    chat = request.chat
    needs = {"tools need": bool(chat.tools), "tool_choice needs": chat.tool_choice != "auto",
             "chat_template_kwargs need": bool(chat.chat_template_kwargs)}  # fmt: skip
    for option, given in needs.items():
        if given:
            raise ValueError(f"{option} messages (a chat), not a raw prompt")
    bos = tokenizer.bos_token
    add_special = bos is None or not request.prompt.startswith(bos)
    return list(tokenizer.encode(request.prompt, add_special_tokens=add_special))


def batchability(cache: PromptCache) -> tuple[bool, str | None]:
    """Whether requests whose caches are like ``cache`` (a fresh one) can
    share a batch, and if not why."""
    unmergeable = sorted({type(c).__name__ for c in cache if not hasattr(c, "merge")})
    if unmergeable:
        return False, f"its caches ({', '.join(unmergeable)}) cannot be merged into a batch"
    return True, None


class Engine(SoloPath, BatchPath, AnswerPath):
    """Serves generation requests for one loaded model.

    Args:
        model, tokenizer: what mlx-lm loaded.
        settings: concurrency, prefix-cache and KV-quantization settings from
            the LoadModel.
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
        model_path: the model's directory: the disk tier keys its blocks by
            its files (None: no disk tier).
        adapters: the model's LoRA adapters (None: it has none). Before each
            step the model is switched to the adapter of what runs; requests
            of different adapters never share a batch, and their KV lives in
            the prefix cache's own key space per adapter.
        draft: the draft model (None: no speculative decoding). A lone
            request whose logits no processor reshapes decodes with it; a
            batch decodes without (see :mod:`runner.speculative`).
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
        model_path: Path | None = None,
        adapters: Adapters | None = None,
        draft: Draft | None = None,
    ) -> None:
        self.model = model
        self.draft = draft  # speculative decoding for lone requests (runner.speculative)
        self.adapters = adapters if adapters is not None else Adapters.none(model)
        self.group = group
        self.tokenizer = tokenizer
        self.guard = guard
        self.faults = faults
        self.send = send
        self.is_cancelled = is_cancelled
        self.on_finished = on_finished
        self.max_tokens_cap = max_tokens_cap
        self.stream_interval_s = settings.stream_interval_s
        self.kv_bits, self.kv_group_size = settings.kv_bits, settings.kv_group_size
        # Every cache a request starts from (quantized with kv_bits, see runner.kv_quant).
        self.new_cache: Callable[[], PromptCache] = functools.partial(
            make_cache, model, settings.kv_bits, settings.kv_group_size)  # fmt: skip
        self.batching, self.batching_reason = batchability(self.new_cache())
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
            disk = open_disk_tier(model, tokenizer, model_path, settings, self.new_cache,
                                  fault=faults.disk_write)  # fmt: skip
            off = disk if isinstance(disk, str) else None
            self.prefix_cache = PrefixCache(budget, settings.prefix_cache_entries,
                                            disk=disk if not isinstance(disk, str) else None,
                                            disk_off=off)  # fmt: skip
            guard.add_cleanup_hook(self._evict_for_memory)
        self.pending: deque[Job] = deque()
        self.solo: Solo | None = None
        self.batch: Any = None  # a BatchGenerator while requests run in a batch
        self.in_batch: dict[int, Job] = {}
        self._stop_tokens = [[t] for t in sorted(tokenizer.eos_token_ids)]
        self._samplers: dict[SamplerKey, Sampler] = {}
        self.vocab_size = model_vocab_size(model, tokenizer)
        # None: a model that takes no images.
        self.image_processor = image_processor(model, model_path)
        self._token_texts = TokenTexts(tokenizer)
        # XTC never removes these (as mlx_lm.server sets them): a newline, the end tokens.
        self._xtc_special = [*tokenizer.encode("\n", add_special_tokens=False),
                             *sorted(tokenizer.eos_token_ids)]  # fmt: skip
        self._steps = 0
        self.pacer = PrefillPacer(settings.prefill_chunk_s)
        self.admission = AdmissionTimer(settings.batch_wait_share)
        self._progress = 0
        self._last_beat = time.perf_counter()
        self.next_turn: NextTurnPrefill | None = None  # None: next turns are not prefilled
        if settings.next_turn_prefill and self.prefix_cache is not None:
            self.next_turn = NextTurnPrefill(model, tokenizer, self.prefix_cache, guard=guard,
                                             pacer=self.pacer, limit=self.max_concurrent,
                                             report=self._report,
                                             make_cache=self.new_cache,
                                             adapters=self.adapters)  # fmt: skip
        self.stats_snapshot = self.stats()

    # --- the outside -----------------------------------------------------------

    @property
    def idle(self) -> bool:
        """No request waits or runs (next-turn prefills may)."""
        return not self.pending and self.solo is None and not self.in_batch

    @property
    def has_work(self) -> bool:
        """A request, or a next-turn prefill, waits or runs."""
        return not self.idle or (self.next_turn is not None and bool(self.next_turn.turns))

    @property
    def active(self) -> int:
        return (self.solo is not None) + len(self.in_batch)

    def admission_wait_s(self, now: float | None = None) -> float:
        """How much longer to wait for more requests before starting those
        waiting on an idle engine (0: start now).

        They wait for company only when they would share a batch: not a
        full batch, nor a line with a request that cannot batch, nor on an
        engine that runs. How long is the admission timer's rule (see
        :mod:`runner.batch_admission`): a share of the prefill they expect,
        or the burst spread it learned, within a cap."""
        if self.solo is not None or self.batch is not None or not self._waits_for_company():
            return 0.0

        def tokens() -> int:
            return sum(self._to_compute(job) for job in self.pending)

        return self.admission.wait_s(self.pending[0].received, tokens, now)

    def _waits_for_company(self) -> bool:
        """Whether the requests waiting on an idle engine wait for more: not
        when they fill a batch, nor when one of them cannot batch."""
        batchable = all(self._batchable(job) for job in self.pending)
        batchable = batchable and len({job.request.adapter for job in self.pending}) <= 1
        return self.admission.waits_for_company(len(self.pending), self.max_concurrent, batchable)

    def _to_compute(self, job: Job) -> int:
        """The prompt tokens ``job`` will compute: what the prefix cache will not give it."""
        if job.to_compute is None:
            reuse = 0
            if job.use_cache and self.prefix_cache is not None:
                reuse = self.prefix_cache.reuse(job.cache_key, job.key_space)
            job.to_compute = len(job.prompt) - reuse
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
        if self.next_turn is not None:  # before admission looks up what the cache holds for it
            self.next_turn.pause()
        self.pending.append(job)

    def _note_arrival(self, received: float) -> None:
        """A request that comes while others run may have come just too
        late for them: the admission timer learns the burst spread from it."""
        if self.solo is not None or self.batch is not None:
            self.admission.on_late_arrival(received)

    def _note_idle_start(self, first: Job, waited: bool) -> None:
        """The engine started requests from idle, ``first`` first, after an
        admission wait or (``waited`` False) without one. Only a start that
        waited for company teaches: not one with a seeded request in line
        (it did not wait), nor one whose first request had waited behind
        another run."""
        started = (self.solo is not None and self._batchable(self.solo.job)) + len(self.in_batch)
        for job in self.pending:  # left in line: they wait for a run, not for company
            job.held = True
        self.admission.on_start(first.received, started, waited=waited and not first.held)

    def step(self) -> None:
        """Do one unit of work: start what can start, then one decode step
        (or prefill chunk) of whatever runs; with no request, a chunk of a
        next-turn prefill."""
        self._start_pending()
        started = time.perf_counter()
        if self.adapters and (self.solo is not None or self.in_batch):
            self.adapters.use(self._running()[0].request.adapter)  # they share one
        if self.solo is not None:
            self._step_solo(self.solo)
        elif self.batch is not None:
            self._step_batch(self.batch)
        elif self.next_turn is not None and self.next_turn.turns and not self.pending:
            self.next_turn.step()
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

    def clear_cache(self, disk_only: bool = False) -> tuple[int, int, int, int]:
        """Drop the prefix cache (``disk_only``: its disk tier alone); returns
        the entries and bytes dropped in RAM, then the blocks and bytes on disk."""
        if self.prefix_cache is None:
            return 0, 0, 0, 0
        if self.next_turn is not None and not disk_only:
            self.next_turn.drop_all()
        dropped = self.prefix_cache.clear(ram=not disk_only)
        self._report()
        return dropped

    def live_stats(self) -> EngineStats:
        """The last snapshot, with the disk tier's figures as they are now
        (its writer thread moves them while the engine is idle). Thread-safe."""
        snapshot, cache = self.stats_snapshot, self.prefix_cache
        if cache is None or cache.disk is None or snapshot.prefix_cache is None:
            return snapshot
        disk = cache.disk.stats()
        return msgspec.structs.replace(
            snapshot, prefix_cache=msgspec.structs.replace(snapshot.prefix_cache, disk=disk))

    def close(self, timeout_s: float = 2.0) -> None:
        """Before the process ends: the disk tier writes what is queued
        (for at most ``timeout_s``), so that the next runner finds it."""
        if self.prefix_cache is not None:
            self.prefix_cache.close(timeout_s)

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
            next_turn=None if self.next_turn is None else self.next_turn.stats(),
            kv_bits=self.kv_bits,
            kv_group_size=None if self.kv_bits is None else self.kv_group_size,
            adapters=self.adapters.references,
            adapter_switches=self.adapters.switches,
            draft=None if self.draft is None else self.draft.stats(),
        )

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
        check_logprobs(sampling)
        self.adapters.check(request.adapter)
        vision = None
        if has_images(request.messages):
            prompt, vision = self._vision_prompt(request)
        else:
            prompt = build_prompt_tokens(self.tokenizer, request)
        if not prompt:
            raise ValueError("the prompt is empty")
        # One sampler object per setting: a batch whose rows share it samples them at once.
        sampler = sampler_for(sampling, self._samplers, vocab_size=self.vocab_size,
                              xtc_special_tokens=self._xtc_special)  # fmt: skip
        splitter = None
        if request.messages is not None:  # a chat's output may hold reasoning and tool calls
            splitter = OutputSplitter(self.tokenizer, request.chat, prompt)
        processors = self._processors(request, prompt, splitter)
        job = Job(
            request=request,
            received=received,
            prompt=prompt,
            max_tokens=max_tokens,
            clamped_to=clamped_to,
            sampler=sampler,
            processors=[],
            splitter=splitter,
            guard=self.guard.start_request(request.request_id),
            detokenizer=self.tokenizer.detokenizer,
            use_cache=request.cache and self.prefix_cache is not None,
        )
        if processors:
            job.processors = [contained(job, processors)]
        job.key_space = self.adapters.space(request.adapter)
        job.vision = vision
        return job

    def _vision_prompt(self, request: Generate) -> tuple[list[int], VisionPrompt]:
        """A chat with images: its tokens and preprocessed images (runner.vision)."""
        assert request.messages is not None
        if self.image_processor is None:
            raise ValueError("the model is text-only: it takes no images (it has no vision "
                             "tower, or mlx-lm has no image processor for its family)")  # fmt: skip
        text = render_chat_text(self.tokenizer, template_turns(request.messages), request.chat)
        images = [data for m in request.messages for data in m.images or ()]
        return vision_prompt(self.tokenizer, self.image_processor, text, images,
                             between=lambda: self._announce("prefill", None))  # fmt: skip

    def prompt_length(self, request: Generate) -> int:
        """How many prompt tokens ``request`` makes as it would run (a chat's
        images as the runs of tokens they expand to).

        Raises:
            Exception: what making its prompt raises (template, images).
        """
        if has_images(request.messages):
            return len(self._vision_prompt(request)[0])
        return len(build_prompt_tokens(self.tokenizer, request))

    def _processors(
        self, request: Generate, prompt: list[int], splitter: OutputSplitter | None
    ) -> list[LogitsProcessor]:
        """The request's logits processors, in the order they must act: the
        penalties and ``logit_bias`` first (they reshape the model's
        distribution), then the grammar's mask (it has the last word on what
        may come), then a scripted output's (the ``script_text`` fault: it
        overrides the model and the grammar, so that a test makes a model
        write what it must), then the reasoning budget (it forces the end of
        the thinking, which the grammar lets through inside it; last, so that
        it cuts a scripted think block too).

        Raises:
            ValueError: a setting out of range, a format or schema the
                grammar cannot constrain."""
        processors = logits_processors_for(request.sampling, vocab_size=self.vocab_size)
        constraint = constraint_processor(request.chat, self.tokenizer, self.vocab_size, prompt)
        if constraint is not None:
            processors.append(constraint)
        script = self.faults.script_processor(self.tokenizer)
        if script is not None:
            processors.append(script)
        budget = request.sampling.max_reasoning_tokens
        if splitter is not None and budget is not None:
            limit = reasoning_budget_processor(splitter, self.tokenizer, budget)
            if limit is not None:
                processors.append(limit)
        return processors

    def _batchable(self, job: Job) -> bool:
        return self.batching and job.request.sampling.seed is None and job.vision is None

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
            more = more and self.pending[1].request.adapter == job.request.adapter
            if self._batchable(job) and more:
                self._open_batch()
            else:
                self.pending.popleft()
                self._start_solo(job)
                return True
        if not self._batchable(job) or self.active >= self.max_concurrent:
            return False  # it waits for room, or for the batch to drain
        if any(other.request.adapter != job.request.adapter for other in self._running()):
            return False  # another adapter runs: it waits for the batch to drain
        if self.solo is not None and not self._move_solo_to_batch(self.solo):
            return False
        self.pending.popleft()
        self._join_batch(job)
        return True

    def _fetch(self, job: Job) -> PromptCache | None:
        if not job.use_cache or self.prefix_cache is None:
            return None
        cache, reused = self.prefix_cache.fetch(job.cache_key, job.key_space)
        job.cached_tokens = reused
        return cache

    def _announce(self, phase: str, step_s: float | None) -> None:
        """A heartbeat before a step that may be long: at the usual interval,
        and always before one expected to outlast it (the supervisor gives a
        step a multiple of the time stated)."""
        now = time.perf_counter()
        long_step = step_s is not None and step_s >= HEARTBEAT_INTERVAL_S
        if long_step or now - self._last_beat >= HEARTBEAT_INTERVAL_S:
            self._last_beat = now
            self.send(Heartbeat(phase, self._progress, self.guard.figures, step_s))

    # --- running requests and reports -----------------------------------------

    def _running(self) -> list[Job]:
        jobs = list(self.in_batch.values())
        if self.solo is not None:
            jobs.append(self.solo.job)
        return jobs

    def _report(self) -> None:
        self.stats_snapshot = self.stats()
        self.send(EngineReport(self.stats_snapshot))

    def _evict_for_memory(self) -> None:
        """The memory guard's first resort: the whole prefix cache goes (and
        the next turns waiting to be prefilled into it)."""
        if self.next_turn is not None:
            self.next_turn.drop_all()
        if self.prefix_cache is not None and len(self.prefix_cache.index):
            freed = self.prefix_cache.evict(None)
            log.warning("prefix_cache_evicted_for_memory", freed_bytes=freed)
            self.stats_snapshot = self.stats()


def contained(job: Job, processors: list[LogitsProcessor]) -> LogitsProcessor:
    """``job``'s processors as one, called once per position of its sequence,
    whose error stays the job's.

    Once per position: a lone request that moves into a batch has its
    processors called again for the position ``generate_step`` computed
    ahead (the batch computes it again). Processors that keep state (a
    grammar's matcher consumes a token a call) would take that token twice,
    so the call is not made: the change they made to the logits the first
    time (a mask, a bias: their output less their input) is made again. The
    position is the length of the sequence they are shown (the whole
    sequence on both paths, see :func:`runner.solo.whole_sequence`).

    Error kept: what they raise is kept on the job (and raised when its
    token comes out) and the logits pass unchanged. Raised inside a batch
    step, it would fail every request in the batch (the step's state is
    lost)."""
    last: tuple[int, mx.array, mx.array] | None = None  # position, logits in, logits out

    def run(tokens: mx.array, logits: mx.array) -> mx.array:
        nonlocal last
        if job.processor_error is not None:
            return logits
        position = tokens.size
        if last is not None and last[0] == position:
            return logits + (last[2] - last[1])
        given = logits
        logits = mx.stop_gradient(given)  # a node of its own: mlx-lm's penalties write in place
        try:
            for processor in processors:
                logits = processor(tokens, logits)
        except Exception as exc:
            job.processor_error = exc
            return given
        last = (position, given, logits)
        return logits

    return run


def default_prefix_cache_bytes(guard: MemoryGuard) -> int:
    """A quarter of the runner's memory budget, or of what the machine has
    available now when there is no budget."""
    plan = guard.plan
    if plan is not None and plan.budget_bytes is not None:
        return int(plan.budget_bytes * PREFIX_CACHE_SHARE)
    view = guard.last_view if guard.last_view is not None else guard.refresh()
    return int(view.remaining_bytes * PREFIX_CACHE_SHARE)

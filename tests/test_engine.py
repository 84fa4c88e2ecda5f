"""The runner's engine in process: the prefix cache and requests served side by side.

Greedy outputs are the yardstick: a request must produce the same tokens
whether its prefix came from the cache or was computed, and whether it ran
alone or in a batch (on the fp32 builtins, where batching is exact).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tool_parsers import json_tools

from ipc.messages import (
    ChatMessage,
    ChatOptions,
    EngineReport,
    EngineSettings,
    Generate,
    GenerationDone,
    GenerationFailed,
    Heartbeat,
    MemoryPlan,
    ResponseFormat,
    SamplingParams,
    TextChunk,
)
from runner.batch_admission import ADMISSION_FIRST_S, AdmissionTimer
from runner.engine import Engine, build_prompt_tokens
from runner.faults import Faults
from runner.guard import MemoryGuard
from runner.loading import LoadedModel, load_model
from runner.next_turn import next_turn_prefix
from runner.stops import partial_stop

PROMPTS = [
    "The supervisor restarts a runner that crashed",
    "Memory comes back when the process dies",
    "A prefix cache saves the prompt's work",
    "Four clients at once share one model",
    "Unload escalates from a message to SIGKILL",
]


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("builtin:tiny", lambda phase, done, total: None)


@pytest.fixture(scope="module")
def qwen3() -> LoadedModel:
    return load_model("builtin:tiny-qwen3", lambda phase, done, total: None)


class Harness:
    """An engine with its frames collected per request, and cancels by id."""

    def __init__(self, model: LoadedModel, settings: EngineSettings | None = None,
                 guard: MemoryGuard | None = None, faults: str = "") -> None:  # fmt: skip
        self.frames: list[Any] = []
        self.cancelled: set[int] = set()
        self.finished: list[int] = []
        self.engine = Engine(
            model.model,
            model.tokenizer,
            settings or EngineSettings(),
            guard=guard or MemoryGuard(),
            faults=Faults(faults),
            send=self.frames.append,
            is_cancelled=self.cancelled.__contains__,
            on_finished=lambda request_id, tokens: self.finished.append(request_id),
            max_tokens_cap=None,
        )
        self.next_id = 1

    def submit(self, prompt: str | list[ChatMessage], max_tokens: int = 24,
               received: float | None = None, **fields: Any) -> int:  # fmt: skip
        request_id, self.next_id = self.next_id, self.next_id + 1
        sampling = SamplingParams(max_tokens=max_tokens, **fields.pop("sampling", {}))
        if isinstance(prompt, str):
            request = Generate(request_id, prompt=prompt, sampling=sampling, **fields)
        else:
            request = Generate(request_id, messages=prompt, sampling=sampling, **fields)
        self.engine.submit(request, received)
        return request_id

    def run(self, until: Callable[[], bool] | None = None, limit: int = 100_000) -> None:
        """Step until idle (or ``until`` holds)."""
        for _ in range(limit):
            if self.engine.idle or (until is not None and until()):
                return
            self.engine.step()
        raise AssertionError("the engine did not finish")

    def settle(self, limit: int = 100_000) -> None:
        """Step until no request and no next-turn prefill is left."""
        for _ in range(limit):
            if not self.engine.has_work:
                return
            self.engine.step()
        raise AssertionError("the engine did not settle")

    def tokens_of(self, request_id: int) -> int:
        """Tokens the request's frames have covered so far."""
        chunks = [f for f in self.frames if isinstance(f, TextChunk) and f.request_id == request_id]
        return chunks[-1].generation_tokens if chunks else 0

    def made(self, request_id: int) -> int:
        """Tokens the request has made so far, sent or not (frames lag behind
        by up to ``stream_interval_s``: a fast model makes all of a short
        request's tokens before its second frame)."""
        for job in self.engine._running():
            if job.request_id == request_id:
                return len(job.tokens)
        return self.tokens_of(request_id)

    def text(self, request_id: int) -> str:
        return "".join(
            f.text for f in self.frames if isinstance(f, TextChunk) and f.request_id == request_id
        )

    def done(self, request_id: int) -> GenerationDone:
        (done,) = [f for f in self.frames
                   if isinstance(f, GenerationDone) and f.request_id == request_id]  # fmt: skip
        return done


def alone(model: LoadedModel, prompt: str | list[ChatMessage], max_tokens: int = 24,
          **fields: Any) -> tuple[str, GenerationDone]:  # fmt: skip
    """The request served by a fresh engine with no cache: the reference output."""
    h = Harness(model, EngineSettings(max_concurrent=1, prefix_cache=False))
    request_id = h.submit(prompt, max_tokens, **fields)
    h.run()
    return h.text(request_id), h.done(request_id)


def chat_turns(
    model: LoadedModel, harness: Harness, turns: int
) -> Iterator[tuple[str, str, GenerationDone]]:
    """A conversation: each turn appends the answer and a new user line.
    Yields (our text, the uncached reference's text, our GenerationDone)."""
    history = [ChatMessage("system", "You are terse. " * 20)]
    for turn in range(turns):
        history.append(ChatMessage("user", f"Question {turn}: {PROMPTS[turn % len(PROMPTS)]}?"))
        request_id = harness.submit(list(history), max_tokens=12)
        harness.run()
        text = harness.text(request_id)
        reference, _ = alone(model, list(history), max_tokens=12)
        yield text, reference, harness.done(request_id)
        history.append(ChatMessage("assistant", text))


@pytest.mark.parametrize("name", ["tiny", "qwen3"])
def test_multi_turn_chat_reuses_the_cache_and_matches_the_uncached_output(
    name: str, request: pytest.FixtureRequest
) -> None:
    model: LoadedModel = request.getfixturevalue(name)
    h = Harness(model)
    turns = list(chat_turns(model, h, 5))
    for turn, (text, reference, done) in enumerate(turns):
        assert text == reference, f"turn {turn}"
        assert done.finish_reason == "length"
    assert turns[0][2].cached_tokens == 0
    for turn in range(1, len(turns)):
        done, before = turns[turn][2], turns[turn - 1][2]
        # At least the last turn's whole prompt came from the cache (the answer's
        # text may tokenise differently from the tokens generated: the cache is
        # cut back to where they differ).
        assert before.prompt_tokens <= done.cached_tokens < done.prompt_tokens, (turn, done)
    stats = h.engine.stats().prefix_cache
    assert stats is not None and stats.hits == 4 and stats.misses == 1
    # At most one entry per turn: an entry whose key the next one extends is
    # superseded (the answer re-tokenised as generated), the others stay.
    assert 1 <= stats.entries <= 5 and stats.evictions == 0


@pytest.mark.parametrize("name", ["tiny", "qwen3"])
def test_a_prompt_that_diverges_midway_is_trimmed_to_the_shared_prefix(
    name: str, request: pytest.FixtureRequest
) -> None:
    model: LoadedModel = request.getfixturevalue(name)
    h = Harness(model)
    base = " ".join(PROMPTS)
    first = h.submit(base + " and then the end.", max_tokens=8)
    h.run()
    stored = build_prompt_tokens(model.tokenizer, Generate(0, prompt=base + " and then the end."))
    index = h.engine.prefix_cache.index  # type: ignore[union-attr]
    (entry_key,) = index.keys()  # the prompt and the 8 tokens generated
    assert list(entry_key[: len(stored)]) == stored and len(entry_key) == len(stored) + 8
    assert h.done(first).cached_tokens == 0
    entry = index.peek([*entry_key, 0])
    assert entry is not None and entry.reuse == len(entry_key)
    snapshot = [mx.array(layer.keys) for layer in entry.value]  # what the entry held

    other = base + " but a different ending here."
    second = h.submit(other, max_tokens=16)
    h.run()
    shared = _common_prefix(stored, build_prompt_tokens(model.tokenizer,
                                                        Generate(0, prompt=other)))  # fmt: skip
    assert 0 < shared < len(stored)
    assert h.done(second).cached_tokens == shared
    reference, _ = alone(model, other, max_tokens=16)
    assert h.text(second) == reference
    # The stored entry was read, never written: its arrays hold what they held.
    for layer, before in zip(entry.value, snapshot, strict=True):
        assert mx.array_equal(layer.keys, before).item()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_requests_in_a_batch_give_the_tokens_they_give_alone(tiny: LoadedModel) -> None:
    h = Harness(tiny, EngineSettings(prefix_cache=False))
    lengths = [30, 12, 45, 20, 8]
    ids = [h.submit(p, n) for p, n in zip(PROMPTS, lengths, strict=True)]
    h.run()
    for request_id, prompt, n in zip(ids, PROMPTS, lengths, strict=True):
        done = h.done(request_id)
        assert done.batched and done.generation_tokens == n
        assert h.text(request_id) == alone(tiny, prompt, n)[0]
    assert h.engine.stats().active_requests == 0


def test_a_lone_request_moves_into_a_batch_where_it_left_off(tiny: LoadedModel) -> None:
    h = Harness(tiny, EngineSettings(prefix_cache=False))
    first = h.submit(PROMPTS[0], 40)
    h.run(until=lambda: h.made(first) >= 10)
    assert h.engine.solo is not None  # alone so far: the fast path
    second = h.submit(PROMPTS[1], 20)
    h.run()
    assert h.done(first).batched and h.done(second).batched
    assert h.text(first) == alone(tiny, PROMPTS[0], 40)[0]
    assert h.text(second) == alone(tiny, PROMPTS[1], 20)[0]


def test_text_frames_carry_the_first_token_at_once_then_coalesce(tiny: LoadedModel) -> None:
    every = Harness(tiny, EngineSettings(prefix_cache=False, stream_interval_s=0.0))
    one = every.submit(PROMPTS[0], 30)
    every.run()
    assert [f.generation_tokens for f in every.frames if isinstance(f, TextChunk)] == list(
        range(1, 31)
    )
    held = Harness(tiny, EngineSettings(prefix_cache=False, stream_interval_s=3600.0))
    two = held.submit(PROMPTS[0], 30)
    held.run()
    frames = [f for f in held.frames if isinstance(f, TextChunk)]
    assert [f.generation_tokens for f in frames] == [1, 30]  # the first, then all with the end
    assert held.text(two) == every.text(one)
    assert held.done(two).generation_tokens == 30


def test_held_text_goes_out_before_a_newcomers_prefill(tiny: LoadedModel) -> None:
    h = Harness(tiny, EngineSettings(prefix_cache=False, stream_interval_s=3600.0))
    first = h.submit(PROMPTS[0], 40)
    h.run(until=lambda: h.engine.solo is not None and len(h.engine.solo.job.tokens) >= 10)
    made = len(h.engine.solo.job.tokens) if h.engine.solo is not None else 0
    assert h.tokens_of(first) == 1  # the rest is held
    h.submit(PROMPTS[1], 20)
    h.engine.step()  # the newcomer joins (and prefills): the first's text went out before
    assert h.tokens_of(first) >= made
    h.run()
    assert h.text(first) == alone(tiny, PROMPTS[0], 40)[0]


@pytest.mark.parametrize("together", [False, True])
def test_a_stop_string_ends_the_text_before_it_and_none_of_it_is_sent(
    tiny: LoadedModel, together: bool
) -> None:
    full, _ = alone(tiny, PROMPTS[2], 40)
    start = len(full) // 2
    stop = full[start : start + 4]  # usually spans tokens: its start is held back
    cut = full[: full.find(stop)]
    h = Harness(tiny, EngineSettings(prefix_cache=False, stream_interval_s=0.0))
    ids = [h.submit(PROMPTS[2], 40, sampling={"stop": (stop, "never appears")})]
    if together:
        ids.append(h.submit(PROMPTS[0], 40))
    h.run()
    assert h.text(ids[0]) == cut  # frames only add: nothing past the cut went out
    done = h.done(ids[0])
    assert done.finish_reason == "stop" and done.generation_tokens < 40
    assert done.batched == together
    if together:
        assert h.text(ids[1]) == alone(tiny, PROMPTS[0], 40)[0]


def test_text_held_back_for_a_stop_string_that_never_comes_is_sent_at_the_end(
    tiny: LoadedModel,
) -> None:
    full, _ = alone(tiny, PROMPTS[2], 20)
    h = Harness(tiny, EngineSettings(prefix_cache=False, stream_interval_s=0.0))
    request_id = h.submit(PROMPTS[2], 20, sampling={"stop": (full[-1] + "\x00",)})
    h.run()
    assert h.text(request_id) == full
    assert h.done(request_id).finish_reason == "length"


def test_an_empty_stop_string_fails_the_request_as_invalid(tiny: LoadedModel) -> None:
    h = Harness(tiny)
    request_id = h.submit(PROMPTS[0], 5, sampling={"stop": ("",)})
    (failed,) = [f for f in h.frames if isinstance(f, GenerationFailed)]
    assert failed.request_id == request_id and "stop string" in failed.error
    assert failed.invalid_request  # the supervisor answers bad_request (HTTP 400), not 500


def test_the_first_visible_text_goes_out_at_once_even_after_held_text(tiny: LoadedModel) -> None:
    every = Harness(tiny, EngineSettings(prefix_cache=False, stream_interval_s=0.0))
    every.submit(PROMPTS[3], 30)
    every.run()
    first = next(f.text for f in every.frames if isinstance(f, TextChunk) and f.text)
    # The first token's text is all the start of a stop string: held back, sent with the next.
    held = Harness(tiny, EngineSettings(prefix_cache=False, stream_interval_s=3600.0))
    request_id = held.submit(PROMPTS[3], 30, sampling={"stop": (first + "\x00",)})
    held.run()
    shown = [f for f in held.frames if isinstance(f, TextChunk) and f.text]
    assert shown[0].generation_tokens < 30  # not held for the interval: out when it was known
    assert held.text(request_id) == every.text(1)


@pytest.mark.parametrize(
    ("text", "stop", "held"),
    [("abc", "cde", 1), ("abcd", "cde", 2), ("abcd", "xyz", 0), ("aaa", "aab", 2),
     ("xaba", "abab", 3), ("", "ab", 0), ("ab", "ab", 0)],
)  # fmt: skip
def test_partial_stop_is_the_longest_end_that_begins_the_stop(text: str, stop: str,
                                                               held: int) -> None:  # fmt: skip
    assert partial_stop(text, stop) == held


def test_a_request_cancelled_in_a_batch_ends_alone(tiny: LoadedModel) -> None:
    h = Harness(tiny)
    ids = [h.submit(p, 40) for p in PROMPTS[:3]]
    h.run(until=lambda: h.made(ids[1]) >= 5)
    h.cancelled.add(ids[1])
    h.run()
    assert h.done(ids[1]).finish_reason == "cancelled"
    assert 5 <= h.done(ids[1]).generation_tokens < 40
    for request_id in (ids[0], ids[2]):
        assert h.done(request_id).generation_tokens == 40
    assert h.text(ids[2]) == alone(tiny, PROMPTS[2], 40)[0]
    assert sorted(h.finished) == sorted(ids)


def test_one_requests_error_ends_that_request_not_the_batch(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness(tiny, EngineSettings(prefix_cache=False))
    ids = [h.submit(p, 30) for p in PROMPTS[:3]]
    h.run(until=lambda: h.made(ids[0]) >= 3)
    victim = next(job for job in h.engine.in_batch.values() if job.request_id == ids[1])

    def broken(token: int) -> None:
        raise RuntimeError("detokenizer broke")

    monkeypatch.setattr(victim.detokenizer, "add_token", broken)
    h.run()
    (failed,) = [f for f in h.frames if isinstance(f, GenerationFailed)]
    assert failed.request_id == ids[1] and "detokenizer broke" in failed.error
    for request_id, prompt in ((ids[0], PROMPTS[0]), (ids[2], PROMPTS[2])):
        assert h.done(request_id).generation_tokens == 30
        assert h.text(request_id) == alone(tiny, prompt, 30)[0]


def test_a_seeded_request_runs_alone_and_is_reproducible(tiny: LoadedModel) -> None:
    h = Harness(tiny, EngineSettings(prefix_cache=False))
    sampling = {"temperature": 1.0, "seed": 7}
    ids = [h.submit(PROMPTS[0], 20), h.submit(PROMPTS[1], 20, sampling=sampling),
           h.submit(PROMPTS[2], 20)]  # fmt: skip
    h.run()
    assert not h.done(ids[1]).batched
    assert h.text(ids[1]) == alone(tiny, PROMPTS[1], 20, sampling=sampling)[0]
    assert h.text(ids[0]) == alone(tiny, PROMPTS[0], 20)[0]


def test_cache_opt_out_and_switch(tiny: LoadedModel) -> None:
    h = Harness(tiny)
    for _ in range(2):
        request_id = h.submit(PROMPTS[0], 8, cache=False)
        h.run()
        assert h.done(request_id).cached_tokens == 0
    stats = h.engine.stats().prefix_cache
    assert stats is not None and (stats.entries, stats.hits, stats.misses) == (0, 0, 0)
    off = Harness(tiny, EngineSettings(prefix_cache=False))
    assert off.engine.stats().prefix_cache is None


def test_the_cache_stays_within_its_budget(tiny: LoadedModel) -> None:
    one = Harness(tiny)
    request_id = one.submit(PROMPTS[0], 16)
    one.run()
    entry_bytes = one.engine.stats().prefix_cache.bytes  # type: ignore[union-attr]
    budget = int(entry_bytes * 2.5)
    h = Harness(tiny, EngineSettings(prefix_cache_bytes=budget))
    for prompt in PROMPTS:
        h.submit(prompt, 16)
        h.run()
        stats = h.engine.stats().prefix_cache
        assert stats is not None and stats.bytes <= budget
    assert stats.evictions >= 2 and stats.entries <= 2
    reports = [f for f in h.frames if isinstance(f, EngineReport)]
    assert all(r.engine.prefix_cache.bytes <= budget for r in reports)  # type: ignore[union-attr]
    assert one.done(request_id).finish_reason == "length"


def test_the_memory_guard_frees_the_prefix_cache_first(tiny: LoadedModel) -> None:
    total = 64 << 30
    guard = MemoryGuard(MemoryPlan(total_bytes=total, budget_bytes=1 << 40))
    h = Harness(tiny, guard=guard)
    h.submit(PROMPTS[0], 8)
    h.run()
    assert h.engine.stats().prefix_cache.entries == 1  # type: ignore[union-attr]
    guard.emergency_cleanup("test")
    assert h.engine.stats().prefix_cache.entries == 0  # type: ignore[union-attr]


def test_the_status_says_why_a_model_cannot_batch(tiny: LoadedModel) -> None:
    h = Harness(tiny, EngineSettings(max_concurrent=1))
    stats = h.engine.stats()
    assert (stats.batching, stats.max_concurrent) == (False, 1)
    assert stats.batching_reason == "max_concurrent is 1"
    ids = [h.submit(p, 10) for p in PROMPTS[:2]]
    h.run()
    assert not h.done(ids[0]).batched and not h.done(ids[1]).batched


def test_a_cancel_ends_a_request_wherever_it_waits_and_the_first_in_a_batch_keeps_its_cache(
    tiny: LoadedModel,
) -> None:
    h = Harness(tiny)
    first, second = h.submit(PROMPTS[0], 200), h.submit(PROMPTS[1], 200)  # batch uids 0, 1
    seeded = h.submit(PROMPTS[2], 5, sampling={"temperature": 1.0, "seed": 3})  # waits: alone
    behind = h.submit(PROMPTS[3], 5)  # waits behind the seeded one
    h.run(until=lambda: h.made(first) >= 5)
    h.cancelled.update({behind, first})
    h.engine.step()
    assert h.done(behind).finish_reason == "cancelled"  # at once, not after the batch
    assert h.done(first).finish_reason == "cancelled"
    h.run()
    assert h.done(second).generation_tokens == 200 and h.done(seeded).generation_tokens == 5
    stats = h.engine.stats().prefix_cache
    assert stats is not None and stats.entries == 3  # first (uid 0), second and seeded


def test_a_lone_request_waits_for_company_a_share_of_its_expected_prefill(
    tiny: LoadedModel,
) -> None:
    h = Harness(tiny, EngineSettings(prefix_cache=False))
    first = h.submit("no estimate yet: " * 4, max_tokens=2)
    h.engine.pending[0].received = now = time.perf_counter()
    assert h.engine.admission_wait_s(now) == ADMISSION_FIRST_S  # nothing measured yet
    h.run()
    rate = h.engine.admission.prefill_tps
    assert rate is not None and rate > 0  # measured on that prefill
    rate = 25.0  # as slow as a big model: a wait worth having
    _measured(h, rate)
    h.submit("the same length of prompt, again: " * 4, max_tokens=2)
    h.engine.pending[0].received = time.perf_counter()  # (however slow this machine is now)
    now = h.engine.pending[0].received  # one clock for both readings, however slow the submit
    wait = h.engine.admission_wait_s(now)
    prompt = len(h.engine.pending[0].prompt)
    assert 0.0 < wait == pytest.approx(min(0.05, 0.02 * prompt / rate))
    # A second request is one more prefill to share: the wait grows (to the cap).
    h.submit("a second request, as long as the first: " * 4, max_tokens=2)
    both = sum(len(job.prompt) for job in h.engine.pending)
    longer = h.engine.admission_wait_s(now)
    assert wait < longer == pytest.approx(min(0.05, 0.02 * both / rate))
    # A full batch starts at once.
    h.engine.max_concurrent = 3
    h.submit("a third fills the batch", max_tokens=2)
    assert h.engine.admission_wait_s() == 0.0
    h.run()
    assert h.done(first).finish_reason == "length"
    # Prefills in a batch feed the estimate too: the first round can wait.
    batched = Harness(tiny, EngineSettings(prefix_cache=False))
    ids = [batched.submit(f"request {i} comes with the others: " * 3, max_tokens=2) for i in (1, 2)]
    batched.run()
    assert all(batched.done(i).batched for i in ids)
    assert batched.engine.admission.prefill_tps is not None
    # A model that cannot batch never waits.
    one = Harness(tiny, EngineSettings(max_concurrent=1, prefix_cache=False))
    _measured(one, rate)
    one.submit("alone: " * 8, max_tokens=2)
    assert one.engine.admission_wait_s() == 0.0
    # Nor one told not to.
    never = Harness(tiny, EngineSettings(prefix_cache=False, batch_wait_share=0.0))
    _measured(never, rate)
    never.submit("alone: " * 8, max_tokens=2)
    assert never.engine.admission_wait_s() == 0.0


# --- next-turn prefill -------------------------------------------------------------


def _prompt(model: LoadedModel, messages: list[ChatMessage]) -> list[int]:
    return build_prompt_tokens(model.tokenizer, Generate(0, messages=messages))


@pytest.mark.parametrize("name", ["tiny", "qwen3"])
def test_an_idle_engine_prefills_the_next_turn_and_the_turn_computes_only_its_user_line(
    name: str, request: pytest.FixtureRequest
) -> None:
    model: LoadedModel = request.getfixturevalue(name)
    h = Harness(model)
    history = [ChatMessage("system", "You are terse. " * 20),
               ChatMessage("user", f"Question 0: {PROMPTS[0]}?")]  # fmt: skip
    first = h.submit(list(history), max_tokens=12)
    h.run()
    stats = h.engine.stats().next_turn
    assert stats is not None and stats.pending == 1 and stats.prefilled == 0
    h.settle()
    stats = h.engine.stats().next_turn
    assert stats is not None and (stats.pending, stats.prefilled, stats.dropped) == (0, 1, 0)
    ahead = next_turn_prefix(model.tokenizer, history, h.text(first))
    assert h.engine.prefix_cache is not None and ahead in h.engine.prefix_cache.index
    assert stats.tokens > 0
    for turn in (1, 2):
        history += [ChatMessage("assistant", h.text(h.next_id - 1)),
                    ChatMessage("user", f"Question {turn}: {PROMPTS[turn]}?")]  # fmt: skip
        prompt = _prompt(model, history)
        ahead = next_turn_prefix(model.tokenizer, history[:-2], history[-2].content)
        assert prompt[: len(ahead)] == ahead  # what was prefilled is where the turn starts
        request_id = h.submit(list(history), max_tokens=12)
        h.run()
        done = h.done(request_id)
        # Only the user line and the template's turn markers around it were computed.
        assert done.cached_tokens == len(ahead), (turn, done)
        assert done.prompt_tokens - done.cached_tokens < 40
        assert h.text(request_id) == alone(model, list(history), max_tokens=12)[0]
        h.settle()
    assert h.engine.stats().next_turn.prefilled == 3  # type: ignore[union-attr]


def test_a_request_that_comes_in_goes_first_and_takes_what_was_prefilled(
    tiny: LoadedModel,
) -> None:
    h = Harness(tiny)
    history = [ChatMessage("system", "You are terse. " * 40), ChatMessage("user", "Hi?")]
    first = h.submit(list(history), max_tokens=24)
    h.run()
    h.engine.pacer.rate_tps = 40.0  # a slow model: next-turn chunks of a few tokens
    h.engine.step()  # one chunk of the next turn
    assert h.engine.next_turn is not None
    turn = h.engine.next_turn.turns[0]
    assert turn.tokens is not None and 0 < turn.done < len(turn.tokens)
    partial = turn.done
    history += [ChatMessage("assistant", h.text(first)), ChatMessage("user", "More?")]
    second = h.submit(list(history), max_tokens=8)
    h.engine.step()  # the request starts at once, from what the chunk computed
    assert h.engine.solo is not None and h.engine.solo.job.request_id == second
    h.run()
    assert h.done(second).cached_tokens == partial
    assert h.text(second) == alone(tiny, list(history), max_tokens=8)[0]
    # The first chat's next turn was this request: resumed, it finds it all in the cache.
    h.settle()
    stats = h.engine.stats().next_turn
    assert stats is not None and stats.prefilled == 2 and stats.dropped == 0


def test_next_turn_prefill_is_only_for_chats_that_use_the_cache_and_gives_way_to_memory(
    tiny: LoadedModel,
) -> None:
    chat = [ChatMessage("user", "Hi?")]
    h = Harness(tiny)
    h.submit(PROMPTS[0], 8)  # a raw prompt: no turns
    h.submit(chat, 8, cache=False)  # opted out
    h.run()
    assert not h.engine.has_work
    assert h.engine.stats().next_turn == h.engine.stats().next_turn.__class__()
    off = Harness(tiny, EngineSettings(next_turn_prefill=False))
    off.submit(chat, 8)
    off.run()
    assert not off.engine.has_work and off.engine.stats().next_turn is None
    assert Harness(tiny, EngineSettings(prefix_cache=False)).engine.stats().next_turn is None
    # Under memory pressure (the warning threshold passed) it is dropped, not run.
    guard = MemoryGuard(MemoryPlan(total_bytes=64 << 30, threshold_pct=0.0))
    pressed = Harness(tiny, guard=guard)
    pressed.submit(chat, 8)
    pressed.run()
    pressed.settle()
    stats = pressed.engine.stats().next_turn
    assert stats is not None and (stats.prefilled, stats.tokens, stats.dropped) == (0, 0, 1)
    # Past max_concurrent answered chats waiting, the oldest is dropped.
    few = Harness(tiny, EngineSettings(max_concurrent=2))
    for i in range(3):
        few.submit([ChatMessage("user", f"Question {i}?")], 4)
    few.run()
    stats = few.engine.stats().next_turn
    assert stats is not None and (stats.pending, stats.dropped) == (2, 1)
    few.settle()
    assert few.engine.stats().next_turn.prefilled == 2  # type: ignore[union-attr]


def test_the_first_wait_is_waited_once_even_when_no_prefill_was_long_enough_to_time(
    tiny: LoadedModel,
) -> None:
    """Prefills of a few tokens are too short to give a rate; the runner's
    first-prefill wait must not come back for every request after them."""
    h = Harness(tiny, EngineSettings(prefix_cache=False))
    h.submit("hi", max_tokens=1)
    h.engine.pending[0].received = now = time.perf_counter()
    assert h.engine.admission_wait_s(now) == ADMISSION_FIRST_S
    h.run()
    assert h.engine.admission.prefill_tps is None  # too short to time
    h.submit("hi", max_tokens=1)
    h.engine.pending[0].received = time.perf_counter()
    assert h.engine.admission_wait_s() == 0.0


def _learn_burst(h: Harness, spread: float) -> None:
    """Teach ``h``'s idle engine a burst spread: a request starts alone, one
    sent with it comes ``spread`` later."""
    sent = time.perf_counter() - 0.010
    first = h.submit("the first of a burst", max_tokens=4, received=sent)
    h.engine.step()  # it starts alone: nobody else had come
    assert h.engine.solo is not None
    # The second reached the runner before that start, but the main loop took
    # it off the queue after: just too late all the same.
    h.submit("came late", max_tokens=4, received=sent + spread)
    assert h.engine.admission.burst_s == pytest.approx(spread)
    h.run()
    assert h.done(first).finish_reason == "length"


def _lone_wait(h: Harness, expected_s: float = 0.04, new: bool = True) -> float:
    """The admission wait of a lone request (``new``: submitted now, after
    the one before it has run) expected to prefill in ``expected_s``, as the
    engine's admission timer gives it with all it has learned. The timer is
    asked directly: through the engine, the prefill expected would follow the
    rate this machine measured."""
    if new:
        h.run()  # the one before starts, with nobody after it
        h.submit("a lone request", max_tokens=1, received=time.perf_counter())
    admission, received = h.engine.admission, h.engine.pending[0].received
    rate = admission.prefill_tps
    assert rate is not None
    # The engine asks the timer the same question with the tokens it will compute.
    engine_wait = h.engine.admission_wait_s(received)
    to_compute = h.engine.pending[0].to_compute
    assert to_compute is not None, "the engine did not ask the timer"
    assert engine_wait == admission.wait_s(received, lambda: to_compute, received)
    return admission.wait_s(received, lambda: expected_s * rate, received)


def _measured(h: Harness, rate: float) -> None:
    """Give ``h``'s engine a fresh admission timer (with its wait share)
    that has measured one prefill, at ``rate`` tokens/s: a real prefill's
    rate is this machine's, however slow or fast it is now."""
    timer = AdmissionTimer(h.engine.admission.wait_share)
    timer.record_prefill(100, 100 / rate)
    h.engine.admission = timer


def test_a_request_just_too_late_for_its_company_teaches_the_next_start_to_wait(
    tiny: LoadedModel,
) -> None:
    """Clients that send together reach a fast model's runner milliseconds
    apart, longer than 2% of its prefill: the one that came after the others
    had started teaches the engine to wait that long (within the prefill it
    expects), and lone starts that nobody comes late for unlearn it by halves."""
    h = Harness(tiny, EngineSettings(prefix_cache=False))
    h.submit("a first prefill, to have a rate: " * 3, max_tokens=1)
    h.run()
    assert h.engine.admission.burst_s == 0.0
    _learn_burst(h, 0.006)
    assert _lone_wait(h) == pytest.approx(0.006)
    # never longer than the prefill it expects, which is all a latecomer would wait
    assert _lone_wait(h, 0.002, new=False) == pytest.approx(0.002)
    assert _lone_wait(h) == pytest.approx(0.003)
    assert _lone_wait(h) == pytest.approx(0.0015)
    # and without the burst (a timer that learned none), 2% of the expected prefill, as before
    _measured(h, 1000.0)
    assert _lone_wait(h, new=False) == pytest.approx(0.02 * 0.04)


def test_bursts_the_wait_caught_whole_keep_it_and_only_lone_starts_unlearn_it(
    tiny: LoadedModel,
) -> None:
    """A wait that caught all of a burst did its job: the next burst needs
    it as much. Only lone requests (nobody came) halve it."""
    h = Harness(tiny, EngineSettings(prefix_cache=False))
    h.submit("a first prefill, to have a rate: " * 3, max_tokens=1)
    h.run()
    _learn_burst(h, 0.006)
    for _ in range(3):  # bursts, each caught whole by the wait
        now = time.perf_counter()
        ids = [h.submit(f"client {i} of a burst", max_tokens=2, received=now + 0.002 * i)
               for i in range(3)]  # fmt: skip
        h.run()
        assert all(h.done(i).batched for i in ids)
        assert h.engine.admission.burst_s == pytest.approx(0.006)
    assert _lone_wait(h) == pytest.approx(0.006)  # not halved by the bursts
    h.run()
    assert _lone_wait(h) == pytest.approx(0.003)  # the lone start halved it
    h.run()


def test_starts_that_did_not_wait_for_company_teach_nothing(tiny: LoadedModel) -> None:
    """A seeded request runs alone without waiting, one that waited behind
    another run did not wait for company, nor did one that started with no
    wait: none of these starts halves the spread, nor does a request that
    comes while they run count as late for an older start."""
    h = Harness(tiny, EngineSettings(prefix_cache=False))
    h.submit("a first prefill, to have a rate: " * 3, max_tokens=1)
    h.run()
    _learn_burst(h, 0.006)
    seeded = h.submit("seeded: it runs alone", max_tokens=8, sampling={"seed": 7})
    behind = h.submit("waits behind the seeded one", max_tokens=2)
    h.run()
    assert not h.done(seeded).batched and not h.done(behind).batched
    # and one that came while the seeded one ran
    h.submit("seeded: it runs alone", max_tokens=8, sampling={"seed": 7})
    h.engine.step()
    h.submit("comes while the seeded one runs", max_tokens=2)
    h.run()
    # and one that did not wait, as a seeded one was in line with it
    h.submit("in line with a seeded one", max_tokens=2)
    h.submit("seeded: it runs alone", max_tokens=2, sampling={"seed": 7})
    assert h.engine.admission_wait_s() == 0.0
    h.run()
    assert _lone_wait(h) == pytest.approx(0.006)
    lone = h.engine.pending[0].received
    h.engine.step()  # the lone request starts: its start may teach
    h.run()
    h.submit("seeded again", max_tokens=8, sampling={"seed": 7})
    h.engine.step()
    h.submit("30 ms after the lone one, while the seeded one runs", max_tokens=2,
             received=lone + 0.03)  # fmt: skip
    assert h.engine.admission.burst_s == pytest.approx(0.003)  # the lone start's halving, no more
    h.run()


def test_a_request_long_after_the_others_started_is_no_burst(tiny: LoadedModel) -> None:
    h = Harness(tiny, EngineSettings(prefix_cache=False))
    h.submit("the first", max_tokens=40, received=time.perf_counter() - 0.06)
    h.engine.step()
    h.submit("60 ms later: another user", max_tokens=4)
    assert h.engine.admission.burst_s == 0.0
    h.run()
    # Nor is a request that cannot run, however soon it came.
    sent = time.perf_counter() - 0.010
    h.submit("the first", max_tokens=40, received=sent)
    h.engine.step()
    h.submit("", max_tokens=4, received=sent + 0.002)
    assert h.engine.admission.burst_s == 0.0
    h.submit("a valid one as soon after", max_tokens=4, received=sent + 0.003)
    assert h.engine.admission.burst_s == pytest.approx(0.003)
    h.run()


def test_the_admission_wait_counts_only_what_the_prefix_cache_does_not_give(
    tiny: LoadedModel,
) -> None:
    h = Harness(tiny)
    long = "The supervisor restarts runners that crash, and keeps their queues. " * 20
    h.submit(long, max_tokens=2)
    h.run()
    rate = 10.0  # slow: the whole prompt would wait the 50 ms cap
    _measured(h, rate)
    h.submit(long + "Then it answers.", max_tokens=2)
    job = h.engine.pending[0]
    job.received = time.perf_counter()
    wait = h.engine.admission_wait_s(job.received)
    assert job.to_compute is not None and 0 < job.to_compute < len(job.prompt) // 10
    assert wait == pytest.approx(0.02 * job.to_compute / rate) and 0.0 < wait < 0.05
    h.run()
    assert h.done(h.next_id - 1).cached_tokens == len(job.prompt) - job.to_compute


def test_a_next_turn_the_cache_could_not_keep_is_not_computed(tiny: LoadedModel) -> None:
    chat = [ChatMessage("system", "You are terse. " * 30), ChatMessage("user", "Hi?")]
    one = Harness(tiny)
    one.submit(chat, 8)
    one.run()
    entry_bytes = one.engine.stats().prefix_cache.bytes  # type: ignore[union-attr]
    h = Harness(tiny, EngineSettings(prefix_cache_bytes=entry_bytes))  # the answer's entry fits
    h.submit(chat, 8)
    h.run()
    h.settle()
    stats = h.engine.stats().next_turn
    assert stats is not None and (stats.prefilled, stats.tokens, stats.dropped) == (0, 0, 1)


# --- prefill in paced chunks --------------------------------------------------------

LONG_PROMPT = " ".join(f"line {i}: the supervisor keeps its runners alive." for i in range(40))


def test_a_prompt_prefilled_in_paced_chunks_gives_mlx_lms_own_tokens(tiny: LoadedModel) -> None:
    # 2 ms a prompt token and 50 ms steps: chunks of about 25 tokens.
    h = Harness(tiny, EngineSettings(prefix_cache=False, prefill_chunk_s=0.05),
                faults="slow_prefill=0.002")  # fmt: skip
    request_id = h.submit(LONG_PROMPT, max_tokens=24)
    h.run()
    done = h.done(request_id)
    job_prompt = build_prompt_tokens(tiny.tokenizer, Generate(0, prompt=LONG_PROMPT))
    expected = mlx_lm.generate(tiny.model, tiny.tokenizer, prompt=job_prompt, max_tokens=24)
    assert h.text(request_id) == expected
    assert done.prompt_tokens == len(job_prompt) > 300
    beats = [f for f in h.frames if isinstance(f, Heartbeat) and f.phase == "prefill"]
    assert beats and beats[-1].progress >= 5  # a step of progress per chunk


def test_each_prefill_chunk_is_announced_with_the_time_it_should_take(tiny: LoadedModel) -> None:
    # 5 ms a token and 0.6 s steps: after the first (32 tokens, its rate not
    # known yet), each chunk is announced before it starts, as it outlasts the
    # heartbeat interval, stating the 0.6 s it should take.
    h = Harness(tiny, EngineSettings(prefix_cache=False, prefill_chunk_s=0.6),
                faults="slow_prefill=0.005")  # fmt: skip
    request_id = h.submit(LONG_PROMPT, max_tokens=2)
    h.run()
    done = h.done(request_id)
    assert done.generation_tokens == 2
    chunks = math.ceil((done.prompt_tokens - 1 - 32) / (0.6 / 0.005))
    stated = [f.step_s for f in h.frames if isinstance(f, Heartbeat) and f.phase == "prefill"]
    announced = [step_s for step_s in stated if step_s == pytest.approx(0.6, rel=0.05)]
    assert len(announced) >= chunks - 1  # the last chunk may be short


def test_a_cancel_between_prefill_chunks_ends_the_request_before_its_first_token(
    tiny: LoadedModel,
) -> None:
    h = Harness(tiny, EngineSettings(prefill_chunk_s=0.05), faults="slow_prefill=0.002")
    request_id = h.submit(LONG_PROMPT, max_tokens=24)
    h.engine.step()  # the first chunk
    h.engine.step()  # the second
    solo = h.engine.solo
    assert solo is not None and 0 < solo.prefilled < len(solo.rest) - 1
    h.cancelled.add(request_id)
    h.engine.step()
    done = h.done(request_id)
    assert done.finish_reason == "cancelled" and done.generation_tokens == 0
    assert h.engine.idle


def test_a_lone_request_joins_a_batch_with_the_prompt_it_has_left(tiny: LoadedModel) -> None:
    # A lone request halfway through its prefill moves into a batch when a
    # second comes: it goes on from the chunks it computed, to the same tokens.
    reference, _ = alone(tiny, LONG_PROMPT, 16)
    h = Harness(tiny, EngineSettings(prefix_cache=False, prefill_chunk_s=0.05),
                faults="slow_prefill=0.001")  # fmt: skip
    first = h.submit(LONG_PROMPT, 16)
    h.engine.step()
    h.engine.step()
    solo = h.engine.solo
    assert solo is not None and solo.prefilled > 0
    second = h.submit(PROMPTS[0], 16)
    h.run()
    assert h.done(first).batched and h.done(second).batched
    assert h.text(first) == reference


# --- reasoning and tool calls, through the engine -------------------------------------
#
# builtin:tiny's tokenizer given Qwen3's markup (``<think>`` tags, here several
# tokens each, as Gemma's are; ``<tool_call>`` blocks read by mlx-lm's json_tools
# parser), and its tokens scripted by a logits processor that forces them one
# by one: the engine's frames, finish and counts are checked on known text.

TAGS_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>"
    "{% for c in m.tool_calls or [] %}CALL {{ c.id }} {{ c.function.name }}"
    "{{ c.function.arguments | tojson }}{% endfor %}"
    "{{ m.content }}</{{ m.role }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
WEATHER_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


class TaggedTokenizer(TokenizerWrapper):  # type: ignore[misc]
    """builtin:tiny's tokenizer with thinking tags and Qwen3's tool-call markup."""

    def __init__(self, tiny: LoadedModel, template: str = TAGS_TEMPLATE) -> None:
        hf = tiny.tokenizer._tokenizer
        super().__init__(
            hf,
            detokenizer_class=type(tiny.tokenizer._detokenizer),
            eos_token_ids=tiny.tokenizer.eos_token_ids,
            chat_template=lambda turns, **kw: hf.apply_chat_template(
                turns, chat_template=template, tokenize=False, **kw),
            tool_call_start=json_tools.tool_call_start,
            tool_call_end=json_tools.tool_call_end,
            tool_parser=json_tools.parse_tool_call,
        )  # fmt: skip
        self._think_start, self._think_end = "<think>", "</think>"
        self._think_start_tokens = tuple(self.pieces("<think>"))
        self._think_end_tokens = tuple(self.pieces("</think>"))

    def pieces(self, *texts: str) -> list[int]:
        """``texts`` encoded one by one: each marker its own tokens."""
        return [t for text in texts for t in self._tokenizer.encode(text, add_special_tokens=False)]


@pytest.fixture(scope="module")
def tagged(tiny: LoadedModel) -> LoadedModel:
    return dataclasses.replace(tiny, tokenizer=TaggedTokenizer(tiny))


@pytest.fixture(scope="module")
def thinking(tiny: LoadedModel) -> LoadedModel:
    """Its template opens the thinking in the answer's header, as Qwen3's does."""
    template = TAGS_TEMPLATE.replace("<assistant>{% endif %}", "<assistant><think>\n{% endif %}")
    return dataclasses.replace(tiny, tokenizer=TaggedTokenizer(tiny, template))


def script(monkeypatch: pytest.MonkeyPatch, model: LoadedModel, *scripts: list[int]) -> None:
    """The next requests made generate ``scripts``' tokens, one script each in
    the order they are made, then an end token (the script forced as a logits
    processor: the engine's constraint slot)."""
    queue = list(scripts)
    (eos, *_) = sorted(model.tokenizer.eos_token_ids)

    def forcing(chat: ChatOptions, tokenizer: Any, vocab_size: int, prompt: Any) -> Any:
        if not queue:
            return None
        tokens, start = queue.pop(0), None

        def force(context: mx.array, logits: mx.array) -> mx.array:
            nonlocal start
            start = context.size if start is None else start
            at = context.size - start
            target = tokens[at] if at < len(tokens) else eos
            allowed = mx.arange(logits.shape[-1]) == target
            return mx.where(allowed, logits, mx.array(-mx.inf, logits.dtype))

        return force

    monkeypatch.setattr("runner.engine.constraint_processor", forcing)


def chunks(h: Harness, request_id: int) -> list[TextChunk]:
    return [f for f in h.frames if isinstance(f, TextChunk) and f.request_id == request_id]


def test_reasoning_goes_to_its_own_frames_and_counts_its_tokens(
    tagged: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok: TaggedTokenizer = tagged.tokenizer
    thinking = tok.pieces("<think>", "I think hard", "</think>")
    script(monkeypatch, tagged, thinking + tok.pieces("The answer."))
    h = Harness(tagged, EngineSettings(prefix_cache=False, stream_interval_s=0.0))
    request_id = h.submit([ChatMessage("user", "Hi")], 40, sampling={"logprobs": True})
    h.run()
    frames = chunks(h, request_id)
    assert "".join(f.reasoning for f in frames) == "I think hard"
    assert h.text(request_id) == "The answer."
    done = h.done(request_id)
    assert done.finish_reason == "stop"
    # The thinking's tokens, its end tag's included (of a start tag of several
    # tokens, those before its last are counted as the answer's).
    assert len(tok.pieces("I think hard", "</think>")) < done.reasoning_tokens <= len(thinking)
    # Every token but the end has its log probability, reasoning ones included.
    assert sum(len(f.logprobs or []) for f in frames) == done.generation_tokens - 1


def test_tool_calls_end_the_answer_with_finish_tool_calls_alone_and_in_a_batch(
    tagged: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok: TaggedTokenizer = tagged.tokenizer
    call = tok.pieces("<tool_call>", WEATHER_CALL, "</tool_call>")
    script(monkeypatch, tagged, tok.pieces("Let me look.") + call, call, call)
    chat = ChatOptions(tools=[WEATHER_TOOL])
    h = Harness(tagged, EngineSettings(prefix_cache=False))
    ids = [h.submit([ChatMessage("user", "Weather?")], 60, chat=chat)]
    h.run()
    ids += [h.submit([ChatMessage("user", "Weather?")], 60, chat=chat) for _ in range(2)]
    plain = h.submit(PROMPTS[0], 20)
    h.run()
    for request_id, content in zip(ids, ["Let me look.", "", ""], strict=True):
        done = h.done(request_id)
        assert done.batched == (request_id != ids[0]) and done.finish_reason == "tool_calls"
        assert done.invalid_tool_call is None
        assert h.text(request_id) == content  # no markup in the content
        (call_made,) = [c for f in chunks(h, request_id) for c in f.tool_calls or []]
        assert call_made.name == "get_weather"
        assert json.loads(call_made.arguments) == {"city": "Paris"}
        assert call_made.id
    assert h.done(plain).finish_reason == "length"


def test_a_tool_call_cut_short_is_reported_invalid_not_passed_off_as_content(
    tagged: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok: TaggedTokenizer = tagged.tokenizer
    before = tok.pieces("Calling.", "<tool_call>")
    script(monkeypatch, tagged, before + tok.pieces(WEATHER_CALL))
    h = Harness(tagged, EngineSettings(prefix_cache=False))
    request_id = h.submit([ChatMessage("user", "Weather?")], len(before) + 4,
                          chat=ChatOptions(tools=[WEATHER_TOOL]))  # fmt: skip
    h.run()
    done = h.done(request_id)
    assert done.finish_reason == "length"
    assert h.text(request_id) == "Calling."
    assert done.invalid_tool_call is not None and done.invalid_tool_call.startswith("<tool_call>")
    assert not any(f.tool_calls for f in chunks(h, request_id))


def test_with_tool_choice_none_tool_call_text_is_content(
    tagged: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok: TaggedTokenizer = tagged.tokenizer
    script(monkeypatch, tagged, tok.pieces("<tool_call>", WEATHER_CALL, "</tool_call>"))
    h = Harness(tagged, EngineSettings(prefix_cache=False))
    request_id = h.submit([ChatMessage("user", "Weather?")], 60,
                          chat=ChatOptions(tools=[WEATHER_TOOL], tool_choice="none"))  # fmt: skip
    h.run()
    assert h.done(request_id).finish_reason == "stop"
    assert h.text(request_id) == f"<tool_call>{WEATHER_CALL}</tool_call>"


def test_stop_strings_cut_the_content_not_the_reasoning(
    tagged: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok: TaggedTokenizer = tagged.tokenizer
    script(monkeypatch, tagged, tok.pieces("<think>", "I stop to think", "</think>",
                                           "Do not stop here."))  # fmt: skip
    h = Harness(tagged, EngineSettings(prefix_cache=False))
    request_id = h.submit([ChatMessage("user", "Hi")], 60, sampling={"stop": ("stop",)})
    h.run()
    assert "".join(f.reasoning for f in chunks(h, request_id)) == "I stop to think"
    assert h.text(request_id) == "Do not "
    assert h.done(request_id).finish_reason == "stop"


def test_the_next_turn_after_tool_calls_is_prefilled_with_the_calls(
    tagged: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok: TaggedTokenizer = tagged.tokenizer
    script(monkeypatch, tagged, tok.pieces("<tool_call>", WEATHER_CALL, "</tool_call>"))
    chat = ChatOptions(tools=[WEATHER_TOOL])
    h = Harness(tagged)
    history = [ChatMessage("user", "Weather?")]
    first = h.submit(history, 60, chat=chat)
    h.settle()
    (call_made,) = [c for f in chunks(h, first) for c in f.tool_calls or []]
    assert h.done(first).finish_reason == "tool_calls"
    # The client sends the call back, with the tool's answer.
    answer = ChatMessage("assistant", "", tool_calls=[call_made])
    following = [*history, answer, ChatMessage("tool", "sunny", tool_call_id=call_made.id)]
    prompt = build_prompt_tokens(tok, Generate(0, messages=following, chat=chat))
    ahead = next_turn_prefix(tok, history, answer, chat)
    assert h.engine.stats().next_turn.prefilled == 1  # type: ignore[union-attr]
    second = h.submit(following, 4)
    h.run()
    assert h.done(second).cached_tokens >= _common_prefix(ahead, prompt) > len(
        build_prompt_tokens(tok, Generate(0, messages=history, chat=chat)))  # fmt: skip


def test_a_reasoning_budget_ends_the_thinking_and_the_schema_holds_the_answer(
    thinking: LoadedModel,
) -> None:
    # Real sampling, the grammar and the budget together: the prompt leaves the
    # model thinking; after 8 tokens the budget forces the end tag, and the
    # grammar (which let the thinking through) holds the answer to the schema.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}  # fmt: skip
    chat = ChatOptions(response_format=ResponseFormat("json_schema", schema, "answer"))
    sampling = {"max_reasoning_tokens": 8, "temperature": 1.0}
    end_tag = len(thinking.tokenizer.think_end_tokens)
    for together in (1, 2):
        h = Harness(thinking, EngineSettings(prefix_cache=False))
        ids = [h.submit([ChatMessage("user", "Hi")], 80, chat=chat, sampling=sampling)
               for _ in range(together)]  # fmt: skip
        h.run()
        for request_id in ids:
            done = h.done(request_id)
            assert done.batched == (together > 1) and done.finish_reason == "stop"
            assert done.reasoning_tokens == 8 + end_tag
            assert "".join(f.reasoning for f in chunks(h, request_id))
            assert json.loads(h.text(request_id)) in ({"ok": True}, {"ok": False})


@pytest.mark.parametrize(
    ("tail", "stop", "text"),
    [
        ("\nhello STOP more", "STOP", "\nhello "),
        # "<" may open a tag: the splitter holds it, and only the end token's
        # flush releases it, so the stop string is found in the last text.
        ("\nhello <", "o <", "\nhell"),
    ],
    ids=["midway", "at-the-end"],
)
def test_a_broken_call_before_a_stop_string_is_still_reported_invalid(
    tagged: LoadedModel, monkeypatch: pytest.MonkeyPatch, tail: str, stop: str, text: str
) -> None:
    # The block closed broken before the stop string came: the answer ends at
    # the stop, and the broken call in it is still no content and no silence.
    tok: TaggedTokenizer = tagged.tokenizer
    broken = tok.pieces("<tool_call>", "\n{broken\n", "</tool_call>")
    script(monkeypatch, tagged, broken + tok.pieces(tail))
    h = Harness(tagged, EngineSettings(prefix_cache=False))
    request_id = h.submit([ChatMessage("user", "Weather?")], 60, sampling={"stop": (stop,)},
                          chat=ChatOptions(tools=[WEATHER_TOOL]))  # fmt: skip
    h.run()
    done = h.done(request_id)
    assert (h.text(request_id), done.finish_reason) == (text, "stop")
    assert done.invalid_tool_call == "<tool_call>\n{broken\n</tool_call>"


def test_a_model_without_tool_syntax_calls_in_json_under_auto(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # builtin:tiny's template has no tool-call syntax: a JSON answer naming a
    # tool is the call (as Llama 3.x answers), other answers are content.
    encode = tiny.tokenizer._tokenizer.encode
    listed = "  [" + WEATHER_CALL.replace("arguments", "parameters") + "]"
    script(monkeypatch, tiny, encode(WEATHER_CALL), encode(listed),
           encode('{"name": "get_time", "arguments": {}}'), encode("Sunny."))  # fmt: skip
    h = Harness(tiny, EngineSettings(prefix_cache=False, stream_interval_s=0.0))
    chat = ChatOptions(tools=[WEATHER_TOOL])
    ids = []
    for _ in range(4):
        ids.append(h.submit([ChatMessage("user", "Weather?")], 60, chat=chat))
        h.run()
    for request_id in ids[:2]:
        assert h.done(request_id).finish_reason == "tool_calls"
        assert h.text(request_id) == ""
        (made,) = [c for f in chunks(h, request_id) for c in f.tool_calls or []]
        assert (made.name, json.loads(made.arguments)) == ("get_weather", {"city": "Paris"})
    # JSON that names no tool of the request is content, as it came, in one piece at the end.
    assert h.text(ids[2]) == '{"name": "get_time", "arguments": {}}'
    assert [f.text for f in chunks(h, ids[2]) if f.text] == [h.text(ids[2])]
    assert h.done(ids[2]).finish_reason == "stop"
    # Prose streams as ever.
    assert h.text(ids[3]) == "Sunny." and len([f for f in chunks(h, ids[3]) if f.text]) > 1


@pytest.mark.parametrize(
    ("chat", "option"),
    [
        (ChatOptions(tools=[WEATHER_TOOL]), "tools"),
        (ChatOptions(tool_choice="required"), "tool_choice"),
        (ChatOptions(chat_template_kwargs={"enable_thinking": False}), "chat_template_kwargs"),
    ],
    ids=["tools", "tool_choice", "template_kwargs"],
)
def test_chat_options_on_a_raw_prompt_fail_the_request_as_invalid(
    tiny: LoadedModel, chat: ChatOptions, option: str
) -> None:
    h = Harness(tiny)
    h.submit(PROMPTS[0], 8, chat=chat)
    (failed,) = [f for f in h.frames if isinstance(f, GenerationFailed)]
    assert failed.invalid_request and "messages" in failed.error
    assert failed.error.startswith(f"ValueError: {option} need")


def test_a_raw_prompt_can_ask_for_json(tiny: LoadedModel) -> None:
    # response_format needs no template: its grammar holds a raw prompt's answer too.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}  # fmt: skip
    chat = ChatOptions(response_format=ResponseFormat("json_schema", schema, "answer"))
    h = Harness(tiny, EngineSettings(prefix_cache=False))
    request_id = h.submit(PROMPTS[0], 40, chat=chat, sampling={"temperature": 1.0})
    h.run()
    assert json.loads(h.text(request_id)) in ({"ok": True}, {"ok": False})

"""Next-turn prefill: work done ahead while the user reads and types.

After a chat answer, while no request waits or runs, the engine prefills the
start of that chat's next request: the conversation with the answer as the
client will send it back, and the template's header of the next user turn,
as the template renders them. The next turn then computes only its new user
line. A request that comes in goes first (the work stops at its chunk's end
and keeps what it computed), and memory pressure or an error just drops it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import structlog
from mlx_lm.generate import generation_stream

from ipc.messages import ChatMessage, ChatOptions, NextTurnStats
from runner.chat_template import render_chat, template_turns
from runner.guard import MemoryGuard, assess
from runner.prefill_pacing import PrefillPacer
from runner.prefix_cache import PrefixCache, PromptCache, cache_nbytes, keyed, prefix_view

if TYPE_CHECKING:
    from runner.adapters import Adapters

__all__ = ["NEXT_TURN_CHUNK_S", "NextTurn", "NextTurnPrefill", "next_turn_prefix"]

log = structlog.get_logger("runner.next_turn")

NEXT_TURN_CHUNK_S = 0.05
"""A next-turn prefill computes about this long at a time (by the prefill
rate measured): a request that comes in waits at most that for it."""
NEXT_TURN_PROBES = ("A", "B")
"""Two user lines that differ in their first character: the tokens that
both next-turn renders share are the ones any next turn starts with."""


def next_turn_prefix(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    answer: str | ChatMessage,
    chat: ChatOptions | None = None,
) -> list[int]:
    """The tokens every next request of this chat starts with: ``messages``,
    then ``answer`` as the assistant's turn (its text, or the whole turn with
    its tool calls), then the template's header of the next user turn, as
    the chat template renders the history with ``chat``'s tools and template
    arguments (which may differ from the tokens generated: a template may
    strip the answer, or drop its reasoning). The last shared token is left
    out: a real user line's first characters may tokenise together with it.

    After tool calls the next turn is the tools' answers, not a user line:
    the prefix cache then gives that request what it shares with this one
    (the history and the assistant's turn)."""
    chat = ChatOptions() if chat is None else chat
    if isinstance(answer, str):
        answer = ChatMessage("assistant", answer)
    turns = template_turns([*messages, answer])
    first, second = (
        render_chat(tokenizer, [*turns, {"role": "user", "content": probe}], chat)
        for probe in NEXT_TURN_PROBES
    )
    shared = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        shared += 1
    return first[: max(0, shared - 1)]


@dataclass(eq=False)
class NextTurn:
    """A chat answered: its next turn's start waits to be prefilled.

    ``tokens`` is worked out at its first step (not on the answer's way
    out); ``cache`` holds ``tokens[:done]`` while it is being computed."""

    messages: Sequence[ChatMessage]
    answer: ChatMessage
    chat: ChatOptions
    adapter: str | None = None  # the LoRA adapter the chat ran with (None: none)
    tokens: list[int] | None = None
    cache: PromptCache | None = None
    done: int = 0


class NextTurnPrefill:
    """The answered chats whose next turns wait to be prefilled, first come
    first served, and the work on them. Everything runs on the engine's
    thread, between its requests.

    Args:
        model, tokenizer: what mlx-lm loaded.
        prefix_cache: where a prefilled next turn is stored, and where one
            starts from.
        guard: the runner's memory guard: under pressure, work ahead is the
            first to go.
        pacer: the engine's prefill pacer (it sizes the chunks and learns
            from them, as from a request's).
        limit: at most this many chats wait (the engine's ``max_concurrent``);
            past it, the oldest is dropped.
        report: sends the engine's figures (called when the next-turn
            figures its status shows have changed).
        make_cache: a fresh cache for the model (the engine's: quantized
            with kv_bits).
        adapters: the model's LoRA adapters: a chat's next turn is prefilled
            with its adapter, into its adapter's key space.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        prefix_cache: PrefixCache,
        *,
        guard: MemoryGuard,
        pacer: PrefillPacer,
        limit: int,
        report: Callable[[], None],
        make_cache: Callable[[], PromptCache],
        adapters: Adapters | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.prefix_cache = prefix_cache
        self.guard = guard
        self.pacer = pacer
        self.limit = limit
        self.report = report
        self.make_cache = make_cache
        self.adapters = adapters
        self.turns: deque[NextTurn] = deque()
        self.counts = {"prefilled": 0, "tokens": 0, "dropped": 0}

    def stats(self) -> NextTurnStats:
        return NextTurnStats(len(self.turns), **self.counts)

    def queue(self, messages: Sequence[ChatMessage], answer: ChatMessage,
              chat: ChatOptions, adapter: str | None = None) -> None:  # fmt: skip
        """Queue the prefill of this chat's next turn (``messages`` and the
        assistant's ``answer``, rendered with ``chat``'s tools and template
        arguments, run with LoRA ``adapter``); past ``limit`` waiting, the
        oldest is dropped."""
        if len(self.turns) >= self.limit:
            self._drop(self.turns[0], "more chats answered than max_concurrent")
        self.turns.append(NextTurn(messages, answer, chat, adapter))

    def _space(self, turn: NextTurn) -> int:
        """The prefix cache's key space of ``turn``'s adapter."""
        return 0 if self.adapters is None else self.adapters.space(turn.adapter)

    def step(self) -> None:
        """One chunk of the first waiting next-turn prefill (about
        NEXT_TURN_CHUNK_S of compute); stored when it is whole."""
        turn = self.turns[0]
        try:
            plan = self.guard.plan
            if plan is not None:
                verdict = assess(self.guard.refresh(), plan)
                if verdict.warn or verdict.critical:  # work ahead is the first to go
                    self._drop(turn, "memory pressure")
                    self.report()
                    return
            if turn.cache is None and not self._resume(turn):
                return
            assert turn.tokens is not None and turn.cache is not None
            size = self.pacer.step_tokens(target_s=NEXT_TURN_CHUNK_S)
            chunk = turn.tokens[turn.done : turn.done + size]
            started = time.perf_counter()
            if self.adapters is not None:
                self.adapters.use(turn.adapter)
            with mx.stream(generation_stream):
                self.model(mx.array(chunk)[None], cache=turn.cache)
                mx.eval([layer.state for layer in turn.cache])
            self.pacer.record(len(chunk), time.perf_counter() - started)
            turn.done += len(chunk)
            self.counts["tokens"] += len(chunk)
            if turn.done >= len(turn.tokens):
                self.turns.remove(turn)
                if self._store(turn):
                    self.counts["prefilled"] += 1
                else:
                    self.counts["dropped"] += 1
                self.report()
        except Exception as exc:  # work done ahead never fails a request
            log.warning("next_turn_prefill_failed", error=repr(exc))
            self._drop(turn, repr(exc))
            self.report()

    def pause(self) -> None:
        """A request came in: the next-turn prefill under way stores what it
        computed (that request may be this very chat's next turn) and waits;
        it resumes from the cache when the engine is idle again."""
        turn = self.turns[0] if self.turns else None
        if turn is None or turn.cache is None:
            return
        try:
            self._store(turn)
        except Exception as exc:  # work done ahead never fails a request
            log.warning("next_turn_prefill_failed", error=repr(exc))
            self._drop(turn, repr(exc))

    def drop_all(self) -> None:
        """Forget every waiting next-turn prefill, and what they computed."""
        self.counts["dropped"] += len(self.turns)
        self.turns.clear()

    def _resume(self, turn: NextTurn) -> bool:
        """Work out the tokens (the first time) and start from the longest
        prefix the cache holds; False when there is nothing to do (the cache
        holds it all but a token), or it could not be kept (then dropped)."""
        prefix_cache = self.prefix_cache
        if turn.tokens is None:
            turn.tokens = next_turn_prefix(self.tokenizer, turn.messages, turn.answer, turn.chat)
        match = prefix_cache.index.peek(keyed(turn.tokens, self._space(turn)))
        turn.done = match.reuse if match is not None else 0
        if turn.done >= len(turn.tokens) - 1:
            self.turns.remove(turn)
            if len(turn.tokens) > 1:
                self.counts["prefilled"] += 1
            self.report()
            return False
        if match is not None:  # its bytes grow with its tokens: would it fit at all?
            expected = cache_nbytes(match.value) * len(turn.tokens) // len(match.key)
            if expected > prefix_cache.index.budget_bytes:
                self._drop(turn, "larger than the prefix cache's budget")
                self.report()
                return False
        turn.cache = (prefix_view(match.value, match.reuse) if match is not None
                      else self.make_cache())  # fmt: skip
        return True

    def _store(self, turn: NextTurn) -> bool:
        """Keep what ``turn`` computed; False if the cache would not take it."""
        cache, turn.cache = turn.cache, None
        if cache is None or turn.tokens is None or not turn.done:
            return False
        return self.prefix_cache.store(turn.tokens[: turn.done], cache, self._space(turn))

    def _drop(self, turn: NextTurn, why: str) -> None:
        """Give ``turn`` up, and what it computed (a paused one stored that already)."""
        log.info("next_turn_prefill_dropped", why=why, tokens_done=turn.done)
        self.counts["dropped"] += 1
        if turn in self.turns:
            self.turns.remove(turn)
        turn.cache = None

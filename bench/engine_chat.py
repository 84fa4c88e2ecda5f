"""Family 1 of ``bench_engine.py``: a multi-turn chat, ours (with and without the prefix
cache) next to ``mlx_lm.server``; per turn, time to first token and the prompt tokens each
side computed.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from tokenizers import Tokenizer

from common import fmt, note, quotient, runner_info, verdict
from engine_common import (
    OURS,
    OURS_NO_CACHE,
    REQUEST_TIMEOUT_S,
    THEIRS,
    median,
    ours_request,
    theirs_request,
)
from supervisor.client import Client
from supervisor.figures import render_table

CHAT_SIDES = (OURS, THEIRS, OURS_NO_CACHE)
CHAT_TTFT_TARGET = 0.8  # ours / theirs, from turn 2
CHAT_TTFT_FROM_TURN = 2
CACHE_TTFT_TARGET = 0.2  # ours / ours without the cache, from turn 3
CACHE_TTFT_FROM_TURN = 3


@dataclass(frozen=True)
class ChatSettings:
    system_tokens: int
    turns: int
    answer_tokens: int
    epochs: int  # whole conversations, each with a system prompt of its own


TOPICS = ("invoices", "shipping", "refunds", "passwords", "warranties", "meetings", "reports")


def system_prompt(tokenizer: Tokenizer, target_tokens: int, session: int) -> tuple[str, int]:
    """Numbered sentences (deterministic; ``session`` makes the first tokens differ, so no
    cache holds any of it) up to ``target_tokens`` tokens; returns it and its count."""
    lines = [f"Session {session}. You are a careful support assistant."]
    count = 0
    i = 0
    while count < target_tokens:
        i += 1
        topic = TOPICS[(i * 3 + session) % len(TOPICS)]
        lines.append(f"Rule {i}: for questions on {topic}, answer briefly and cite rule {i}.")
        count = len(tokenizer.encode(" ".join(lines), add_special_tokens=False).ids)
    text = " ".join(lines)
    return text, count


def user_line(turn: int) -> str:
    return f"Question {turn}: what does rule {turn * 7} say about {TOPICS[turn % len(TOPICS)]}?"


NEXT_TURN_POLL_S = 0.002


def next_turn_prefilled(client: Client, name: str) -> tuple[float, int]:
    """Wait until our runner has prefilled the next turns it owes (it says so in its
    status: ``next_turn.pending``); returns the wait and the tokens it has computed
    ahead so far. The daemon pushes no event for it, so its status is polled."""
    started = time.perf_counter()
    while True:
        stats = runner_info(client, name).next_turn
        if stats is None or stats.pending == 0:
            return time.perf_counter() - started, stats.tokens if stats is not None else 0
        if time.perf_counter() - started > REQUEST_TIMEOUT_S:
            raise TimeoutError(f"{name}'s next-turn prefill did not end: {stats}")
        time.sleep(NEXT_TURN_POLL_S)


def chat_family(
    client: Client, name: str, port: int, tokenizer: Tokenizer, settings: ChatSettings
) -> dict[str, Any]:
    """Three conversations in step, one turn of each in a rotating order.

    After each of our answers the runner prefills that chat's next turn while it is
    idle; the next request (on any side) goes once it has, as a person's reply comes
    seconds later. No side's request meets that work: every side is timed on a quiet
    machine. What it took (``next_turn_ready_s``, ``ahead_tokens``) is recorded."""
    samples: list[dict[str, Any]] = []
    system_counts = []
    _, ahead_before = next_turn_prefilled(client, name)
    for epoch in range(settings.epochs):
        system, system_count = system_prompt(tokenizer, settings.system_tokens, epoch)
        system_counts.append(system_count)
        history = {side: [{"role": "system", "content": system}] for side in CHAT_SIDES}
        ahead_of_this_turn: dict[str, Any] = {}
        for turn in range(1, settings.turns + 1):
            shift = (turn - 1 + epoch) % len(CHAT_SIDES)
            order = CHAT_SIDES[shift:] + CHAT_SIDES[:shift]
            texts = {}
            for side in order:
                messages = [*history[side], {"role": "user", "content": user_line(turn)}]
                if side == THEIRS:
                    sample = theirs_request(
                        port, messages=messages, max_tokens=settings.answer_tokens
                    )
                else:
                    sample = ours_request(
                        client,
                        name,
                        messages=messages,
                        max_tokens=settings.answer_tokens,
                        cache=side == OURS,
                        side=side,
                    )
                history[side] = [*messages, {"role": "assistant", "content": sample.text}]
                texts[side] = sample.text
                record = {"epoch": epoch, "turn": turn, "order": list(order), **sample.record()}
                ready_s, ahead = next_turn_prefilled(client, name)
                if side == OURS:  # this turn's start, prefilled after the last answer
                    record.update(ahead_of_this_turn)
                    ahead_of_this_turn = {"next_turn_ready_s": ready_s,
                                          "ahead_tokens": ahead - ahead_before}  # fmt: skip
                ahead_before = ahead
                samples.append(record)
            note(
                f"  chat {name} epoch {epoch} turn {turn}: "
                + ", ".join(
                    f"{s['side']} {fmt(s['ttft_s'], '.0f', 1e3, ' ms')}" for s in samples[-3:]
                )
            )
    return {
        "settings": asdict(settings),
        "system_prompt_tokens": system_counts,
        "samples": samples,
        "turns": chat_summary(samples, settings),
    }


def chat_summary(samples: list[dict[str, Any]], settings: ChatSettings) -> list[dict[str, Any]]:
    """Per turn: the median TTFT of each side over epochs, the medians of the per-epoch
    ratios, and the prompt tokens each side computed (medians)."""
    rows = []
    for turn in range(1, settings.turns + 1):
        by_side: dict[str, list[dict[str, Any]]] = {side: [] for side in CHAT_SIDES}
        for s in samples:
            if s["turn"] == turn:
                by_side[s["side"]].append(s)
        epochs = range(len(by_side[OURS]))
        vs_theirs = [
            quotient(by_side[OURS][e]["ttft_s"], by_side[THEIRS][e]["ttft_s"]) for e in epochs
        ]
        vs_no_cache = [
            quotient(by_side[OURS][e]["ttft_s"], by_side[OURS_NO_CACHE][e]["ttft_s"])
            for e in epochs
        ]
        row: dict[str, Any] = {"turn": turn}
        for side in CHAT_SIDES:
            row[f"ttft_{side}_s"] = median([s["ttft_s"] for s in by_side[side]])
            row[f"prompt_tokens_{side}"] = median([s["prompt_tokens"] for s in by_side[side]])
            row[f"computed_tokens_{side}"] = median([s["computed_tokens"] for s in by_side[side]])
        row["runner_ttft_ours_s"] = median([s["runner_ttft_s"] for s in by_side[OURS]])
        row["ahead_tokens_ours"] = median([s.get("ahead_tokens") for s in by_side[OURS]])
        row["next_turn_ready_ours_s"] = median([s.get("next_turn_ready_s") for s in by_side[OURS]])
        row["ours_over_theirs"] = median(vs_theirs)
        row["cache_over_no_cache"] = median(vs_no_cache)
        row["same_text_ours_theirs"] = all(
            by_side[OURS][e]["text"] == by_side[THEIRS][e]["text"] for e in epochs
        )
        row["target_ours_over_theirs"] = (
            None
            if turn < CHAT_TTFT_FROM_TURN or row["ours_over_theirs"] is None
            else row["ours_over_theirs"] <= CHAT_TTFT_TARGET
        )
        row["target_cache_over_no_cache"] = (
            None
            if turn < CACHE_TTFT_FROM_TURN or row["cache_over_no_cache"] is None
            else row["cache_over_no_cache"] <= CACHE_TTFT_TARGET
        )
        rows.append(row)
    return rows


def chat_table(model: str, result: dict[str, Any]) -> str:
    settings = result["settings"]
    header = [
        "turn",
        "prompt tok",
        "TTFT ours",
        "(runner)",
        "theirs",
        "ours no-cache",
        "ours/theirs",
        "target<=0.8",
        "cache/no-cache",
        "target<=0.2",
        "computed: ours",
        "theirs",
        "no-cache",
        "ours ahead",
        "(ready after)",
        "same text",
    ]
    rows = []
    for r in result["turns"]:
        rows.append(
            [
                str(r["turn"]),
                fmt(r[f"prompt_tokens_{OURS}"], ".0f"),
                fmt(r[f"ttft_{OURS}_s"], ".1f", 1e3, " ms"),
                fmt(r["runner_ttft_ours_s"], ".1f", 1e3, " ms"),
                fmt(r[f"ttft_{THEIRS}_s"], ".1f", 1e3, " ms"),
                fmt(r[f"ttft_{OURS_NO_CACHE}_s"], ".1f", 1e3, " ms"),
                fmt(r["ours_over_theirs"], ".2f"),
                verdict(r["target_ours_over_theirs"]),
                fmt(r["cache_over_no_cache"], ".2f"),
                verdict(r["target_cache_over_no_cache"]),
                fmt(r[f"computed_tokens_{OURS}"], ".0f"),
                fmt(r[f"computed_tokens_{THEIRS}"], ".0f"),
                fmt(r[f"computed_tokens_{OURS_NO_CACHE}"], ".0f"),
                fmt(r["ahead_tokens_ours"], ".0f"),
                fmt(r["next_turn_ready_ours_s"], ".0f", 1e3, " ms"),
                "yes" if r["same_text_ours_theirs"] else "no",
            ]
        )
    title = (
        f"1. Multi-turn chat, {model}: system prompt {result['system_prompt_tokens'][0]} "
        f"tokens, {settings['turns']} turns x {settings['answer_tokens']} tokens, greedy, "
        f"{settings['epochs']} conversation(s) per side (medians; ratios: of per-"
        "conversation ratios). TTFT = client-side, to the first non-empty text; (runner) = "
        "the runner's own, from receiving the request to its first token. Ours ahead = "
        "the tokens of that turn our runner prefilled after the answer before it (the next "
        "turn's start), done (ready after) that long after the answer; every request was "
        "sent after that, on each side."
    )
    return title + "\n" + render_table(header, rows)

"""The prefix cache's disk tier under SIGKILLs: every answer as with no cache at all.

Usage::

    python bench/bench_disk_integrity.py [--model builtin:tiny] [--chats 100] [--kills 20]
                                         [--after-answer-share 0.3] [--kill-every S]
                                         [--max-tokens 16] [--seed 26] [--quick]
                                         [--out bench/results/disk_integrity.json]

Issue 26's integrity figure. One private daemon (restarting at once and without
limit) loads the model twice: ``cached``, with the defaults (prefix cache and its
disk tier), and ``ref``, with no prefix cache at all. Chats of two turns share a few
long system prompts (longer than a disk block, so that chats share blocks); every
user message is a chat's own; turn 2 holds turn 1's answer. Requests go one at a
time, greedy, with logprobs (each token's text and bytes).

1. Reference: every request on ``ref`` (``cache=False``).
2. The same requests on ``cached`` while a thread SIGKILLs its runner ``--kills``
   times at random moments (seeded): after a random answer of the run, either at
   once (``--after-answer-share`` of the kills: the runner is then storing that
   answer's KV, and its disk writer writing) or after a random delay of up to two
   requests' time; then it waits until the daemon has the runner ready again (a
   new pid) before it arms the next kill. (Tiny answers in tens of ms, so delays
   in seconds from the last restart, ``--kill-every``, fit few kills in the run.)
   A request that fails because its runner died is sent again.

Figures: answers equal to the reference (text, token count and every token), the
retries (the daemon's own, for a runner that died before the first token, and
ours), the kills (when they landed, the disk writes pending at the status read
just before), the disk tier's counters summed over the runners' lives (each
runner counts from 0: they are read just before each kill and at the end, so
what a runner counted between that read and its death is lost; its log lines,
relayed by the daemon, are not), blocks rejected and why, the block directory
checked from outside once every runner is gone (``audit``), and the prompt
tokens taken from the cache, in all and on the first request each new runner
served (whose RAM tier was empty: all from disk). Exit status 1 when an answer
differs from the reference.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import sqlite3
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS_DIR,
    Daemon,
    first_record,
    load_average,
    machine_info,
    mib,
    mlx_device,
    note,
    runner_info,
    verdict,
    write_json,
)
from ipc.messages import DiskCacheStats, RunnerInfo, SamplingParams
from supervisor.client import Client, ClientError
from supervisor.daemon.logs import log_time
from supervisor.figures import percentiles, render_table

DEFAULT_OUT = RESULTS_DIR / "disk_integrity.json"
CACHED, REF = "cached", "ref"
# Restart at once and without limit: twenty kills in a minute or two would spend
# the default restart budget (5 in 60 s) and back off.
CONFIG = "restart_backoff_s = 0.0\nmax_restarts = 1000\n"
TURN2_LAG = 3  # turn 2 of chat i comes after turn 1 of chat i + 3
READY_TIMEOUT_S = 300.0
RETRY_CODES = ("runner_died", "not_ready")
# The daemon's log records kept (the runners' lines come through it): deaths, the
# daemon's own retries, restarts, and the disk tier's reads, rejections and failures.
LOGGED = {"runner_exited", "request_retried", "model_ready", "prefix_cache_disk_restored",
          "prefix_cache_disk_rejected", "prefix_cache_disk_write_failed",
          "prefix_cache_disk_save_failed", "prefix_cache_disk_sweep_failed"}  # fmt: skip
SUMMED = ("hits", "tokens_restored", "rejected", "written", "write_errors", "skipped", "evictions")

# The system prompts chats share: (topic, sentence, repeats). On builtin:tiny's
# tokenizer these are 350, 558, 920 and 840 tokens: one to three whole 256-token
# disk blocks each, shared by every chat that uses it.
SYSTEMS = [
    ("sea", "You answer questions about the sea, its tides, its fish and its storms. ", 14),
    ("hills", "You are a mountain guide who knows every pass, ridge and hut in the Alps. ", 18),
    ("code", "You review Python code: point out bugs first, then style, briefly and kindly. ", 23),
    ("cook", "You are a cook who explains recipes step by step, with weights in grams. ", 30),
]
QUESTIONS = [
    "What should I look at first?", "Why does that happen?", "How long does it take?",
    "What is the most common mistake?", "Can you give me an example?", "Where do I start?",
    "Is there a cheaper way?", "What would you do differently?",
]  # fmt: skip
FOLLOW_UPS = ["Say more about that.", "And if it goes wrong?", "Why not the other way round?",
              "Could you make it shorter?", "What comes next?"]  # fmt: skip


def chat_messages(chat: int, turn: int, first_answer: str | None) -> list[dict[str, str]]:
    """Chat ``chat``'s messages for ``turn`` (1 or 2; turn 2 holds turn 1's answer)."""
    _topic, sentence, repeats = SYSTEMS[chat % len(SYSTEMS)]
    question = f"Chat {chat}: {QUESTIONS[chat % len(QUESTIONS)]} (user {chat * 7919 % 10007})"
    messages = [{"role": "system", "content": sentence * repeats},
                {"role": "user", "content": question}]  # fmt: skip
    if turn == 2:
        assert first_answer is not None
        follow_up = f"{FOLLOW_UPS[chat % len(FOLLOW_UPS)]} (chat {chat}, turn 2)"
        messages += [{"role": "assistant", "content": first_answer},
                     {"role": "user", "content": follow_up}]  # fmt: skip
    return messages


def schedule(chats: int) -> list[tuple[int, int]]:
    """The requests in order, as (chat, turn): turn 2 of a chat comes a few turn-1s
    later, so that a kill in between leaves chats whose history only the disk holds."""
    order: list[tuple[int, int]] = []
    for chat in range(chats):
        order.append((chat, 1))
        if chat >= TURN2_LAG:
            order.append((chat - TURN2_LAG, 2))
    order += [(chat, 2) for chat in range(max(0, chats - TURN2_LAG), chats)]
    return order


def ask(client: Client, name: str, messages: list[dict[str, str]], max_tokens: int,
        cache: bool) -> dict[str, Any]:  # fmt: skip
    """One greedy answer with each token's text and bytes (its logprobs)."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, logprobs=True)
    with client.generate(name, messages=messages, sampling=sampling, cache=cache) as gen:
        text = "".join(gen)
    done = gen.done
    if done is None:
        raise RuntimeError(f"{name}: the generation ended without its stats")
    return {
        "text": text,
        "tokens": [[t.token, t.bytes] for t in gen.logprobs],
        "logprobs": [t.logprob for t in gen.logprobs],
        "generation_tokens": done.generation_tokens,
        "prompt_tokens": done.prompt_tokens,
        "cached_tokens": done.cached_tokens,
        "finish_reason": done.finish_reason,
        "request_id": done.request_id,  # the daemon's: its runner logs it with its pid
    }


def disk_stats(info: RunnerInfo) -> DiskCacheStats | None:
    cache = info.prefix_cache
    return None if cache is None else cache.disk


def written_all(info: RunnerInfo) -> bool:
    disk = disk_stats(info)
    return info.state == "ready" and (disk is None or disk.pending == 0)


def wait_ready(d: Daemon, old_pid: int | None = None) -> RunnerInfo:
    """The ``cached`` runner once it is ready (with a pid other than ``old_pid``):
    ``status`` read again each time the daemon logs a line (``wait_until``).

    Raises:
        TimeoutError: not ready within READY_TIMEOUT_S.
    """
    found: list[RunnerInfo] = []

    def ready() -> bool:
        info = runner_info(d.client, CACHED)
        found[:] = [info]
        return info.state in ("ready", "busy") and info.pid not in (None, old_pid)

    d.process.wait_until(ready, timeout_s=READY_TIMEOUT_S)
    return found[0]


@dataclass
class Killer:
    """SIGKILLs the ``cached`` runner ``kills`` times from a thread of its own.

    Kill k's moment: after answer number ``targets[k]`` (distinct, drawn at random
    over the run), either right as that answer ends (``after_answer_share`` of the
    kills: the requests' thread kills then) or after a random delay, uniform from 0
    to twice a request's mean time so far: a random moment in the next request or
    two, or between them. ``kill_every_s``, when given, times the kills by the clock
    alone: a delay uniform in 0.1-1.9 x it after the runner is ready again (on a
    fast model, fewer kills may fit in the run). After each kill the thread waits
    until the runner is ready again (a new pid) before it arms the next one.
    """

    d: Daemon
    kills: int
    requests: int  # to be served in all
    kill_every_s: float | None
    after_answer_share: float
    rng: random.Random
    lives: list[dict[str, Any]] = field(default_factory=list)
    """Each dead runner's disk counters, read just before its kill."""
    records: list[dict[str, Any]] = field(default_factory=list)
    in_request: int | None = None  # the cached request in flight (its index), if any
    served: int = 0  # cached answers so far
    serving_s: float = 0.0  # the time they took (retries' waits for a runner not counted)
    after_target: int | None = None  # kill once this many answers have ended
    lock: threading.Lock = field(default_factory=threading.Lock)
    answered: threading.Condition = field(init=False)
    after_answer_done: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.answered = threading.Condition(self.lock)

    def run(self) -> None:
        try:
            if self.kill_every_s is None:
                # Room after the last target for the delay to land in a request.
                targets = sorted(self.rng.sample(range(1, self.requests - 2), self.kills))
            else:
                targets = [0] * self.kills
            for target in targets:
                after = self.rng.random() < self.after_answer_share
                due = target
                if self.kill_every_s is not None:
                    if self.stop.wait(self.kill_every_s * self.rng.uniform(0.1, 1.9)):
                        return
                    with self.lock:
                        due = self.served + 1  # for a kill after an answer: the next one
                elif not after:
                    if not self.wait_answers(target):
                        return
                    if self.stop.wait(self.rng.uniform(0, 2 * self.pace_s())):
                        return
                if after:
                    self.after_answer_done.clear()
                    with self.lock:
                        self.after_target = due
                    self.after_answer_done.wait()
                else:
                    self.kill("random moment")
                if self.stop.is_set():
                    return
                record = self.records[-1]
                ready = wait_ready(self.d, record["pid"])
                logged = first_record(self.d.process, "model_ready", after=record["at"],
                                      model=CACHED)  # fmt: skip
                record["kill_to_ready_s"] = log_time(logged) - record["at"]
                record["new_pid"] = ready.pid
        except BaseException as exc:  # shown by the requests' thread, which stops
            self.error = exc
            self.stop.set()

    def wait_answers(self, count: int) -> bool:
        """Wait until ``count`` answers have ended; False: stopped first."""
        with self.answered:
            self.answered.wait_for(lambda: self.served >= count or self.stop.is_set())
        return not self.stop.is_set()

    def pace_s(self) -> float:
        """A request's mean time so far (0 before the first answer)."""
        with self.lock:
            return self.serving_s / self.served if self.served else 0.0

    def answer_ended(self, took_s: float) -> None:
        """Called by the requests' thread as each answer ends: count it, and kill now
        if a kill right after this answer is due."""
        with self.answered:
            self.served += 1
            self.serving_s += took_s
            self.answered.notify_all()
            due = self.after_target is not None and self.served >= self.after_target
            if due:
                self.after_target = None
        if due:
            try:
                self.kill("right after an answer")
            finally:
                self.after_answer_done.set()

    def finish(self) -> None:
        with self.answered:
            self.stop.set()
            self.answered.notify_all()
        self.after_answer_done.set()

    def kill(self, when: str) -> None:
        """Read the runner's status (pid, disk counters), then SIGKILL it."""
        info = runner_info(self.d.client, CACHED)
        disk = disk_stats(info)
        assert info.pid is not None, info
        with self.lock:
            in_request, served = self.in_request, self.served
        os.kill(info.pid, signal.SIGKILL)
        at = time.time()
        self.lives.append(life(disk))
        self.records.append({
            "when": when, "during_request": in_request is not None, "request": in_request,
            "answers_before": served, "pid": info.pid, "at": at, "state": info.state,
            "disk_pending": None if disk is None else disk.pending,
        })  # fmt: skip
        note(f"kill {len(self.records)}: {when}, pid {info.pid}, "
             f"{'during request ' + str(in_request) if in_request is not None else 'idle'}, "
             f"disk pending {None if disk is None else disk.pending}")  # fmt: skip


def life(disk: DiskCacheStats | None) -> dict[str, Any]:
    """One runner's disk counters."""
    if disk is None:
        return {"reason": "no disk tier"}
    return {**{k: getattr(disk, k) for k in SUMMED}, "rejected_by": dict(disk.rejected_by),
            "pending": disk.pending, "entries": disk.entries, "bytes": disk.bytes,
            "directory": disk.directory, "reason": disk.reason}  # fmt: skip


def summed(lives: list[dict[str, Any]]) -> dict[str, Any]:
    """The counters added up over the runners' lives."""
    total: dict[str, Any] = {k: sum(lv.get(k, 0) for lv in lives) for k in SUMMED}
    by: Counter[str] = Counter()
    for lv in lives:
        by.update(lv.get("rejected_by", {}))
    total["rejected_by"] = dict(by)
    return total


def same(answer: dict[str, Any], reference: dict[str, Any]) -> bool:
    return all(answer[k] == reference[k] for k in ("text", "generation_tokens", "tokens"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    order = schedule(args.chats)
    with tempfile.TemporaryDirectory(prefix="mlx-supervisor-bench-") as tmp, ExitStack() as stack:
        d = Daemon.start(stack, Path(tmp), "integrity", CONFIG, client_timeout_s=300)
        client = d.client
        client.load(args.model, REF, prefix_cache=False)
        client.load(args.model, CACHED)
        d.settle()
        info = runner_info(client, CACHED)
        disk = disk_stats(info)
        if disk is None or disk.reason is not None:
            raise RuntimeError(f"{CACHED} has no disk tier: {disk}")
        note(f"{len(order)} requests on {REF} (no cache) for the reference")
        started = time.perf_counter()
        reference: dict[tuple[int, int], dict[str, Any]] = {}
        messages: dict[tuple[int, int], list[dict[str, str]]] = {}
        for chat, turn in order:
            first = reference[(chat, 1)]["text"] if turn == 2 else None
            messages[(chat, turn)] = chat_messages(chat, turn, first)
            reference[(chat, turn)] = ask(client, REF, messages[(chat, turn)], args.max_tokens,
                                          cache=False)  # fmt: skip
        reference_s = time.perf_counter() - started

        note(f"{len(order)} requests on {CACHED}, {args.kills} SIGKILLs at random moments")
        killer = Killer(d, args.kills, len(order), args.kill_every,
                        args.after_answer_share, random.Random(args.seed))  # fmt: skip
        thread = threading.Thread(target=killer.run, name="killer", daemon=True)
        requests: list[dict[str, Any]] = []
        started = time.perf_counter()
        thread.start()
        try:
            for index, (chat, turn) in enumerate(order):
                attempts: list[str] = []
                while True:
                    if killer.error is not None:
                        raise RuntimeError("the killer thread failed") from killer.error
                    try:
                        with killer.lock:
                            killer.in_request = index
                        asked = time.perf_counter()
                        answer = ask(client, CACHED, messages[(chat, turn)], args.max_tokens,
                                     cache=True)  # fmt: skip
                        took = time.perf_counter() - asked
                        break
                    except ClientError as exc:
                        if exc.code not in RETRY_CODES:
                            raise
                        attempts.append(f"{exc.code}: {exc}")
                        note(f"request {index} (chat {chat} turn {turn}) failed: {exc.code}; "
                             "again once the runner is back")  # fmt: skip
                        wait_ready(d)
                    finally:
                        with killer.lock:
                            killer.in_request = None
                ref = reference[(chat, turn)]
                equal = same(answer, ref)
                logprobs = zip(answer.pop("logprobs"), ref["logprobs"], strict=False)
                requests.append({
                    "index": index, "chat": chat, "turn": turn,
                    "system": SYSTEMS[chat % len(SYSTEMS)][0],
                    "retries": len(attempts), "errors": attempts, "took_s": took, **answer,
                    "equal": equal, "equal_text": answer["text"] == ref["text"],
                    "equal_tokens": answer["tokens"] == ref["tokens"],
                    "max_logprob_diff": max((abs(a - b) for a, b in logprobs), default=0.0),
                    # the reference's answer where it differs (else it is this one)
                    "reference": {k: ref[k] for k in ("prompt_tokens", "cached_tokens",
                                                      *(() if equal else ("text", "tokens",
                                                                          "generation_tokens")))},
                })  # fmt: skip
                if not requests[-1]["equal"]:
                    note(f"request {index} (chat {chat} turn {turn}) differs from the reference: "
                         f"{answer['text']!r} vs {ref['text']!r}")  # fmt: skip
                killer.answer_ended(took)
        finally:
            killer.finish()
            thread.join(timeout=READY_TIMEOUT_S + 10)
        if killer.error is not None:
            raise RuntimeError("the killer thread failed") from killer.error
        cached_s = time.perf_counter() - started
        # The last runner, once it has written what it queued.
        d.process.wait_until(lambda: written_all(runner_info(client, CACHED)), timeout_s=60)
        info = runner_info(client, CACHED)
        disk = disk_stats(info)
        records = d.process.records()
        events = [r for r in records if r.get("event") in LOGGED]
        done = [r for r in records if r.get("event") == "generation_done"]
        served_by = {r.get("request_id"): r.get("runner_pid") for r in done
                     if r.get("model") == CACHED}  # fmt: skip
        # Which runner answered: None where its line is missing (a runner killed right
        # after an answer may not have logged it yet).
        for request in requests:
            request["runner_pid"] = served_by.get(request["request_id"])
        # The process keeps the last lines only: the records are all there if no more came.
        log_complete = d.process.line_count <= (d.process.log_lines.maxlen or 0)
        lives = [*killer.lives, life(disk)]
        directory = None if disk is None else disk.directory
        final = {"entries": None if disk is None else disk.entries,
                 "bytes": None if disk is None else disk.bytes, "directory": directory,
                 "restarts": info.restarts, "counters": dict(client.status().counters)}  # fmt: skip
        daemon_exit = d.shutdown()
        on_disk = audit(Path(directory)) if directory else None
    for record in killer.records:
        del record["at"]
    return {
        "requests": requests, "kills": killer.records, "lives": lives, "final": final,
        "reference_s": reference_s, "cached_s": cached_s, "daemon_exit": daemon_exit,
        "audit": on_disk, "daemon_events": events, "daemon_log_complete": log_complete,
    }  # fmt: skip


def audit(directory: Path) -> dict[str, Any]:
    """The model's block directory checked from outside, once every runner is gone:
    each block the index names has its file, of its size and SHA-256, and its parent
    in the index; files the index does not name (a writer killed between its rename
    and its record: swept by a later runner once 10 min old) and scratch files (killed
    before the rename) are counted."""
    db = sqlite3.connect(directory / "index.sqlite")
    try:
        rows = db.execute("SELECT key, parent, nbytes, checksum FROM blocks").fetchall()
    finally:
        db.close()
    paths = list((directory / "blocks").glob("*/*.safetensors"))
    files = {p.stem: p for p in paths if not p.name.startswith(".")}
    keys = {key for key, *_ in rows}
    scratch = [p.name.split(".")[1] for p in paths if p.name.startswith(".")]
    bad: Counter[str] = Counter()
    for key, parent, nbytes, checksum in rows:
        path = files.get(key)
        data = path.read_bytes() if path is not None else None
        if data is None:
            bad["missing"] += 1
        elif len(data) != nbytes:
            bad["size"] += 1
        elif hashlib.sha256(data).hexdigest() != checksum:
            bad["checksum"] += 1
        if parent is not None and parent not in keys:
            bad["parent missing"] += 1
    # One model, one identity: every runner's blocks in this one directory.
    identities = sorted(p.name for p in directory.parent.iterdir() if p.is_dir())
    return {"indexed": len(rows), "bad": dict(bad), "orphans": len(set(files) - keys),
            "identities": identities,
            "scratch": len(scratch),
            # the runner's sweep keeps a scratch file whose key is in the index
            "scratch_of_indexed": sum(key in keys for key in scratch)}  # fmt: skip


def figures(raw: dict[str, Any]) -> dict[str, Any]:
    requests, kills = raw["requests"], raw["kills"]
    pids = [r["runner_pid"] for r in requests]
    first_of_life = [
        r
        for i, r in enumerate(requests)
        if i > 0 and None not in pids[i - 1 : i + 1] and pids[i] != pids[i - 1]
    ]
    ready = [k["kill_to_ready_s"] for k in kills if "kill_to_ready_s" in k]
    return {
        "answers": len(requests),
        "equal": sum(r["equal"] for r in requests),
        "equal_text": sum(r["equal_text"] for r in requests),
        "equal_tokens": sum(r["equal_tokens"] for r in requests),
        "max_logprob_diff": max((r["max_logprob_diff"] for r in requests), default=0.0),
        "retried_requests": sum(r["retries"] > 0 for r in requests),
        "retries": sum(r["retries"] for r in requests),
        "kills": len(kills),
        "kills_by_when": dict(Counter(k["when"] for k in kills)),
        "kills_during_request": sum(k["during_request"] for k in kills),
        "kills_with_disk_pending": sum(bool(k["disk_pending"]) for k in kills),
        "disk_pending_at_kills": [k["disk_pending"] for k in kills],
        "restarts": raw["final"]["restarts"],
        # The daemon sends a request again itself when its runner died before the
        # first token (retry_unstarted); it fails to the client after that.
        "daemon_retried": raw["final"]["counters"].get("requests_retried", 0),
        "kill_to_ready_s": percentiles(ready, (50, 99)) if ready else None,
        "disk": summed(raw["lives"]),
        "final": raw["final"],
        "audit": raw["audit"],
        "logged": logged(raw["daemon_events"], raw["daemon_log_complete"]),
        "prompt_tokens": sum(r["prompt_tokens"] for r in requests),
        "cached_tokens": sum(r["cached_tokens"] for r in requests),
        "first_after_restart": {
            "requests": len(first_of_life),
            "prompt_tokens": sum(r["prompt_tokens"] for r in first_of_life),
            "cached_tokens": sum(r["cached_tokens"] for r in first_of_life),
        },
    }


def logged(events: list[dict[str, Any]], complete: bool) -> dict[str, Any]:
    """What the runners of ``cached`` logged of their disk tier, all lives together
    (no counter lost to a kill): restores and their tokens, rejections by reason,
    failed writes and saves."""
    mine = [e for e in events if e.get("model") == CACHED]
    restored = [e for e in mine if e["event"] == "prefix_cache_disk_restored"]
    return {
        "complete": complete,
        "restores": len(restored),
        "tokens_restored": sum(int(e.get("tokens", 0)) for e in restored),
        "rejected_by": dict(Counter(str(e.get("reason")) for e in mine
                                    if e["event"] == "prefix_cache_disk_rejected")),
        "write_failed": sum(e["event"] == "prefix_cache_disk_write_failed" for e in mine),
        "save_failed": sum(e["event"] == "prefix_cache_disk_save_failed" for e in mine),
    }  # fmt: skip


def reasons(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"


def table(f: dict[str, Any], model: str, chats: int) -> str:
    disk, final, on_disk, log = f["disk"], f["final"], f["audit"], f["logged"]
    bad = "-" if on_disk is None else reasons(on_disk["bad"])
    by = reasons(disk["rejected_by"])
    when = ", ".join(f"{v} {k}" for k, v in sorted(f["kills_by_when"].items()))
    first = f["first_after_restart"]
    ready = f["kill_to_ready_s"]
    rows = [
        ("answers equal to the no-cache reference (text, count, tokens)",
         f"{f['equal']} / {f['answers']}", "all", verdict(f["equal"] == f["answers"])),
        ("  text equal / token sequences equal",
         f"{f['equal_text']} / {f['equal_tokens']}", "", ""),
        ("  largest |logprob difference| of a token", f"{f['max_logprob_diff']:.2e}", "", ""),
        ("SIGKILLs of the cached runner", f"{f['kills']} ({when})", "", ""),
        ("  during a request / with disk writes pending at the last status read",
         f"{f['kills_during_request']} / {f['kills_with_disk_pending']}", "", ""),
        ("  restarts seen by the daemon", str(f["restarts"]), "= kills",
         verdict(f["restarts"] == f["kills"])),
        ("  kill -> ready again (p50 / p99)",
         "-" if ready is None else f"{ready['p50']:.2f} / {ready['p99']:.2f} s", "", ""),
        ("requests whose runner died: retried by the daemon / failed, sent again here",
         f"{f['daemon_retried']} / {f['retried_requests']} ({f['retries']} retries)", "", ""),
        ("disk blocks written / write errors / skipped (summed over lives)",
         f"{disk['written']} / {disk['write_errors']} / {disk['skipped']}", "", ""),
        ("disk hits / tokens restored", f"{disk['hits']} / {disk['tokens_restored']}", "", ""),
        ("disk blocks rejected (why)", f"{disk['rejected']} ({by})", "0",
         verdict(disk["rejected"] == 0)),
        ("  in the daemon's log: restores / tokens / rejected / failed writes",
         f"{log['restores']} / {log['tokens_restored']} / {reasons(log['rejected_by'])} / "
         f"{log['write_failed'] + log['save_failed']}"
         + ("" if log["complete"] else " (log cut)"), "", ""),
        ("disk at the end: blocks / bytes", f"{final['entries']} / {mib(final['bytes'])}", "", ""),
        ("  checked from outside: bad blocks (why) / orphan files / scratch files",
         "-" if on_disk is None else f"{sum(on_disk['bad'].values())} ({bad}) / "
         f"{on_disk['orphans']} / {on_disk['scratch']} ({on_disk['scratch_of_indexed']} "
         "of indexed blocks)", "0 bad",
         verdict(on_disk is not None and not on_disk["bad"])),
        ("  model identities (block directories) the runners used",
         "-" if on_disk is None else str(len(on_disk["identities"])), "1",
         verdict(on_disk is not None and len(on_disk["identities"]) == 1)),
        ("prompt tokens from the cache / all",
         f"{f['cached_tokens']} / {f['prompt_tokens']} "
         f"({f['cached_tokens'] / max(1, f['prompt_tokens']):.0%})", "", ""),
        ("  first request of each new runner (RAM empty: from disk)",
         f"{first['cached_tokens']} / {first['prompt_tokens']} over {first['requests']} requests",
         "", ""),
    ]  # fmt: skip
    title = f"model {model}, {chats} chats x 2 turns, sequential, greedy"
    return f"{title}\n{render_table(['', 'measured', 'target', ''], rows)}"


def changed_since(when: float) -> list[str]:
    """The files under src/ modified since wall time ``when``."""
    src = Path(__file__).resolve().parent.parent / "src"
    return sorted(str(p.relative_to(src)) for p in src.rglob("*.py") if p.stat().st_mtime > when)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--chats", type=int, default=100, help="chats of 2 turns each")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--kill-every", type=float, default=None,
                        help="time the kills by the clock: mean seconds from a runner ready "
                             "to its kill (default: at random answers, see Killer)")  # fmt: skip
    parser.add_argument("--after-answer-share", type=float, default=0.3,
                        help="share of the kills made right after an answer ends")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=26)
    parser.add_argument("--quick", action="store_true", help="20 chats, 4 kills")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()  # fmt: skip
    if args.quick:
        args.chats, args.kills = 20, 4
    if args.kills > 2 * args.chats - 3:
        parser.error("--kills: at most 2 x --chats - 3 (kills land after distinct answers)")
    machine = machine_info(mlx_device())
    started, started_at = time.perf_counter(), time.time()
    raw = run(args)
    f = figures(raw)
    print(table(f, args.model, args.chats))
    # Runners import the code as they start: an edit under src/ during the run gives the
    # runners after it other code, and maybe another identity (the blocks before unseen).
    changed = changed_since(started_at)
    if changed:
        print(f"\nnote: changed under src/ during the run: {', '.join(changed)}")
    write_json({
        "machine": {**machine, "loadavg_end": load_average()},
        "settings": {**vars(args), "out": str(args.out), "config": CONFIG,
                     "turn2_lag": TURN2_LAG,
                     "systems": [{"topic": t, "sentence": s, "repeats": n}
                                 for t, s, n in SYSTEMS]},
        "wall_s": time.perf_counter() - started,
        "src_changed_during_run": changed,
        "figures": f,
        "raw": raw,
    }, args.out)  # fmt: skip
    print(f"\nwrote {args.out}")
    return 0 if f["equal"] == f["answers"] else 1


if __name__ == "__main__":
    sys.exit(main())

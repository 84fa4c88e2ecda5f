"""Chat and concurrency on a real model through HTTP: our daemon's front next to ``mlx_lm.server``.

Usage::

    python bench/bench_real.py [--quick] [--model builtin:smollm2]
                               [--out bench/results/real.json]

Issue 26, part 3 ("Chat on a real model", "Concurrency on a real model"). One run starts a
private daemon with its HTTP front on a free loopback port (``MLX_SUPERVISOR_HTTP=127.0.0.1:0``;
its base URL from ``status().supervisor.http``; ``hot_spare = false``) and
``python -m mlx_lm.server`` (its defaults) on the same model directory
(``ensure_builtin_model``). Every request on either side is ``POST /v1/chat/completions``,
streamed with ``stream_options.include_usage``, greedy, on a new TCP connection, read with
httpx (``http_common.http_chat``); TTFT is client-side, from the request sent to the first
chunk with non-empty ``delta.content``.

1. **Chat**: a conversation per side with a ~1,000-token system prompt and ``--turns``
   user lines (``engine_chat.system_prompt`` / ``user_line``), ``--answer-tokens`` per
   answer; each side keeps its own history (its own answers). The side that goes first
   alternates per turn. Before every request, on either side, our runner's next-turn
   prefill (the previous answer and the next user header, computed while it is idle) has
   finished (``engine_chat.next_turn_prefilled``), as a person's reply comes seconds later;
   what it computed ahead is recorded. Per turn: TTFT ours / theirs (target <= 0.8 from
   turn 2), prompt tokens, the cached tokens each side reported, same text or not.
   ``--epochs`` conversations, each with a system prompt of its own.
2. **Concurrency**: ``--clients`` (4 and 8) clients at once (threads and a barrier:
   ``engine_concurrency.run_together``), each a short chat: one system message shared by
   all (as a chat app's) and a user line of its own, ``--concurrent-tokens`` each.
   ``--rounds`` rounds per client count, the side that goes first alternating; before each
   side's round our runner is idle and its next-turn prefills done. Figures
   (``engine_concurrency.batch_figures``): aggregate tok/s (all completion tokens / first
   send to last end) ours / theirs (target >= 1.1) and the slowest client's TTFT ours /
   theirs (target <= 0.9), medians of per-round ratios; per-client TTFTs and cached
   tokens in the JSON.

Tables on stdout (also those measured before a failure), progress on stderr; the JSON
(rewritten after each family, ``complete`` at the end) has the machine, the settings and
every sample. See bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_http import runner_pid, server_pid
from common import (
    RESULTS_DIR,
    Daemon,
    alternate,
    children_left,
    fmt,
    load_average,
    machine_info,
    mapped_blas,
    mlx_device,
    mlx_lm_server,
    note,
    quotient,
    runner_info,
    verdict,
    write_json,
)
from engine_chat import next_turn_prefilled, system_prompt, user_line
from engine_common import median
from engine_concurrency import batch_figures, run_together
from http_common import OURS, THEIRS, Sample, Sides, warm_up
from runner.builtin import ensure_builtin_model
from supervisor.client import Client
from supervisor.figures import render_table

DEFAULT_OUT = RESULTS_DIR / "real.json"
REQUEST_TIMEOUT_S = 900.0  # a cold 1k-token prefill on smollm2 takes 30-100 s here
SIDES = (OURS, THEIRS)

CHAT_TTFT_TARGET = 0.8  # ours / theirs, from turn 2
CHAT_TTFT_FROM_TURN = 2
TPS_TARGET = 1.1  # aggregate tok/s, ours / theirs
SLOWEST_TTFT_TARGET = 0.9  # the slowest client's TTFT, ours / theirs

APP_SYSTEM = (
    "You are the assistant of a small online bookshop. Answer in one or two friendly "
    "sentences, and never invent prices or delivery dates."
)
QUESTIONS = (
    "Do you have any books about lighthouses?",
    "How do I return a damaged paperback?",
    "Can you recommend a mystery novel for a long train ride?",
    "What is a good first book about astronomy?",
    "Is there a poetry collection you like for winter evenings?",
    "Which cookbook would suit someone who has never cooked?",
    "Can I order a book as a gift with a handwritten note?",
    "What should a ten-year-old read after finishing Harry Potter?",
)


@dataclass(frozen=True)
class Settings:
    model: str
    system_tokens: int
    turns: int
    answer_tokens: int
    epochs: int
    clients: tuple[int, ...]
    rounds: int
    concurrent_tokens: int
    cpu_blas: str = "auto"  # our daemon's cpu_blas (supervisor.runners.blas)
    theirs_blas: str = "bundled"  # mlx_lm.server's: mlx's own, or "same" as our runner maps
    runner_env: tuple[tuple[str, str], ...] = ()  # added to our runner's environment


# --- waiting for our runner -------------------------------------------------------------


def runner_quiet(client: Client, name: str) -> tuple[float, int]:
    """Wait until our runner serves no request and has none queued, then until its
    next-turn prefills are done; returns the whole wait and the tokens prefilled ahead so
    far (``next_turn.tokens``)."""
    started = time.perf_counter()
    while True:
        info = runner_info(client, name)
        if info.active_requests == 0 and info.queue_depth == 0:
            break
        if time.perf_counter() - started > REQUEST_TIMEOUT_S:
            raise TimeoutError(f"{name} did not go idle: {info}")
        time.sleep(0.01)
    _, ahead = next_turn_prefilled(client, name)
    return time.perf_counter() - started, ahead


# --- 1. chat ----------------------------------------------------------------------------


def chat_family(sides: Sides, tokenizer: Tokenizer, s: Settings) -> dict[str, Any]:
    """``s.epochs`` conversations per side, one turn of each side in turn (the first side
    alternating per turn and epoch); every request sent once our runner's next-turn
    prefill is done. An ours record carries what the runner prefilled after the answer
    before it (``ahead_tokens``, ``next_turn_ready_s``: how long after that answer)."""
    samples: list[dict[str, Any]] = []
    system_counts = []
    _, ahead_before = runner_quiet(sides.client, sides.name)
    for epoch in range(s.epochs):
        system, count = system_prompt(tokenizer, s.system_tokens, 1000 + epoch)
        system_counts.append(count)
        history = {side: [{"role": "system", "content": system}] for side in SIDES}
        ahead_of_this_turn: dict[str, Any] = {}
        for turn in range(1, s.turns + 1):
            order = alternate(turn - 1 + epoch, OURS, THEIRS)
            for side in order:
                messages = [*history[side], {"role": "user", "content": user_line(turn)}]
                request = sides.ours if side == OURS else sides.theirs
                sample = request(messages, s.answer_tokens)
                history[side] = [*messages, {"role": "assistant", "content": sample.text}]
                record = {"epoch": epoch, "turn": turn, "order": list(order), **sample.record()}
                ready_s, ahead = runner_quiet(sides.client, sides.name)
                if side == OURS:
                    record.update(ahead_of_this_turn)
                    ahead_of_this_turn = {"next_turn_ready_s": ready_s,
                                          "ahead_tokens": ahead - ahead_before}  # fmt: skip
                ahead_before = ahead
                samples.append(record)
            this_turn = {r["side"]: r for r in samples[-2:]}
            note(
                f"  chat epoch {epoch} turn {turn}: "
                + ", ".join(
                    f"{side} {fmt(this_turn[side]['ttft_s'], '.0f', 1e3, ' ms')} "
                    f"({this_turn[side]['prompt_tokens']} prompt, "
                    f"{this_turn[side]['cached_tokens']} cached)"
                    for side in order
                )
            )
    return {
        "system_prompt_tokens": system_counts,
        "samples": samples,
        "turns": chat_summary(samples, s.turns),
    }


def chat_summary(samples: list[dict[str, Any]], turns: int) -> list[dict[str, Any]]:
    """Per turn: each side's median TTFT, prompt and cached tokens over epochs, the median
    of the per-epoch ratios ours / theirs, and whether every epoch's texts were equal."""
    rows = []
    for turn in range(1, turns + 1):
        by_side = {side: [r for r in samples if r["turn"] == turn and r["side"] == side]
                   for side in SIDES}  # fmt: skip
        pairs = list(zip(by_side[OURS], by_side[THEIRS], strict=True))
        row: dict[str, Any] = {"turn": turn}
        for side in SIDES:
            row[f"ttft_{side}_s"] = median([r["ttft_s"] for r in by_side[side]])
            row[f"prompt_tokens_{side}"] = median([r["prompt_tokens"] for r in by_side[side]])
            row[f"cached_tokens_{side}"] = median([r["cached_tokens"] for r in by_side[side]])
            row[f"completion_tokens_{side}"] = median(
                [r["completion_tokens"] for r in by_side[side]]
            )
        row["ahead_tokens_ours"] = median([r.get("ahead_tokens") for r in by_side[OURS]])
        row["next_turn_ready_ours_s"] = median([r.get("next_turn_ready_s") for r in by_side[OURS]])
        row["ours_over_theirs"] = median([quotient(o["ttft_s"], t["ttft_s"]) for o, t in pairs])
        row["same_text"] = sum(o["text"] == t["text"] for o, t in pairs)
        row["epochs"] = len(pairs)
        row["target"] = (
            None
            if turn < CHAT_TTFT_FROM_TURN or row["ours_over_theirs"] is None
            else row["ours_over_theirs"] <= CHAT_TTFT_TARGET
        )
        rows.append(row)
    return rows


def chat_table(s: Settings, result: dict[str, Any]) -> str:
    header = ["turn", "prompt tok ours", "theirs", "cached ours", "theirs", "TTFT ours", "theirs",
              "ours/theirs", f"target<={CHAT_TTFT_TARGET}", "ours ahead", "(ready after)",
              "same text"]  # fmt: skip
    rows = [
        [
            str(r["turn"]),
            fmt(r[f"prompt_tokens_{OURS}"], ".0f"),
            fmt(r[f"prompt_tokens_{THEIRS}"], ".0f"),
            fmt(r[f"cached_tokens_{OURS}"], ".0f"),
            fmt(r[f"cached_tokens_{THEIRS}"], ".0f"),
            fmt(r[f"ttft_{OURS}_s"], ".0f", 1e3, " ms"),
            fmt(r[f"ttft_{THEIRS}_s"], ".0f", 1e3, " ms"),
            fmt(r["ours_over_theirs"], ".2f"),
            verdict(r["target"]),
            fmt(r["ahead_tokens_ours"], ".0f"),
            fmt(r["next_turn_ready_ours_s"], ".0f", 1e3, " ms"),
            f"{r['same_text']}/{r['epochs']}",
        ]
        for r in result["turns"]
    ]
    title = (
        f"1. Chat on {s.model} through HTTP, ours vs mlx_lm.server: system prompt "
        f"{result['system_prompt_tokens'][0]} tokens, {s.turns} turns x {s.answer_tokens} "
        f"tokens, greedy, {s.epochs} conversation(s) per side, each side its own history "
        "(medians; ratio: median of per-conversation ratios). TTFT: client-side, request "
        "sent to the first content chunk. Cached: usage.prompt_tokens_details. Ours ahead: "
        "tokens our runner prefilled after its previous answer (done that long after it); "
        "every request, on either side, went after that."
    )
    return title + "\n" + render_table(header, rows)


# --- 2. concurrency ---------------------------------------------------------------------


class CountedSample(Sample):
    """An HTTP ``Sample`` as ``engine_concurrency.batch_figures`` reads it."""

    @property
    def generation_tokens(self) -> int:
        return self.completion_tokens


def app_messages(clients: int, round_index: int, client: int) -> list[dict[str, str]]:
    """The shared system message and a user line of this client's own (the round and the
    client in it, so that no request repeats an earlier one)."""
    question = QUESTIONS[client % len(QUESTIONS)]
    user = f"(customer {client + 1} of {clients}, visit {round_index + 1}) {question}"
    return [{"role": "system", "content": APP_SYSTEM}, {"role": "user", "content": user}]


def one_side_round(
    sides: Sides, side: str, clients: int, round_index: int, tokens: int
) -> dict[str, Any]:
    """Our runner quiet first; then ``clients`` requests to ``side`` at once."""
    quiet_s, ahead_before = runner_quiet(sides.client, sides.name)
    request = sides.ours if side == OURS else sides.theirs

    def one(client: int) -> CountedSample:
        sample = request(app_messages(clients, round_index, client), tokens)
        return CountedSample(**vars(sample))

    samples = run_together([lambda c=c: one(c) for c in range(clients)])
    figures = batch_figures(samples)
    figures["ttfts_s"] = [s.ttft_s for s in samples]
    figures["cached_tokens"] = [s.cached_tokens for s in samples]
    figures["prompt_tokens"] = [s.prompt_tokens for s in samples]
    figures["waited_for_quiet_s"] = quiet_s
    if side == OURS:
        ready_s, ahead = runner_quiet(sides.client, sides.name)
        figures["next_turn_ready_s"] = ready_s
        figures["ahead_tokens"] = ahead - ahead_before
    return figures


def concurrency_family(sides: Sides, s: Settings) -> list[dict[str, Any]]:
    """Per client count, ``s.rounds`` rounds of both sides one after the other; which goes
    first alternates with a counter over all rounds."""
    cases = []
    index = 0
    for clients in s.clients:
        records = []
        for r in range(s.rounds):
            order = alternate(index, OURS, THEIRS)
            index += 1
            figures = {side: one_side_round(sides, side, clients, r, s.concurrent_tokens)
                       for side in order}  # fmt: skip
            records.append({
                "round": r,
                "order": list(order),
                **figures,
                "tps_ratio": quotient(figures[OURS]["aggregate_tps"],
                                      figures[THEIRS]["aggregate_tps"]),
                "slowest_ttft_ratio": quotient(figures[OURS]["slowest_ttft_s"],
                                               figures[THEIRS]["slowest_ttft_s"]),
                "same_text": sum(o["text"] == t["text"] for o, t in
                                 zip(figures[OURS]["samples"], figures[THEIRS]["samples"],
                                     strict=True)),
            })  # fmt: skip
            note(
                f"  {clients} clients round {r} ({order[0]} first): tok/s ours "
                f"{figures[OURS]['aggregate_tps']:.2f} "
                f"theirs {figures[THEIRS]['aggregate_tps']:.2f}"
                f"; slowest TTFT ours {fmt(figures[OURS]['slowest_ttft_s'], '.0f', 1e3, ' ms')} "
                f"theirs {fmt(figures[THEIRS]['slowest_ttft_s'], '.0f', 1e3, ' ms')}"
            )
        tps_ratio = median([r["tps_ratio"] for r in records])
        ttft_ratio = median([r["slowest_ttft_ratio"] for r in records])
        cases.append({
            "clients": clients,
            "tokens_per_client": s.concurrent_tokens,
            "rounds": records,
            **{f"aggregate_tps_{side}": median([r[side]["aggregate_tps"] for r in records])
               for side in SIDES},
            **{f"slowest_ttft_{side}_s": median([r[side]["slowest_ttft_s"] for r in records])
               for side in SIDES},
            **{f"median_ttft_{side}_s": median([t for r in records for t in r[side]["ttfts_s"]])
               for side in SIDES},
            **{f"cached_tokens_{side}": median([c for r in records
                                                for c in r[side]["cached_tokens"]])
               for side in SIDES},
            "prompt_tokens": median([p for r in records for p in r[OURS]["prompt_tokens"]]),
            "tps_ratio": tps_ratio,
            "slowest_ttft_ratio": ttft_ratio,
            "target_tps": None if tps_ratio is None else tps_ratio >= TPS_TARGET,
            "target_slowest_ttft": None if ttft_ratio is None
                                   else ttft_ratio <= SLOWEST_TTFT_TARGET,
            "same_text": sum(r["same_text"] for r in records),
            "requests": clients * len(records),
        })  # fmt: skip
    return cases


def concurrency_table(s: Settings, cases: list[dict[str, Any]]) -> str:
    header = ["clients", "rounds", "prompt tok", "cached ours", "theirs", "tok/s ours", "theirs",
              "ours/theirs", f"target>={TPS_TARGET}", "slowest TTFT ours", "theirs",
              "ours/theirs", f"target<={SLOWEST_TTFT_TARGET}", "median TTFT ours", "theirs",
              "same text"]  # fmt: skip
    rows = [
        [
            str(c["clients"]),
            str(len(c["rounds"])),
            fmt(c["prompt_tokens"], ".0f"),
            fmt(c[f"cached_tokens_{OURS}"], ".0f"),
            fmt(c[f"cached_tokens_{THEIRS}"], ".0f"),
            fmt(c[f"aggregate_tps_{OURS}"], ".2f"),
            fmt(c[f"aggregate_tps_{THEIRS}"], ".2f"),
            fmt(c["tps_ratio"], ".2f"),
            verdict(c["target_tps"]),
            fmt(c[f"slowest_ttft_{OURS}_s"], ".0f", 1e3, " ms"),
            fmt(c[f"slowest_ttft_{THEIRS}_s"], ".0f", 1e3, " ms"),
            fmt(c["slowest_ttft_ratio"], ".2f"),
            verdict(c["target_slowest_ttft"]),
            fmt(c[f"median_ttft_{OURS}_s"], ".0f", 1e3, " ms"),
            fmt(c[f"median_ttft_{THEIRS}_s"], ".0f", 1e3, " ms"),
            f"{c['same_text']}/{c['requests']}",
        ]
        for c in cases
    ]
    title = (
        f"2. Concurrent chats on {s.model} through HTTP, ours vs mlx_lm.server: clients "
        f"started together (a barrier), one shared system message and a user line each, "
        f"{s.concurrent_tokens} tokens each, greedy. tok/s = all completion tokens / first "
        "send to last end; slowest TTFT = the last client's first content chunk; medians "
        "over rounds, ratios: median of per-round ratios. Cached (median per request): "
        "usage.prompt_tokens_details. Our runner idle, next-turn prefills done, before "
        "each side's round."
    )
    return title + "\n" + render_table(header, rows)


# --- the run ----------------------------------------------------------------------------


def run(s: Settings, results: dict[str, Any], save: Callable[[], None]) -> None:
    """Start our daemon and mlx_lm.server on the same model directory, then measure;
    every process is stopped and reaped before this returns."""
    model_dir = ensure_builtin_model(s.model)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    name = s.model.removeprefix("builtin:")
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)
    with (
        tempfile.TemporaryDirectory(prefix="mlx-bench-real-") as tmp_name,
        contextlib.ExitStack() as stack,
    ):
        tmp = Path(tmp_name)
        daemon = Daemon.start(stack, tmp, "real", f'hot_spare = false\ncpu_blas = "{s.cpu_blas}"\n',
                              client_timeout_s=REQUEST_TIMEOUT_S, http="127.0.0.1:0")  # fmt: skip
        ours_url = daemon.client.status().supervisor.http
        if ours_url is None:
            raise RuntimeError("the daemon's HTTP front is off (its port was taken?)")
        results["machine"]["daemon_http_url"] = ours_url
        fresh = stack.enter_context(
            httpx.Client(timeout=timeout, limits=httpx.Limits(max_keepalive_connections=0))
        )
        note(f"loading {s.model} ({model_dir}) in our daemon (HTTP {ours_url}) and mlx_lm.server")
        daemon.client.load(s.model, name, env=dict(s.runner_env))
        daemon.settle()
        ours_blas = mapped_blas(runner_pid(daemon.client, name))
        their_env = {}
        if s.theirs_blas == "same" and ours_blas is not None and "openblas" in ours_blas:
            their_env = {"LD_PRELOAD": ours_blas}
        with mlx_lm_server(model_dir, tmp / "mlx_lm_server.log", their_env) as port:
            pids = {"runner": runner_pid(daemon.client, name), "daemon": daemon.process.pid,
                    "server": server_pid(port)}  # fmt: skip
            results["machine"]["blas"] = {"ours": ours_blas, "theirs": mapped_blas(pids["server"])}
            note(f"BLAS: ours {ours_blas}, theirs {results['machine']['blas']['theirs']}")
            sides = Sides(ours_url, f"http://127.0.0.1:{port}", daemon.client, name,
                          fresh, fresh, pids)  # fmt: skip
            results["pids"] = pids
            warm_up(sides)
            note(f"1. chat: {s.epochs} x {s.turns} turns, ~{s.system_tokens}-token system prompt")
            results["chat"] = chat_family(sides, tokenizer, s)
            print(chat_table(s, results["chat"]) + "\n", flush=True)
            save()
            note(f"2. concurrency: {list(s.clients)} clients x {s.rounds} rounds")
            results["concurrency"] = concurrency_family(sides, s)
            print(concurrency_table(s, results["concurrency"]) + "\n", flush=True)
            save()
        results["daemon_exit"] = daemon.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true",
        help="smoke run: builtin:tiny, 2 turns, 1 round of 4 clients (~2 min)",
    )  # fmt: skip
    parser.add_argument("--model", default=None, help="builtin:smollm2 (builtin:tiny with --quick)")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=None, help="chat turns (6; 2 with --quick)")
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=1, help="conversations per side")
    parser.add_argument("--clients", type=int, nargs="+", default=None,
                        help="client counts (4 8; 4 with --quick)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds per client count (3; 1 with --quick)")  # fmt: skip
    parser.add_argument("--concurrent-tokens", type=int, default=32)
    parser.add_argument(
        "--cpu-blas",
        default="auto",
        help="our daemon's cpu_blas: auto (OpenBLAS where found), bundled, a path",
    )
    parser.add_argument("--theirs-blas", choices=("bundled", "same"), default="bundled",
                        help="mlx_lm.server with mlx's bundled BLAS (as installed), or preloaded "
                             "with the library our runner maps")  # fmt: skip
    parser.add_argument(
        "--runner-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="added to our runner's environment (e.g. OPENBLAS_NUM_THREADS=1)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    q = args.quick
    s = Settings(
        model=args.model or ("builtin:tiny" if q else "builtin:smollm2"),
        system_tokens=args.system_tokens,
        turns=args.turns or (2 if q else 6),
        answer_tokens=args.answer_tokens,
        epochs=args.epochs,
        clients=tuple(args.clients or ((4,) if q else (4, 8))),
        rounds=args.rounds or (1 if q else 3),
        concurrent_tokens=args.concurrent_tokens,
        cpu_blas=args.cpu_blas,
        theirs_blas=args.theirs_blas,
        runner_env=tuple(tuple(item.split("=", 1)) for item in args.runner_env),
    )
    results: dict[str, Any] = {
        "machine": machine_info(mlx_device()),
        "settings": {
            **asdict(s),
            "quick": q,
            "daemon_config": "hot_spare = false (no idle spare process beside the measurements)",
            "daemon_http": "MLX_SUPERVISOR_HTTP=127.0.0.1:0",
            "theirs": "python -m mlx_lm.server --model DIR --host 127.0.0.1 --port P (defaults)",
            "http_client": f"httpx {httpx.__version__}, a new connection per request",
            "concurrency_messages": app_messages(4, 0, 0),
            "chat_user_line": user_line(1),
        },
        "complete": False,
    }
    started = time.perf_counter()

    def save() -> None:
        results["wall_s"] = time.perf_counter() - started
        write_json(results, args.out)

    try:
        run(s, results, save)
    finally:  # what was measured before a failure stays in the JSON
        save()
    results["children_left"] = children_left()
    results["machine"]["loadavg_end"] = load_average()
    results["complete"] = True
    save()
    if results["children_left"]:
        note(f"WARNING: child processes left: {results['children_left']}")
    note(f"done in {results['wall_s']:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

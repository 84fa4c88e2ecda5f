"""The runner's engine (continuous batching, KV prefix cache) next to ``mlx_lm.server``.

Usage::

    python bench/bench_engine.py [--quick] [--only chat,concurrency,lookup,eviction]
                                 [--out bench/results/engine.json]

One run starts a private daemon and, per model, ``python -m mlx_lm.server`` on the same
model directory (its defaults: prompt cache of 10 sequences, batching), and measures:

1. **chat**: a multi-turn chat (a long system prompt, then turns that each append the
   answer that side returned and a new user line; greedy). Per turn, time to first
   token (client-side, to the first non-empty piece of text): ours / mlx_lm.server
   (target <= 0.8 from turn 2), ours / ours with ``cache=False`` on every request (a
   second conversation; target <= 0.2 from turn 3), and the prompt tokens each side
   computed (ours: ``prompt_tokens - cached_tokens``; mlx_lm.server:
   ``usage.prompt_tokens_details.cached_tokens``). The three sides take turns, in an
   order that rotates every turn. After each of our answers our runner prefills that
   chat's next turn while idle (next-turn prefill); every request, on any side, is sent
   once it has (a person replies later than that; the table says how long it took and
   how many tokens it computed ahead), so no side is timed beside it. builtin:tiny runs
   the issue's workload (a ~1,000-token system prompt, 8 turns, 16 tokens per answer).
   builtin:small runs a scaled-down one (~96 tokens, 6 turns, 8 tokens; --small-* to
   change it): on 2 shared CPU cores it
   prefills 3-9 tokens/s, so one uncached 1,000-token prompt takes 2-6 minutes, the
   issue's 8-turn run without the cache would take an hour, and a prefill chunk longer
   than ``prefill_stall_s`` (120 s) gets the runner killed as stalled.
2. **concurrency**: 4 and 8 clients started at the same moment (threads, a barrier),
   distinct raw prompts, 64 tokens each, on both sides in turn: aggregate tokens/s
   (ours / theirs, target >= 1.0) and the slowest client's TTFT (ours / theirs, target
   <= 1.0). builtin:tiny and builtin:small (tiny only with --quick). On small, beside
   it: the bf16 batch mismatch, 4 greedy requests served together vs each alone on our
   daemon (``cache=False``), compared piece by piece (one streamed piece per token).
3. **lookup**: ``runner.prefix_index.PrefixIndex.lookup`` in this process, with 10,
   100 and 1,000 stored chat-like entries of 1,000-2,000 tokens; the same queries for
   each size; us per lookup and the ratio 1000 / 10 (target <= 2).
4. **eviction**: 200 chat requests (10 system prompts x random user lines, 4 clients)
   on builtin:tiny with a small ``prefix_cache_bytes``; ``status`` read every 50 ms: the
   largest prefix-cache size seen against its budget (must never exceed it), hits,
   misses, evictions and tokens reused at the end, and the runner's peak RSS (VmHWM).

Order: 3, 4, then per model (tiny, small) 1 and 2. The machine is shared and noisy:
every figure is a ratio of things measured in this run, the sides alternating. Tables go
to stdout as each family ends, progress to stderr; the JSON (rewritten after each family,
``complete`` true at the end) has the machine, the settings and every raw sample. See
bench/README.md.

Each family is a module of its own (``engine_chat.py``, ``engine_concurrency.py``,
``engine_lookup.py``, ``engine_eviction.py``; what they share: ``engine_common.py``);
this script holds the settings and runs them.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Daemon, mlx_device, mlx_lm_server, note, write_json
from common import machine_info as common_machine_info
from engine_chat import ChatSettings, chat_family, chat_table
from engine_common import REQUEST_TIMEOUT_S, SHORT_NAMES, SMALL, TINY, warm_up
from engine_concurrency import (
    CONCURRENT_CLIENTS,
    CONCURRENT_TOKENS,
    MISMATCH_REQUESTS,
    MISMATCH_TOKENS,
    concurrency_family,
    concurrency_table,
    mismatch_family,
    mismatch_table,
)
from engine_eviction import (
    EVICTION_BUDGET_BYTES,
    EVICTION_CLIENTS,
    EVICTION_MODEL_NAME,
    EVICTION_SYSTEMS,
    EVICTION_TOKENS,
    eviction_family,
    eviction_table,
)
from engine_lookup import LOOKUP_SIZES, lookup_family, lookup_table
from runner.builtin import ensure_builtin_model

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "results" / "engine.json"


# --- the run ------------------------------------------------------------------------


ENGINE_SOURCES = tuple(
    f"runner/{name}.py"
    for name in ("engine", "batch", "batch_admission", "job", "next_turn", "solo", "stops",
                 "prefix_cache", "prefix_index")
)  # fmt: skip


def source_hashes() -> dict[str, str]:
    """sha256 (first 12 hex digits) of the engine's source files: the tree is shared and
    uncommitted, so the JSON says which code ran (read at the start and at the end)."""
    src = BENCH_DIR.parent / "src"
    return {
        name: hashlib.sha256((src / name).read_bytes()).hexdigest()[:12] for name in ENGINE_SOURCES
    }


def machine_info() -> dict[str, Any]:
    """The shared machine description, with the engine's source hashes (checked
    again at the end: a run whose engine changed under it says so)."""
    return {**common_machine_info(mlx_device()), "engine_sources_start": source_hashes()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: builtin:tiny only, fewer rounds (~2 min)"
    )
    parser.add_argument(
        "--only", default="chat,concurrency,lookup,eviction", help="comma-separated families to run"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--small-system-tokens",
        type=int,
        default=96,
        help="builtin:small chat: system prompt tokens (the issue: 1000)",
    )
    parser.add_argument(
        "--small-turns", type=int, default=6, help="builtin:small chat: turns (the issue: 8)"
    )
    parser.add_argument(
        "--small-answer-tokens",
        type=int,
        default=8,
        help="builtin:small chat: tokens per answer (the issue: 16)",
    )
    parser.add_argument(
        "--small-epochs",
        type=int,
        default=1,
        help="builtin:small chat: conversations per side (~4 min each)",
    )
    parser.add_argument(
        "--small-rounds",
        type=int,
        default=2,
        help="builtin:small concurrency: rounds per client count (~2.5 min each)",
    )
    parser.add_argument(
        "--eviction-requests",
        type=int,
        default=None,
        help="family 4 requests (default 200; 60 with --quick)",
    )
    args = parser.parse_args()
    families = set(args.only.split(","))
    models = [TINY] if args.quick else [TINY, SMALL]
    chat_settings = {
        TINY: ChatSettings(
            system_tokens=1000, turns=8, answer_tokens=16, epochs=1 if args.quick else 3
        ),
        SMALL: ChatSettings(
            args.small_system_tokens,
            args.small_turns,
            args.small_answer_tokens,
            epochs=args.small_epochs,
        ),
    }
    concurrency_rounds = {TINY: 1 if args.quick else 5, SMALL: args.small_rounds}
    lookup_rounds, lookup_count = (3, 300) if args.quick else (7, 2000)
    eviction_requests = args.eviction_requests or (60 if args.quick else 200)
    settings = {
        "quick": args.quick,
        "families": sorted(families),
        "models": models,
        "chat": {m: asdict(s) for m, s in chat_settings.items() if m in models},
        "concurrency": {
            "clients": CONCURRENT_CLIENTS,
            "tokens": CONCURRENT_TOKENS,
            "rounds": {m: concurrency_rounds[m] for m in models},
        },
        "mismatch": None
        if args.quick
        else {"requests": MISMATCH_REQUESTS, "tokens": MISMATCH_TOKENS, "model": SMALL},
        "lookup": {"sizes": LOOKUP_SIZES, "rounds": lookup_rounds, "lookups": lookup_count},
        "eviction": {
            "requests": eviction_requests,
            "clients": EVICTION_CLIENTS,
            "prefix_cache_bytes": EVICTION_BUDGET_BYTES,
            "tokens": EVICTION_TOKENS,
            "system_prompts": EVICTION_SYSTEMS,
        },
        "daemon_config": "hot_spare = false (no idle spare process beside the measurements)",
        "theirs": "python -m mlx_lm.server --model DIR --host 127.0.0.1 --port P (defaults)",
    }
    results: dict[str, Any] = {"machine": machine_info(), "settings": settings}
    started = time.perf_counter()

    def publish(table: str | None) -> None:
        """Print a family's table as soon as it is done, and save what we have so far:
        a run that fails late keeps the families before it (``complete`` says which)."""
        if table is not None:
            print(table + "\n", flush=True)
        results["wall_s"] = time.perf_counter() - started
        write_json(results, args.out)

    results["complete"] = False
    if "lookup" in families:
        note("3. prefix lookup (in-process)")
        results["lookup"] = lookup_family(lookup_rounds, lookup_count)
        publish(lookup_table(results["lookup"]))

    config = (
        "hot_spare = false\n\n[[models]]\n"
        f'name = "{EVICTION_MODEL_NAME}"\nmodel = "{TINY}"\n'
        f"prefix_cache_bytes = {EVICTION_BUDGET_BYTES}\n"
    )
    with (
        tempfile.TemporaryDirectory(prefix="mlx-bench-engine-") as tmp_name,
        contextlib.ExitStack() as stack,
    ):
        tmp = Path(tmp_name)
        client = Daemon.start(
            stack, tmp, "engine", config, client_timeout_s=REQUEST_TIMEOUT_S
        ).client
        if "eviction" in families:
            note(f"4. {eviction_requests} requests with a small prefix cache")
            tokenizer = Tokenizer.from_file(str(ensure_builtin_model(TINY) / "tokenizer.json"))
            client.load(TINY, EVICTION_MODEL_NAME)
            results["eviction"] = eviction_family(
                client, tokenizer, eviction_requests, EVICTION_BUDGET_BYTES
            )
            client.unload(EVICTION_MODEL_NAME)
            publish(eviction_table(results["eviction"]))
        results["chat"], results["concurrency"] = {}, {}
        for model in models if families & {"chat", "concurrency"} else []:
            model_dir = ensure_builtin_model(model)
            tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
            name = SHORT_NAMES[model]
            note(f"loading {model} in our daemon and in mlx_lm.server")
            client.load(model, name)
            with mlx_lm_server(model_dir, tmp / f"mlx_lm_server_{name}.log") as port:
                warm_up(client, name, port)
                if "chat" in families:
                    note(f"1. multi-turn chat on {model}")
                    results["chat"][model] = chat_family(
                        client, name, port, tokenizer, chat_settings[model]
                    )
                    publish(chat_table(model, results["chat"][model]))
                if "concurrency" in families:
                    note(f"2. concurrent clients on {model}")
                    results["concurrency"][model] = concurrency_family(
                        client, name, port, concurrency_rounds[model], CONCURRENT_TOKENS
                    )
                    publish(concurrency_table({model: results["concurrency"][model]}))
                    if model == SMALL:
                        note(f"2b. batch mismatch on {model}")
                        results["mismatch"] = mismatch_family(client, name, MISMATCH_TOKENS)
                        publish(mismatch_table(SMALL, results["mismatch"]))
            client.unload(name)
    results["complete"] = True
    results["machine"]["loadavg_end"] = list(os.getloadavg())
    results["machine"]["engine_sources_end"] = source_hashes()
    if results["machine"]["engine_sources_end"] != results["machine"]["engine_sources_start"]:
        note("WARNING: the engine's source files changed during the run (see the JSON)")
    publish(None)
    note(f"done in {results['wall_s']:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

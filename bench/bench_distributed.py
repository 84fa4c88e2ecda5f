"""A model sharded over 2 rank processes (mx.distributed, ring over loopback)
next to the same model in one process, through the same daemon.

Usage::

    python bench/bench_distributed.py [--model builtin:tiny] [--rounds 5] [--kills 10]
                                      [--out bench/results/distributed.json]

Figures, each measured side by side in this one run (the two sides alternate,
the order flipping every round):

1. Load to ready: ``Client.load`` of the 2-rank group / of one process. The
   daemon keeps no hot spare, so both sides start fresh processes (import
   mlx, load); the group also forms its ring and every rank loads its shard
   with mlx-lm's ``sharded_load``.
2. Decode tokens/s, group / one process: greedy, streamed; rate = (tokens - 1)
   / (first chunk -> done) as the client sees it. Both sides must produce the
   same text (fp32 tensor parallel keeps the greedy tokens). On 2 CPU cores
   two ranks share the cores and add two ``all_sum`` per layer per token, so
   this is below 1 here; it is reported, not a target.
3. Rank death: SIGKILL rank 1 mid-stream. Kill -> the whole group torn down
   (the daemon's ``group_exited``: every rank reaped) and kill -> ready again
   (``model_ready``), p50 / p99 over ``--kills`` kills; ready again is also
   shown against the group's own load time. The daemon restarts at once
   (no backoff, no restart limit) so that this times the restart itself.

Daemon-side times come from its JSON log (UTC, microseconds), compared with
the wall clock at the moment of the kill.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS_DIR,
    Daemon,
    alternate,
    first_record,
    machine_info,
    note,
    runner_info,
    write_json,
)
from supervisor.client import Client
from supervisor.daemon.logs import log_time
from supervisor.figures import median, percentiles, render_table

DEFAULT_OUT = RESULTS_DIR / "distributed.json"
RANKS = 2
PROMPT = "Once upon a time, in a small town by the sea,"


def timed_load(client: Client, model: str, name: str, ranks: int | None) -> float:
    started = time.perf_counter()
    client.load(model, name, ranks=ranks)
    return time.perf_counter() - started


def decode(client: Client, name: str, tokens: int) -> tuple[float, str]:
    """Tokens/s from the first chunk to done, and the text."""
    pieces, first = [], None
    with client.generate(name, PROMPT, max_tokens=tokens, temperature=0.0) as gen:
        for piece in gen:
            if first is None:
                first = time.perf_counter()
            pieces.append(piece)
    ended = time.perf_counter()
    assert gen.done is not None and first is not None
    if gen.done.generation_tokens != tokens:
        raise RuntimeError(f"{name} stopped at {gen.done.generation_tokens} of {tokens} tokens")
    return (tokens - 1) / (ended - first), "".join(pieces)


def load_family(d: Daemon, model: str, rounds: int) -> dict[str, Any]:
    single, group, ratios = [], [], []
    for r in range(rounds):
        times: dict[str, float] = {}
        for side in alternate(r, "single", "group"):
            ranks = RANKS if side == "group" else None
            times[side] = timed_load(d.client, model, f"{side}{r}", ranks)
            d.client.unload(f"{side}{r}")
        single.append(times["single"])
        group.append(times["group"])
        ratios.append(times["group"] / times["single"])
        note(f"  load round {r}: single {times['single']:.2f}s, group {times['group']:.2f}s")
    return {"single_s": single, "group_s": group, "ratios": ratios, "ratio": median(ratios)}


def decode_family(d: Daemon, model: str, rounds: int, tokens: int) -> dict[str, Any]:
    d.client.load(model, "single")
    d.client.load(model, "group", ranks=RANKS)
    single, group, ratios, same = [], [], [], []
    for r in range(rounds):
        rates: dict[str, float] = {}
        texts: dict[str, str] = {}
        for side in alternate(r, "single", "group"):
            rates[side], texts[side] = decode(d.client, side, tokens)
        single.append(rates["single"])
        group.append(rates["group"])
        ratios.append(rates["group"] / rates["single"])
        same.append(texts["single"] == texts["group"])
        note(f"  decode round {r}: single {rates['single']:.1f}, group {rates['group']:.1f} tok/s")
    d.client.unload("single")
    d.client.unload("group")
    return {
        "tokens": tokens,
        "single_tps": single,
        "group_tps": group,
        "ratios": ratios,
        "ratio": median(ratios),
        "same_text": same,
    }


def kill_family(d: Daemon, model: str, kills: int) -> dict[str, Any]:
    torn_down, ready_again, client_error = [], [], []
    load_s = timed_load(d.client, model, "victim", RANKS)
    for k in range(kills):
        info = runner_info(d.client, "victim")
        pid = info.ranks[1].pid
        assert pid is not None and info.state == "ready"
        failed_at = None
        with d.client.generate("victim", PROMPT, max_tokens=100_000) as gen:
            next(gen)
            killed_at = time.time()
            os.kill(pid, signal.SIGKILL)
            try:
                list(gen)
            except Exception:
                failed_at = time.time()
        gone = first_record(d.process, "group_exited", after=killed_at, timeout_s=120)
        ready = first_record(d.process, "model_ready", after=killed_at, model="victim")
        torn_down.append(log_time(gone) - killed_at)
        ready_again.append(log_time(ready) - killed_at)
        if failed_at is not None:
            client_error.append(failed_at - killed_at)
        note(f"  kill {k}: torn down {torn_down[-1] * 1000:.0f} ms, "
             f"ready again {ready_again[-1]:.2f}s")  # fmt: skip
    d.client.unload("victim")
    return {
        "load_s": load_s,
        "torn_down_s": torn_down,
        "ready_again_s": ready_again,
        "client_error_s": client_error,
        "torn_down_ms": {k: v * 1000 for k, v in percentiles(torn_down, (50, 99)).items()},
        "ready_again": percentiles(ready_again, (50, 99)),
        "client_error_ms": {k: v * 1000 for k, v in percentiles(client_error, (50, 99)).items()},
        "ready_again_over_load": median(ready_again) / load_s,
    }


def table(r: dict[str, Any]) -> str:
    load, dec, kill = r["load"], r["decode"], r["kill"]
    same = sum(dec["same_text"])
    rows = [
        ("load to ready, 2-rank group / one process (median of per-round ratios)",
         f"{load['ratio']:.2f} ({median(load['group_s']):.2f}s / {median(load['single_s']):.2f}s)"),
        (f"decode tok/s, group / one process ({dec['tokens']} tokens, greedy)",
         f"{dec['ratio']:.2f} ({median(dec['group_tps']):.1f} / {median(dec['single_tps']):.1f})"),
        ("  same text on both sides", f"{same}/{len(dec['same_text'])} rounds"),
        ("rank 1 SIGKILLed mid-stream -> whole group torn down (p50 / p99)",
         f"{kill['torn_down_ms']['p50']:.0f} / {kill['torn_down_ms']['p99']:.0f} ms"),
        ("  -> the streaming client gets its error (p50 / p99)",
         f"{kill['client_error_ms']['p50']:.0f} / {kill['client_error_ms']['p99']:.0f} ms"),
        ("rank 1 SIGKILLed -> group ready again (p50 / p99)",
         f"{kill['ready_again']['p50']:.2f} / {kill['ready_again']['p99']:.2f} s"),
        ("  ready again / the group's own load", f"{kill['ready_again_over_load']:.2f}"),
    ]  # fmt: skip
    title = (f"model {r['model']}, {RANKS} ranks (ring over loopback), {r['rounds']} rounds, "
             f"{len(kill['torn_down_s'])} kills")  # fmt: skip
    return f"{title}\n{render_table(None, rows)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=256, help="decode tokens per request")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mlx-supervisor-bench-") as tmp, ExitStack() as stack:
        # No hot spare: a load starts fresh processes on both sides. Restarts at
        # once and without limit: figure 3 times the restart itself, not a backoff.
        config = "hot_spare = false\nrestart_backoff_s = 0.0\nmax_restarts = 1000\n"
        d = Daemon.start(stack, Path(tmp), "dist", config, client_timeout_s=300)
        note("1. load to ready")
        load = load_family(d, args.model, args.rounds)
        note("2. decode")
        dec = decode_family(d, args.model, args.rounds, args.tokens)
        note("3. rank death")
        kill = kill_family(d, args.model, args.kills)
        d.shutdown()
    result = {
        "machine": machine_info("n/a (runners only)"),
        "model": args.model,
        "ranks": RANKS,
        "rounds": args.rounds,
        "load": load,
        "decode": dec,
        "kill": kill,
        "wall_s": time.perf_counter() - started,
    }
    print(table(result))
    write_json(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

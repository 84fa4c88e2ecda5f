"""What the daemon costs compared with plain in-process mlx-lm, measured side by side.

Usage::

    python bench/bench_daemon.py [--model builtin:small] [--quick] [--per-token-only]
                                 [--out bench/results/daemon.json]

One run starts a private daemon (on a socket in a temp dir) and a plain python
worker (``bench/inproc_worker.py``) and measures, alternating between the two
sides and never running both models at once:

1. decode tokens/s through the daemon / in-process ``mlx_lm.stream_generate``;
2. time to first token through the daemon - in-process (the two IPC hops);
3. load-to-ready through the daemon / a fresh ``python -c "mlx_lm.load(...)"``;
4. the share of memory given back to the system when a model is unloaded,
   beside ``del model; gc.collect(); mx.clear_cache()`` in a python process;
5. per-token, as a user sees it: the rate of ``mlx-supervisor generate --json``
   streaming from the daemon, read from its stdout, / ``stream_generate`` in a fresh
   python process, on builtin:tiny; each round a fresh runner and worker, with
   several timed pairs back to back (``--per-token-only`` runs this one alone).

The machine is shared and noisy, so every figure is a ratio or a difference of
things measured in this same run. It prints a table and writes the JSON
(machine info, settings, every raw sample). See bench/README.md.

Each figure family is a module of its own (``daemon_decode.py``, ``daemon_ttft.py``,
``daemon_load.py``, ``daemon_memory.py``, ``daemon_per_token.py``; what they share:
``daemon_common.py``); this script holds the settings, runs them and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS_DIR,
    Daemon,
    children_left,
    load_average,
    machine_info,
    mlx_device,
    note,
    worker,
    write_json,
)
from daemon_common import IPC_MODEL, Row, model_info, model_path, short
from daemon_decode import bench_decode, decode_rows
from daemon_load import bench_load, load_rows
from daemon_memory import bench_memory, memory_rows
from daemon_per_token import PER_TOKEN_MODEL, bench_per_token, per_token_rows
from daemon_ttft import bench_ttft, ttft_rows
from supervisor.figures import render_table

DEFAULT_OUT = RESULTS_DIR / "daemon.json"


@dataclass(frozen=True)
class Settings:
    model: str
    decode_tokens: int
    decode_epochs: int  # fresh worker + runner each
    decode_rounds: int  # per epoch
    ttft_pairs: int
    ipc_model: str | None  # also measured for figures 1 and 2 (None: the model is tiny)
    ipc_decode_tokens: int
    ipc_ttft_pairs: int
    load_rounds: int
    memory_rounds: int
    quick: bool = False
    ttft_tokens: int = 2
    memory_tokens: int = 4
    warmup_tokens: int = 4
    ttft_warmup: int = 3
    per_token_rounds: int = 5  # a fresh worker and a fresh runner each
    per_token_tokens: int = 512  # ~0.5-1 s of decode on builtin:tiny
    per_token_only: bool = False
    per_token_model: str = PER_TOKEN_MODEL


def settings_from_args(args: argparse.Namespace) -> Settings:
    model = args.model or ("builtin:tiny" if args.quick else "builtin:small")
    ipc_model = None if model == IPC_MODEL else IPC_MODEL
    if args.quick:
        base = Settings(
            model, 128, 2, 2, 30, ipc_model, 128, 30, 2, 1, quick=True, per_token_rounds=2
        )
    else:
        base = Settings(model, 32, 3, 3, 15, ipc_model, 128, 200, 5, 5)
    overrides = {
        "decode_tokens": args.decode_tokens,
        "decode_epochs": args.epochs,
        "decode_rounds": args.rounds,
        "ttft_pairs": args.ttft_pairs,
        "load_rounds": args.load_rounds,
        "memory_rounds": args.memory_rounds,
        "ttft_tokens": args.ttft_tokens,
        "per_token_rounds": args.per_token_rounds,
        "per_token_tokens": args.per_token_tokens,
    }
    fields = {**asdict(base), **{k: v for k, v in overrides.items() if v is not None}}
    return Settings(**{**fields, "per_token_only": args.per_token_only,
                       "per_token_model": args.per_token_model or PER_TOKEN_MODEL})  # fmt: skip


# --- the run -----------------------------------------------------------------


def run(settings: Settings) -> dict[str, Any]:
    started = time.perf_counter()
    at_start = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "loadavg_start": load_average(),
    }
    s = settings
    model, ipc_model = s.model, s.ipc_model
    models = [model] + ([ipc_model] if ipc_model else [])
    if s.per_token_model not in models:
        models.append(s.per_token_model)
    paths = {m: model_path(m) for m in models}
    results: dict[str, Any] = {"settings": asdict(s)}
    with (
        tempfile.TemporaryDirectory(prefix="mlx-bench-") as tmp_name,
        contextlib.ExitStack() as stack,
    ):
        tmp = Path(tmp_name)
        daemon = Daemon.start(stack, tmp, "daemon", "# defaults\n")
        results["daemon"] = {"pid": daemon.process.pid, "hot_spare": daemon.keeps_spare}
        note(f"daemon pid {daemon.process.pid}")
        if s.per_token_only:
            results["machine"] = {**machine_info(mlx_device()), **at_start}
            per_token_path = paths[s.per_token_model]
            results["models"] = {s.per_token_model: model_info(s.per_token_model, per_token_path)}
        else:
            results.update(figures_1_to_4(s, daemon, paths, at_start, stack, tmp))
        note("figure 5: per-token, the CLI streaming vs a fresh in-process stream_generate")
        results["per_token_cli"] = bench_per_token(
            daemon, paths[s.per_token_model], s.per_token_rounds, s.per_token_tokens,
            s.warmup_tokens, tmp, model=s.per_token_model,
        )  # fmt: skip
        results["daemon"]["exit"] = daemon.shutdown()
    results["children_left"] = children_left()
    results["machine"]["loadavg_end"] = load_average()
    results["duration_s"] = time.perf_counter() - started
    return results


def figures_1_to_4(
    s: Settings,
    daemon: Daemon,
    paths: dict[str, Path],
    at_start: dict[str, Any],
    stack: contextlib.ExitStack,
    tmp: Path,
) -> dict[str, Any]:
    """Decode, TTFT, load and memory (the JSON's ``decode``, ``ttft``, ``load`` and
    ``memory``), with ``machine`` (from the worker) and ``models``."""
    model, ipc_model, client = s.model, s.ipc_model, daemon.client
    models = list(paths)
    results: dict[str, Any] = {}
    note("figure 1: decode tokens/s")
    decode_args = (s.decode_epochs, s.decode_rounds, s.warmup_tokens, tmp)
    results["decode"] = [bench_decode(daemon, model, paths[model], s.decode_tokens, *decode_args)]
    if ipc_model:
        results["decode"].append(
            bench_decode(daemon, ipc_model, paths[ipc_model], s.ipc_decode_tokens, *decode_args)
        )
    note("figure 2: time to first token")
    with worker(tmp / "worker.log") as w:
        results["machine"] = {**machine_info(w.hello["device"]), **at_start}
        results["models"] = {m: model_info(m, paths[m]) for m in models}
        for m in models:
            w.request("load", key=short(m), path=str(paths[m]))
            client.load(m, short(m))
        daemon.settle()
        results["ttft"] = [bench_ttft(client, w, model, s.ttft_pairs, s.ttft_warmup, s.ttft_tokens)]
        if ipc_model:
            results["ttft"].append(
                bench_ttft(client, w, ipc_model, s.ipc_ttft_pairs, s.ttft_warmup, s.ttft_tokens)
            )
        for m in models:
            client.unload(short(m))
    note("figure 3: load to ready")
    daemons = {"daemon": daemon}
    if daemon.keeps_spare:
        # the same daemon without its hot spare: every load starts python and imports mlx
        daemons = {
            "hot spare": daemon,
            "no spare": Daemon.start(stack, tmp, "cold", "hot_spare = false\n"),
        }
    results["load"] = bench_load(daemons, model, paths[model], s.load_rounds)
    for d in daemons.values():
        if d is not daemon:
            d.shutdown()
    note("figure 4: memory given back")
    results["memory"] = bench_memory(
        daemon, model, paths[model], s.memory_rounds, s.memory_tokens, tmp
    )
    return results


# --- the table ---------------------------------------------------------------


def table(results: dict[str, Any]) -> str:
    rows: list[Row] = []
    for d in results.get("decode", []):
        rows += decode_rows(d)
    ttfts = results.get("ttft", [])
    for index, t in enumerate(ttfts):
        rows += ttft_rows(t, checked=index == len(ttfts) - 1)
    if "load" in results:
        rows += load_rows(results["load"])
    if "memory" in results:
        rows += memory_rows(results["memory"])
    rows += per_token_rows(results["per_token_cli"])
    header: Row = ("figure", "daemon", "in-process", "result", "target", "")
    mach = results["machine"]
    quick = " (--quick: a smoke run, not a measurement)" if results["settings"]["quick"] else ""
    title = (
        f"mlx-supervisor daemon vs in-process mlx-lm{quick}, {mach['date']}\n"
        f"{mach['platform']}, {mach['cpu_count']} CPUs ({mach['cpu']}), "
        f"{mach['memory_total_bytes'] / 2**30:.1f} GiB, python {mach['python']}, "
        f"mlx {mach['mlx']} on {mach['mlx_device']}, mlx-lm {mach['mlx_lm']}"
    )
    footer = (
        f"ran {results['duration_s']:.0f} s; load average {mach['loadavg_start'][0]:.2f} at "
        f"start, {mach['loadavg_end'][0]:.2f} at end; child processes left: "
        f"{len(results['children_left'])}"
    )
    return "\n".join([title, "", render_table(header, rows), "", footer])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="builtin:NAME or a model directory (builtin:small)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny, few rounds")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    parser.add_argument("--decode-tokens", type=int, help="max_tokens of figure 1's decodes")
    parser.add_argument("--epochs", type=int, help="figure 1's fresh process pairs")
    parser.add_argument("--rounds", type=int, help="figure 1's rounds per epoch")
    parser.add_argument("--ttft-pairs", type=int, help="figure 2's pairs for --model")
    parser.add_argument("--ttft-tokens", type=int, help="max_tokens of figure 2's requests (2)")
    parser.add_argument("--load-rounds", type=int, help="figure 3's rounds")
    parser.add_argument("--memory-rounds", type=int, help="figure 4's rounds")
    parser.add_argument("--per-token-rounds", type=int, help="figure 5's rounds (5; --quick 2)")
    parser.add_argument("--per-token-tokens", type=int, help="max_tokens of figure 5 (512)")
    parser.add_argument(
        "--per-token-only", action="store_true", help="run figure 5 alone (per-token, CLI)"
    )
    parser.add_argument("--per-token-model", help=f"figure 5's model ({PER_TOKEN_MODEL})")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(settings_from_args(args))
    write_json(results, args.out)
    print(table(results))
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

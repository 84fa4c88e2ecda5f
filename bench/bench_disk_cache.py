"""The prefix cache's disk tier: a chat warm after its runner's process ends,
and what writing the blocks costs.

Usage::

    python bench/bench_disk_cache.py [--models builtin:small builtin:smollm2]
                                     [--system-tokens 600] [--turns 3] [--overhead-rounds 4]
                                     [--out bench/results/disk_cache.json]

**1. Warm after death.** A multi-turn chat (a system prompt of ``--system-tokens``
tokens, ``--answer-tokens`` greedy tokens per answer) through a private daemon's
socket. From turn 2, the same turn (the history so far and a new user line; every
variant of the line has the same token count, so no variant finds another's KV) is
asked in six ways, one after the other, each timed to its first token (client-side):

- ``warm``: the runner alive, its RAM cache warm (the anchor);
- ``killed``: after a SIGKILL of the runner and the daemon's restart of it;
- ``unloaded``: after an unload and a load;
- ``expired``: after a keep-alive expiry (the load before it gave a 2 s keep-alive)
  and a load;
- ``no cache``: the request with ``cache`` off (every prompt token computed);
- ``theirs``: ``mlx_lm.server`` on the same directory, restarted (it restarts cold:
  its prompt cache is in RAM only).

Each new runner is measured once it is ready and the daemon settled (the load
itself is the same with or without the disk tier). The chat goes on with the warm
answer. Targets: each way ÷ warm ≤ 1.5, and ≤ 0.2 of no cache.

**2. Overhead.** The same model under two names in one daemon, ``disk`` (the disk tier
on) and ``ram`` (``prefix_cache_disk_bytes = 0``); per round, a chat of
``--overhead-turns`` turns on each (the order flips every round), each turn sent as
soon as the last ended, so the blocks of one turn are written while the next one
prefills and decodes. Decode tok/s (client-side, first text to the end) of disk ÷
ram per round, median over rounds (target ≥ 0.97). Then the bytes on disk per cached
token (from the index: the blocks' file bytes ÷ their tokens), with and without
8-bit KV (a third name, ``disk8``), next to the KV cache's own bytes per token.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tokenizers import Tokenizer

from common import (
    RESULTS_DIR,
    Daemon,
    cpu_s,
    fmt,
    load_average,
    machine_info,
    mlx_device,
    mlx_lm_server,
    note,
    quotient,
    runner_info,
    verdict,
    write_json,
)
from engine_chat import system_prompt
from engine_common import REQUEST_TIMEOUT_S, Sample, ours_request, theirs_request
from runner.builtin import ensure_builtin_model
from supervisor.client import Client
from supervisor.figures import render_table

DEFAULT_OUT = RESULTS_DIR / "disk_cache.json"
WAYS = ("warm", "killed", "unloaded", "expired", "no_cache", "theirs")
VARIANTS = dict(zip(WAYS, "ABCDEF", strict=True))
WARM_TARGET, NO_CACHE_TARGET, OVERHEAD_TARGET = 1.5, 0.2, 0.97
EXPIRY_KEEP_ALIVE_S = 2.0
POLL_S = 0.02  # status has no event for "written": it is read this often


def user_line(turn: int, variant: str) -> str:
    return f"({variant}) Question {turn}: what does rule {turn * 7} say, and why?"


def written(client: Client, name: str) -> bool:
    """The runner is ready, has prefilled the next turns it owes and written its blocks."""
    info = runner_info(client, name)
    cache, turns = info.prefix_cache, info.next_turn
    disk = cache.disk if cache is not None else None
    return (info.state == "ready" and (disk is None or disk.pending == 0)
            and (turns is None or turns.pending == 0))  # fmt: skip


def wait(condition: Any, what: str, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(POLL_S)


def quiet(daemon: Daemon, *names: str) -> None:
    """Nothing of the daemon's runs: runners ready, blocks written, the spare warm."""
    for name in names:
        wait(lambda name=name: written(daemon.client, name), f"{name} never wrote its blocks")
    daemon.settle(REQUEST_TIMEOUT_S)


def disk_figures(client: Client, name: str) -> dict[str, Any]:
    cache = runner_info(client, name).prefix_cache
    disk = cache.disk if cache is not None else None
    return {} if disk is None else {"hits": disk.hits, "tokens_restored": disk.tokens_restored,
                                    "rejected": disk.rejected, "entries": disk.entries,
                                    "bytes": disk.bytes}  # fmt: skip


def warm_family(stack: contextlib.ExitStack, tmp: Path, model: str, args: argparse.Namespace
                ) -> dict[str, Any]:  # fmt: skip
    model_dir = ensure_builtin_model(model) if model.startswith("builtin:") else Path(model)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    label = model.replace("builtin:", "")
    daemon = Daemon.start(stack, tmp, f"warm-{label}", "", client_timeout_s=REQUEST_TIMEOUT_S)
    client = daemon.client
    client.load(model, "m")
    system, system_count = system_prompt(tokenizer, args.system_tokens, 0)
    history: list[dict[str, str]] = [{"role": "system", "content": system}]

    def ask(turn: int, way: str, cache: bool = True) -> Sample:
        messages = [*history, {"role": "user", "content": user_line(turn, VARIANTS[way])}]
        return ours_request(client, "m", messages=messages, max_tokens=args.answer_tokens,
                            cache=cache, side=way)  # fmt: skip

    first = ask(1, "warm")
    history += [{"role": "user", "content": user_line(1, "A")},
                {"role": "assistant", "content": first.text}]  # fmt: skip
    quiet(daemon, "m")
    rows: list[dict[str, Any]] = []
    for turn in range(2, args.turns + 1):
        samples: dict[str, Sample] = {}
        samples["warm"] = ask(turn, "warm")
        quiet(daemon, "m")

        pid = runner_info(client, "m").pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait(lambda pid=pid: runner_info(client, "m").pid not in (None, pid)
             and runner_info(client, "m").state == "ready", "no restart")  # fmt: skip
        quiet(daemon, "m")
        samples["killed"] = ask(turn, "killed")
        quiet(daemon, "m")

        client.unload("m")
        client.load(model, "m", keep_alive_s=EXPIRY_KEEP_ALIVE_S)
        daemon.settle(REQUEST_TIMEOUT_S)
        samples["unloaded"] = ask(turn, "unloaded")
        wait(lambda: all(r.name != "m" for r in client.status().runners), "no expiry")
        client.load(model, "m")
        quiet(daemon, "m")
        samples["expired"] = ask(turn, "expired")
        quiet(daemon, "m")

        samples["no_cache"] = ask(turn, "no_cache", cache=False)
        quiet(daemon, "m")
        messages = [*history, {"role": "user", "content": user_line(turn, "F")}]
        with mlx_lm_server(model_dir, tmp / f"mlx_lm_server_{label}_{turn}.log") as port:
            samples["theirs"] = theirs_request(port, messages=messages,
                                               max_tokens=args.answer_tokens)  # fmt: skip
        row: dict[str, Any] = {"turn": turn, "disk": disk_figures(client, "m")}
        for way, sample in samples.items():
            row[way] = sample.record()
        for way in ("killed", "unloaded", "expired"):
            row[f"{way}_over_warm"] = quotient(samples[way].ttft_s, samples["warm"].ttft_s)
            row[f"{way}_over_no_cache"] = quotient(samples[way].ttft_s,
                                                   samples["no_cache"].ttft_s)  # fmt: skip
        row["theirs_over_killed"] = quotient(samples["theirs"].ttft_s, samples["killed"].ttft_s)
        rows.append(row)
        note(f"  {label} turn {turn}: " + ", ".join(
            f"{way} {fmt(s.ttft_s, '.0f', 1e3, ' ms')} ({s.computed_tokens} computed)"
            for way, s in samples.items()))  # fmt: skip
        history += [{"role": "user", "content": user_line(turn, "A")},
                    {"role": "assistant", "content": samples["warm"].text}]  # fmt: skip
    client.unload("m")
    return {"model": model, "system_prompt_tokens": system_count, "turns": rows}


def warm_table(result: dict[str, Any]) -> str:
    header = ["turn", "prompt tok", *[f"TTFT {w}" for w in WAYS],
              "killed/warm", "unloaded/warm", "expired/warm", "target<=1.5",
              "worst/no-cache", "target<=0.2", "theirs/killed",
              "computed (warm, killed)"]  # fmt: skip
    rows = []
    for r in result["turns"]:
        over_warm = [r[f"{w}_over_warm"] for w in ("killed", "unloaded", "expired")]
        over_none = [r[f"{w}_over_no_cache"] for w in ("killed", "unloaded", "expired")]
        worst_warm = max(v for v in over_warm if v is not None)
        worst_none = max(v for v in over_none if v is not None)
        rows.append([
            str(r["turn"]), str(r["warm"]["prompt_tokens"]),
            *[fmt(r[w]["ttft_s"], ".0f", 1e3, " ms") for w in WAYS],
            *[fmt(v, ".2f") for v in over_warm], verdict(worst_warm <= WARM_TARGET),
            fmt(worst_none, ".3f"), verdict(worst_none <= NO_CACHE_TARGET),
            fmt(r["theirs_over_killed"], ".1f"),
            f"{r['warm']['computed_tokens']}, {r['killed']['computed_tokens']}",
        ])  # fmt: skip
    title = (f"1. Warm after death, {result['model']}: system prompt "
             f"{result['system_prompt_tokens']} tokens; TTFT client-side, each new runner "
             "measured once ready")  # fmt: skip
    return title + "\n" + render_table(header, rows)


def tokens_on_disk(directory: str) -> int:
    with sqlite3.connect(Path(directory) / "index.sqlite") as db:
        (count,) = db.execute("SELECT coalesce(sum(length(tokens)), 0) / 4 FROM blocks").fetchone()
    return int(count)


def overhead_family(stack: contextlib.ExitStack, tmp: Path, model: str,
                    args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    model_dir = ensure_builtin_model(model) if model.startswith("builtin:") else Path(model)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    config = "".join(
        f'[[models]]\nname = "{name}"\nmodel = "{model}"\n{extra}\n'
        for name, extra in (("disk", ""), ("ram", "prefix_cache_disk_bytes = 0"),
                            ("disk8", "kv_bits = 8")))  # fmt: skip
    daemon = Daemon.start(stack, tmp, "overhead", config, client_timeout_s=REQUEST_TIMEOUT_S)
    client = daemon.client
    rounds = []
    for index in range(args.overhead_rounds):
        # Fresh runners every round (a process keeps its own decode speed for its
        # life: only new processes average that out), loaded in turns.
        order = ("disk", "ram") if index % 2 == 0 else ("ram", "disk")
        for name in order:
            client.load(model, name)
        quiet(daemon, "disk", "ram")
        disk_pid = runner_info(client, "disk").pid
        assert disk_pid is not None
        cpu_before = cpu_s(disk_pid)
        rates: dict[str, list[float]] = {}
        for name in order:
            system, _ = system_prompt(tokenizer, args.overhead_system_tokens, 100 + index)
            history: list[dict[str, str]] = [{"role": "system", "content": system}]
            rates[name] = []
            for turn in range(1, args.overhead_turns + 1):
                messages = [*history, {"role": "user", "content": user_line(turn, "A")}]
                sample = ours_request(client, name, messages=messages,
                                      max_tokens=args.overhead_tokens, side=name)  # fmt: skip
                history = [*messages, {"role": "assistant", "content": sample.text}]
                if sample.first_text_at is not None and sample.generation_tokens > 1:
                    rates[name].append((sample.generation_tokens - 1)
                                       / (sample.ended_at - sample.first_text_at))  # fmt: skip
            quiet(daemon, "disk", "ram")  # the blocks written before the other side runs
        runner_cpu = cpu_s(disk_pid) - cpu_before
        info = runner_info(client, "disk")
        assert info.prefix_cache is not None and info.prefix_cache.disk is not None
        disk = info.prefix_cache.disk
        ratio = quotient(statistics.median(rates["disk"]), statistics.median(rates["ram"]))
        share = quotient(disk.save_s + disk.writer_cpu_s, runner_cpu)
        rounds.append({"order": list(order), "tps": rates, "disk_over_ram": ratio,
                       "runner_cpu_s": runner_cpu, "save_s": disk.save_s,
                       "writer_cpu_s": disk.writer_cpu_s, "blocks_written": disk.written,
                       "tier_share": share})  # fmt: skip
        note(f"  overhead round {index}: disk/ram {fmt(ratio, '.3f')}, the tier's share of the "
             f"runner's CPU {fmt(rounds[-1]['tier_share'], '.4f')}")  # fmt: skip
        for name in ("disk", "ram"):
            client.unload(name)
    sizes = {}
    client.load(model, "disk")
    client.load(model, "disk8")
    system, _ = system_prompt(tokenizer, args.overhead_system_tokens, 999)
    ours_request(client, "disk8", messages=[{"role": "system", "content": system},
                                            {"role": "user", "content": user_line(1, "A")}],
                 max_tokens=args.overhead_tokens)  # fmt: skip
    quiet(daemon, "disk8")
    for name in ("disk", "disk8"):
        info = runner_info(client, name)
        assert info.prefix_cache is not None and info.prefix_cache.disk is not None
        disk = info.prefix_cache.disk
        tokens = tokens_on_disk(str(disk.directory))
        sizes[name] = {"bytes": disk.bytes, "tokens": tokens, "blocks": disk.entries,
                       "bytes_per_token": quotient(disk.bytes, tokens),
                       "write_errors": disk.write_errors, "skipped": disk.skipped}  # fmt: skip
    ratios = [r["disk_over_ram"] for r in rounds if r["disk_over_ram"] is not None]
    shares = [r["tier_share"] for r in rounds if r["tier_share"] is not None]
    return {"model": model, "rounds": rounds, "disk_over_ram": statistics.median(ratios),
            "tier_share": statistics.median(shares), "sizes": sizes}  # fmt: skip


def overhead_table(result: dict[str, Any], kv_bytes_per_token: float | None) -> str:
    sizes = result["sizes"]
    ratio = result["disk_over_ram"]
    rows = [["decode tok/s, disk tier writing ÷ off (median of rounds)", fmt(ratio, ".3f"),
             verdict(ratio >= OVERHEAD_TARGET)],
            ["rounds", ", ".join(fmt(r["disk_over_ram"], ".3f") for r in result["rounds"]), ""],
            ["the disk tier's CPU (main-thread copies + writer thread) ÷ the runner's CPU",
             fmt(result["tier_share"], ".4f"), ""],
            ["disk bytes per cached token (16-bit KV)",
             fmt(sizes["disk"]["bytes_per_token"], ".0f"), ""],
            ["disk bytes per cached token (8-bit KV)",
             fmt(sizes["disk8"]["bytes_per_token"], ".0f"), ""],
            ["the KV cache's own bytes per token (16-bit)",
             fmt(kv_bytes_per_token, ".0f"), ""]]  # fmt: skip
    return (f"2. Overhead, {result['model']}\n"
            + render_table(["figure", "value", "target>=0.97"], rows))  # fmt: skip


def kv_bytes_per_token(model: str) -> float | None:
    model_dir = ensure_builtin_model(model) if model.startswith("builtin:") else Path(model)
    config = json.loads((model_dir / "config.json").read_text())
    heads = config.get("num_key_value_heads") or config.get("num_attention_heads")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return float(2 * config["num_hidden_layers"] * heads * head_dim * 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["builtin:small", "builtin:smollm2"])
    parser.add_argument("--system-tokens", type=int, default=600)
    parser.add_argument("--answer-tokens", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--overhead-model", default="builtin:small")
    parser.add_argument("--overhead-rounds", type=int, default=6)
    parser.add_argument("--overhead-turns", type=int, default=3)
    parser.add_argument("--overhead-tokens", type=int, default=48)
    parser.add_argument("--overhead-system-tokens", type=int, default=300)
    parser.add_argument("--skip", nargs="*", default=[], choices=["warm", "overhead"])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    load_before = load_average()
    results: dict[str, Any] = {"warm": [], "overhead": None}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-disk-")))
        if "warm" not in args.skip:
            for model in args.models:
                note(f"1. warm after death: {model}")
                result = warm_family(stack, tmp, model, args)
                results["warm"].append(result)
                print(warm_table(result), flush=True)
        if "overhead" not in args.skip:
            note(f"2. overhead: {args.overhead_model}")
            results["overhead"] = overhead_family(stack, tmp, args.overhead_model, args)
            print(overhead_table(results["overhead"], kv_bytes_per_token(args.overhead_model)))
    write_json({
        "machine": machine_info(mlx_device()),
        "load_average": {"start": load_before, "end": load_average()},
        "settings": vars(args) | {"out": str(args.out)},
        **results,
    }, args.out)  # fmt: skip


if __name__ == "__main__":
    main()

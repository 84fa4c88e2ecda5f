"""Figure 5 of ``bench_daemon.py``: per-token, as a user sees it: the rate of
``mlx-supervisor generate --json`` streaming from the daemon, read from its stdout, /
``stream_generate`` in a fresh python process, on builtin:tiny; each round a fresh runner
and worker, with several timed pairs back to back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from common import (
    Daemon,
    alternate,
    daemon_generate,
    inproc_generate,
    ms,
    note,
    run_alternating,
    verdict,
    worker,
)
from daemon_common import DECODE_PROMPT, IPC_MODEL, Row, short, stream_tps
from supervisor.figures import median

PER_TOKEN_MODEL = IPC_MODEL  # ~1-3 ms a token on CPU: what the daemon adds per token shows
PER_TOKEN_PAIRS = 5  # timed pairs per round, back to back

# Target (see the brief in bench/README.md).
PER_TOKEN_RATIO_TARGET = 0.97


def cli_argv() -> list[str]:
    """The command a user runs: the ``mlx-supervisor`` script installed beside this
    python, else ``python -m supervisor`` (the same entry point)."""
    script = Path(sys.executable).with_name("mlx-supervisor")
    return [str(script)] if script.exists() else [sys.executable, "-m", "supervisor"]


def cli_generate(
    socket_path: Path, name: str, prompt: str, max_tokens: int, log_path: Path
) -> dict[str, Any]:
    """``mlx-supervisor generate NAME PROMPT --max-tokens N --json`` against the daemon on
    ``socket_path``, its stdout read here as it streams.

    The CLI writes (and flushes) each piece of text as it arrives, then, after ``done``,
    a newline and a JSON summary line (flushed as it exits). The time of every read is
    taken here, so the figure sees what a terminal would: the first byte, the last byte
    of the text (the last token) and the last byte of all (the summary).

    Raises:
        RuntimeError: the CLI failed or printed no text.
    """
    argv = [*cli_argv(), "generate", name, prompt, "--max-tokens", str(max_tokens), "--json",
            "--socket", str(socket_path)]  # fmt: skip
    reads: list[tuple[float, int]] = []  # (when, bytes read so far)
    chunks: list[bytes] = []
    with log_path.open("ab") as log:
        started = time.perf_counter()
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log
        )
        assert process.stdout is not None
        size = 0
        with process.stdout as stdout:
            while chunk := os.read(stdout.fileno(), 1 << 16):
                now = time.perf_counter()
                size += len(chunk)
                reads.append((now, size))
                chunks.append(chunk)
        end_of_output = time.perf_counter()
        code = process.wait()
        reaped = time.perf_counter()
    output = b"".join(chunks)
    body, _, summary_line = output.rstrip(b"\n").rpartition(b"\n")
    if code != 0 or not body:
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-2000:]
        printed = output[-200:]
        raise RuntimeError(f"{' '.join(argv)} exited with {code}, printed {printed!r}:\n{tail}")
    summary = json.loads(summary_line)
    first = reads[0][0]
    last_text = next(when for when, size in reads if size >= len(body))
    last = reads[-1][0]
    tokens = int(summary["generation_tokens"])
    return {
        "generation_tokens": tokens,
        "finish_reason": summary["finish_reason"],
        "text": body.decode("utf-8", errors="replace"),
        "reads": len(reads),
        "tps": (tokens - 1) / (last - first),
        "text_tps": (tokens - 1) / (last_text - first),
        "first_byte_s": first - started,  # python starts, imports, connects; prefill
        "summary_after_text_s": last - last_text,
        "exit_after_output_s": reaped - end_of_output,
        "summary": summary,
    }


def bench_per_token(
    d: Daemon,
    path: Path,
    rounds: int,
    max_tokens: int,
    warmup_tokens: int,
    tmp: Path,
    pairs: int = PER_TOKEN_PAIRS,
    model: str = PER_TOKEN_MODEL,
) -> dict[str, Any]:
    """Per round, on builtin:tiny: a fresh runner through the daemon and a fresh
    ``inproc_worker.py`` (a process keeps its own decode speed for its lifetime), both
    loaded and warmed up (a ``warmup_tokens`` generation each, untimed); then ``pairs``
    timed pairs, alternating which side goes first: the CLI's ``generate --json``
    streaming from the daemon, and ``stream_generate`` in the worker. Only one side
    computes at a time.

    This VM's speed changes in phases of seconds (the same decode runs at 450 or 700
    tok/s), so one long sample per side and round can land in different phases; a
    round's ratio is the median of its pairs' ratios, each pair measured back to back.
    """
    name, client = short(model), d.client

    def run_daemon(index: int, pair: int) -> dict[str, Any]:
        log_path = tmp / f"per-token-cli-{index}-{pair}.log"
        return cli_generate(d.process.socket_path, name, DECODE_PROMPT, max_tokens, log_path)

    samples: list[dict[str, Any]] = []
    for index in range(rounds):
        client.load(model, name)
        try:
            with worker(tmp / f"per-token-worker-{index}.log") as w:
                w.request("load", key=name, path=str(path))
                inproc_generate(w, name, DECODE_PROMPT, warmup_tokens)
                daemon_generate(client, name, DECODE_PROMPT, warmup_tokens)
                d.settle()
                measured = [
                    run_alternating(
                        index + pair,
                        partial(inproc_generate, w, name, DECODE_PROMPT, max_tokens),
                        partial(run_daemon, index, pair),
                    )
                    for pair in range(pairs)
                ]
        finally:
            client.unload(name)
        pair_ratios = [cli["tps"] / stream_tps(inproc) for inproc, cli in measured]
        pair_text_ratios = [cli["text_tps"] / stream_tps(inproc) for inproc, cli in measured]
        inproc, cli = measured[-1]
        sample = {
            "round": index,
            "pairs": pairs,
            "first": alternate(index, "in-process", "daemon")[0],
            "inproc_tps": median(stream_tps(i) for i, _ in measured),
            "daemon_tps": median(c["tps"] for _, c in measured),
            "daemon_text_tps": median(c["text_tps"] for _, c in measured),
            "inproc_tokens": inproc["generation_tokens"],
            "daemon_tokens": cli["generation_tokens"],
            "inproc_finish": inproc["finish_reason"],
            "daemon_finish": cli["finish_reason"],
            "same_text": all(i["text"] == c["text"] for i, c in measured),
            "tokens_equal": all(
                i["generation_tokens"] == c["generation_tokens"] for i, c in measured
            ),
            "pair_ratios": pair_ratios,
            "ratio": median(pair_ratios),
            "text_ratio": median(pair_text_ratios),
            **{k: median(c[k] for _, c in measured)
               for k in ("reads", "first_byte_s", "summary_after_text_s", "exit_after_output_s")},
        }  # fmt: skip
        samples.append(sample)
        note(
            f"  per-token round {index + 1}/{rounds}: in-process {sample['inproc_tps']:.1f} "
            f"tok/s, CLI {sample['daemon_tps']:.1f} tok/s, ratio {sample['ratio']:.3f} "
            f"(pairs {'/'.join(f'{r:.2f}' for r in pair_ratios)})"
        )

    def med(key: str) -> float:
        return median(s[key] for s in samples)

    return {
        "model": model,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "prompt": DECODE_PROMPT,
        "cli": [*cli_argv(), "generate", name, "PROMPT", "--max-tokens", str(max_tokens),
                "--json", "--socket", "SOCKET"],
        "median_ratio": med("ratio"),
        "median_text_ratio": med("text_ratio"),
        "ratios": [s["ratio"] for s in samples],
        "median_daemon_tps": med("daemon_tps"),
        "median_daemon_text_tps": med("daemon_text_tps"),
        "median_inproc_tps": med("inproc_tps"),
        "median_summary_after_text_s": med("summary_after_text_s"),
        "pairs_per_round": pairs,
        "tokens_equal": all(s["tokens_equal"] for s in samples),
        "ran_to_max_tokens": all(s["inproc_tokens"] == max_tokens for s in samples),
        "same_text": all(s["same_text"] for s in samples),
        "samples": samples,
    }  # fmt: skip


# --- the table ---------------------------------------------------------------


def per_token_rows(p: dict[str, Any]) -> list[Row]:
    m, target = short(p["model"]), PER_TOKEN_RATIO_TARGET
    pairs = p.get("pairs_per_round", 1)
    what = f"{m}, {p['max_tokens']} tok, median of {p['rounds']} rounds x {pairs} pairs"
    rounds = "/".join(f"{r:.3f}" for r in p["ratios"])
    checks = f"{'yes' if p['tokens_equal'] else 'NO'} / {'yes' if p['same_text'] else 'NO'}"
    return [
        (
            f"5 per-token tok/s, CLI --json ({what})",
            f"{p['median_daemon_tps']:.2f}",
            f"{p['median_inproc_tps']:.2f}",
            f"ratio {p['median_ratio']:.3f} (rounds {rounds})",
            f">= {target}",
            verdict(p["median_ratio"] >= target),
        ),
        (
            f"5 ... to the CLI's last token, not its summary ({m})",
            f"{p['median_daemon_text_tps']:.2f}",
            "",
            f"ratio {p['median_text_ratio']:.3f}; summary "
            f"{ms(p['median_summary_after_text_s'])} after it",
            "",
            "",
        ),
        (
            f"5 check: same token count / same text ({m})",
            "",
            "",
            checks,
            "yes / yes",
            verdict(p["tokens_equal"]),
        ),
    ]

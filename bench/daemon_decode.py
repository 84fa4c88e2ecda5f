"""Figure 1 of ``bench_daemon.py``: decode tokens/s through the daemon / in-process
``mlx_lm.stream_generate``, with each process's CPU time per token.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from common import (
    Daemon,
    Worker,
    alternate,
    cpu_s,
    cpu_time,
    daemon_generate,
    inproc_generate,
    note,
    run_alternating,
    runner_info,
    verdict,
    worker,
)
from daemon_common import DECODE_PROMPT, Row, Side, short, stream_tps
from supervisor.client import Client
from supervisor.figures import median, percentile

# Target (see the brief in bench/README.md).
DECODE_RATIO_TARGET = 0.97


def with_cpu(run: Side, pids: dict[str, int]) -> dict[str, Any]:
    """``run()``, plus the CPU seconds each of ``pids`` (and this process) spent in it."""
    before = {who: cpu_s(pid) for who, pid in pids.items()}
    own = time.process_time()
    result = run()
    own = time.process_time() - own
    result["cpu_s"] = {who: cpu_s(pid) - before[who] for who, pid in pids.items()}
    result["cpu_s"]["client"] = own  # includes DaemonProcess's log-reader thread
    return result


def bench_decode(
    d: Daemon,
    model: str,
    path: Path,
    max_tokens: int,
    epochs: int,
    rounds: int,
    warmup_tokens: int,
    tmp: Path,
) -> dict[str, Any]:
    """``epochs`` times: a fresh worker and a fresh runner, then ``rounds`` pairs.

    A process's decode speed varies by several percent from one process to the next
    (two identical plain workers differ by up to ~8% on the shared 2-core VM) and
    stays put for its lifetime, so rounds within one pair of processes cannot
    average it out: fresh processes per epoch do.
    """
    name, client = short(model), d.client
    samples: list[dict[str, Any]] = []
    for epoch in range(epochs):
        with worker(tmp / f"decode-{name}-{epoch}.log") as w:
            w.request("load", key=name, path=str(path))
            client.load(model, name)
            try:
                d.settle()
                inproc_generate(w, name, DECODE_PROMPT, warmup_tokens)
                daemon_generate(client, name, DECODE_PROMPT, warmup_tokens)
                runner_pid = runner_info(client, name).pid
                assert runner_pid is not None
                pids = {"daemon": d.process.pid, "runner": runner_pid}
                for _ in range(rounds):
                    samples.append(
                        decode_round(len(samples), epoch, client, w, name, max_tokens, pids)
                    )
            finally:
                client.unload(name)
    tokens_equal = all(
        s["inproc_tokens"] == s["daemon_tokens"] == s["daemon_frames"] for s in samples
    )

    def med(key: str, items: list[dict[str, Any]] = samples) -> float:
        return median(s[key] for s in items)

    return {
        "model": model,
        "max_tokens": max_tokens,
        "epochs": epochs,
        "rounds": rounds * epochs,
        "prompt": DECODE_PROMPT,
        "median_ratio": med("ratio"),
        "ratio_p25_p75": [
            percentile([s["ratio"] for s in samples], 25),
            percentile([s["ratio"] for s in samples], 75),
        ],
        "epoch_median_ratios": [
            med("ratio", [s for s in samples if s["epoch"] == e]) for e in range(epochs)
        ],
        "median_reported_ratio": med("reported_ratio"),
        "median_inproc_tps": med("inproc_tps"),
        "median_daemon_tps": med("daemon_tps"),
        "median_inproc_reported_tps": med("inproc_reported_tps"),
        "median_daemon_reported_tps": med("daemon_reported_tps"),
        "median_cpu_per_token_s": {
            who: median(s["cpu_per_token_s"][who] for s in samples)
            for who in ("worker", "runner", "daemon", "client")
        },
        "tokens_equal": tokens_equal,
        "ran_to_max_tokens": all(s["inproc_tokens"] == max_tokens for s in samples),
        "same_text": all(s["same_text"] for s in samples),
        "samples": samples,
    }


def decode_round(
    index: int,
    epoch: int,
    client: Client,
    w: Worker,
    name: str,
    max_tokens: int,
    pids: dict[str, int],
) -> dict[str, Any]:
    inproc, daemon = run_alternating(
        index,
        lambda: with_cpu(
            lambda: inproc_generate(w, name, DECODE_PROMPT, max_tokens), {"worker": w.pid}
        ),
        lambda: with_cpu(lambda: daemon_generate(client, name, DECODE_PROMPT, max_tokens), pids),
    )
    tokens = inproc["generation_tokens"]
    sample = {
        "round": index,
        "epoch": epoch,
        "first": alternate(index, "in-process", "daemon")[0],
        "inproc_tps": stream_tps(inproc),
        "daemon_tps": stream_tps(daemon),
        "inproc_reported_tps": inproc["reported_tps"],
        "daemon_reported_tps": daemon["reported_tps"],
        "inproc_tokens": inproc["generation_tokens"],
        "daemon_tokens": daemon["generation_tokens"],
        "daemon_frames": daemon["frames"],
        "inproc_finish": inproc["finish_reason"],
        "daemon_finish": daemon["finish_reason"],
        "same_text": inproc["text"] == daemon["text"],
        "inproc_sync_s": inproc["sync_s"],
        # CPU seconds per generated token, by process
        "cpu_per_token_s": {
            "worker": inproc["cpu_s"]["worker"] / tokens,
            "runner": daemon["cpu_s"]["runner"] / tokens,
            "daemon": daemon["cpu_s"]["daemon"] / tokens,
            "client": daemon["cpu_s"]["client"] / tokens,
        },
    }
    sample["ratio"] = sample["daemon_tps"] / sample["inproc_tps"]
    sample["reported_ratio"] = sample["daemon_reported_tps"] / sample["inproc_reported_tps"]
    note(
        f"  decode {name} epoch {epoch + 1} round {index + 1}: in-process "
        f"{sample['inproc_tps']:.2f} tok/s, daemon {sample['daemon_tps']:.2f} tok/s, "
        f"ratio {sample['ratio']:.3f}"
    )
    return sample


# --- the table ---------------------------------------------------------------


def decode_rows(d: dict[str, Any]) -> list[Row]:
    m, target = short(d["model"]), DECODE_RATIO_TARGET
    what = f"{m}, {d['max_tokens']} tok, median of {d['rounds']}"
    epochs = "/".join(f"{r:.3f}" for r in d["epoch_median_ratios"])
    checks = f"{'yes' if d['tokens_equal'] else 'NO'} / {'yes' if d['same_text'] else 'NO'}"
    cpu = d["median_cpu_per_token_s"]
    return [
        (
            f"1 decode tok/s, client-seen ({what})",
            f"{d['median_daemon_tps']:.2f}",
            f"{d['median_inproc_tps']:.2f}",
            f"ratio {d['median_ratio']:.3f} (epochs {epochs})",
            f">= {target}",
            verdict(d["median_ratio"] >= target),
        ),
        (
            f"1 decode tok/s, mlx-lm generation_tps ({m})",
            f"{d['median_daemon_reported_tps']:.2f}",
            f"{d['median_inproc_reported_tps']:.2f}",
            f"ratio {d['median_reported_ratio']:.3f}",
            f">= {target}",
            verdict(d["median_reported_ratio"] >= target),
        ),
        (
            f"1 CPU per token: runner / worker; daemon + client ({m})",
            f"{cpu_time(cpu['runner'])} + {cpu_time(cpu['daemon'] + cpu['client'])}",
            cpu_time(cpu["worker"]),
            f"daemon {cpu_time(cpu['daemon'])}, client {cpu_time(cpu['client'])}",
            "",
            "",
        ),
        (
            f"1 check: same token count / same text ({m})",
            "",
            "",
            checks,
            "yes / yes",
            verdict(d["tokens_equal"]),
        ),
    ]

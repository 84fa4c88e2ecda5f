"""The daemon's OpenAI-compatible HTTP front next to ``mlx_lm.server``, and next to our socket.

Usage::

    python bench/bench_http.py [--quick] [--out bench/results/http.json]

One run starts a private daemon with its HTTP front on a free loopback port
(``MLX_SUPERVISOR_HTTP=127.0.0.1:0``; the base URL from ``status().supervisor.http``)
and, per model, ``python -m mlx_lm.server`` on the same model directory (its defaults),
and measures, on builtin:tiny (random weights) and builtin:smollm2 (a real 135M model):

1. **Through HTTP, ours vs mlx_lm.server**: ``POST /v1/chat/completions`` with
   ``stream: true`` (and ``stream_options.include_usage``), greedy (``temperature 0``),
   the same messages and ``max_tokens`` on both sides, one request at a time, the side
   that goes first alternating by round; every request on a new TCP connection (the
   reference server speaks HTTP/1.0 and closes each one), read with httpx.

   a. **Decode tokens/s of one stream**, client-side: (completion tokens - 1) / (last
      content chunk - first content chunk). Per round the ratio ours / theirs; the
      figure is the median of the per-round ratios (target >= 1.0). Beside it, the same
      request through our socket (``Client.generate``), to tell the HTTP layer from the
      runner, and from the first content chunk to the end: CPU seconds per token (ours:
      runner + daemon; theirs: mlx_lm.server) and how busy the process that computes
      was (its CPU seconds / wall time). The three take turns in all six orders.
   b. **Time to first token**, client-side from the request sent (connect included) to
      the first chunk with non-empty ``delta.content``, over N requests per side with a
      fresh prompt each: a counter at the very start of the system message, so neither
      side can reuse a cached prefix beyond the chat template's opening and the word
      before the counter (the cached tokens each side reported are shown). p50 and p99
      of each side and ours / theirs (target <= 1.0 for both).

   Both: the completion tokens of each side (they must match: greedy) and whether the
   texts are equal.
2. **Through our HTTP vs our socket**, builtin:tiny, on the same daemon and runner: the
   end-to-end time of short requests (``max_tokens`` 4; from the request sent to the
   response read to its end, client-side), p50 over ~50 requests per path, as a
   difference and a ratio against ``Client.generate`` (connect and hello included, as
   every socket request pays them). Paths: HTTP streamed on a new connection, HTTP
   streamed on a kept-alive connection, HTTP whole (``stream: false``) kept alive. The
   paths take turns in an order that rotates every request, each with a prompt of its
   own (no path reuses another's cached prefix).

The machine is shared and noisy: every figure is a ratio or a difference of things
measured in this run, the sides taking turns. The tables go to stdout at the end (also
those measured before a failure), progress to stderr; the JSON (rewritten after each
family, ``complete`` true at the end) has the machine, the settings and every raw
sample. The exit status is 1 when two sides' token counts differ anywhere (not for the
targets). See bench/README.md.

Each family is a module of its own (``http_decode.py``, ``http_ttft.py``,
``http_overhead.py``; what they share: ``http_common.py``); this script holds the
settings, runs them and prints the tables.
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
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS_DIR,
    Daemon,
    children_left,
    load_average,
    machine_info,
    mlx_device,
    mlx_lm_server,
    note,
    runner_info,
    write_json,
)
from http_common import (
    DECODE_USER,
    OVERHEAD_PATHS,
    REQUEST_TIMEOUT_S,
    SHORT_NAMES,
    SMOLLM2,
    TINY,
    TTFT_USER,
    Sides,
    messages_for,
    warm_up,
)
from http_decode import decode_family, decode_table
from http_overhead import overhead_family, overhead_table
from http_ttft import ttft_family, ttft_table
from runner.builtin import ensure_builtin_model
from supervisor.client import Client

DEFAULT_OUT = RESULTS_DIR / "http.json"


# --- the run --------------------------------------------------------------------------


def runner_pid(client: Client, name: str) -> int:
    pid = runner_info(client, name).pid
    if pid is None:
        raise RuntimeError(f"{name} has no runner process")
    return pid


def server_pid(port: int) -> int:
    """The pid of our child ``mlx_lm.server`` listening on ``port``."""
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            argv = child.cmdline()
            if "mlx_lm.server" in argv and str(port) in argv:
                return child.pid
    raise RuntimeError(f"no mlx_lm.server child on port {port}")


@dataclass(frozen=True)
class ModelSettings:
    decode_rounds: int
    decode_tokens: int
    ttft_requests: int
    ttft_tokens: int


def settings_for(quick: bool) -> dict[str, ModelSettings]:
    """builtin:tiny decodes hundreds of tokens/s here; builtin:smollm2 4-6 (2 shared CPU
    cores), and takes ~4 s to its first token: its counts stay small. Decode rounds in
    multiples of 6 go through every order of the three sides."""
    if quick:
        return {TINY: ModelSettings(6, 256, 30, 2), SMOLLM2: ModelSettings(2, 16, 6, 2)}
    return {TINY: ModelSettings(12, 256, 100, 2), SMOLLM2: ModelSettings(6, 32, 20, 2)}


def run(
    args: argparse.Namespace,
    per_model: dict[str, ModelSettings],
    overhead_requests: int,
    config: str,
    results: dict[str, Any],
    save: Callable[[], None],
) -> None:
    """Start our daemon, then per model mlx_lm.server beside it, and measure (see the
    module's docstring); every process is stopped and reaped before this returns."""
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)
    with (
        tempfile.TemporaryDirectory(prefix="mlx-bench-http-") as tmp_name,
        contextlib.ExitStack() as stack,
    ):
        tmp = Path(tmp_name)
        daemon = Daemon.start(
            stack, tmp, "http", config, client_timeout_s=REQUEST_TIMEOUT_S, http="127.0.0.1:0"
        )
        ours_url = daemon.client.status().supervisor.http
        if ours_url is None:
            raise RuntimeError("the daemon's HTTP front is off (its port was taken?)")
        note(f"our daemon: HTTP {ours_url}, socket {daemon.process.socket_path}")
        results["machine"]["daemon_http_url"] = ours_url
        fresh = stack.enter_context(
            httpx.Client(timeout=timeout, limits=httpx.Limits(max_keepalive_connections=0))
        )
        pooled = stack.enter_context(httpx.Client(timeout=timeout))
        for model, s in per_model.items():
            name = SHORT_NAMES[model]
            model_dir = ensure_builtin_model(model)
            note(f"loading {model} ({model_dir}) in our daemon and in mlx_lm.server")
            daemon.client.load(model, name)
            daemon.settle()
            with mlx_lm_server(model_dir, tmp / f"mlx_lm_server_{name}.log") as port:
                pids = {
                    "runner": runner_pid(daemon.client, name),
                    "daemon": daemon.process.pid,
                    "server": server_pid(port),
                }
                sides = Sides(ours_url, f"http://127.0.0.1:{port}", daemon.client, name,
                              fresh, pooled, pids)  # fmt: skip
                warm_up(sides)
                note(f"1a. decode on {model}: {s.decode_rounds} rounds x {s.decode_tokens} tokens")
                results["decode"][model] = decode_family(sides, s.decode_rounds, s.decode_tokens)
                save()
                note(f"1b. TTFT on {model}: {s.ttft_requests} requests per side")
                results["ttft"][model] = ttft_family(sides, s.ttft_requests, s.ttft_tokens)
                save()
            if model == TINY:  # after mlx_lm.server has gone: nothing idle beside it
                note(f"2. HTTP vs socket on {model}: {overhead_requests} requests per path")
                results["overhead"] = overhead_family(
                    sides, overhead_requests, args.overhead_tokens
                )
                save()
            daemon.client.unload(name)
        results["daemon_exit"] = daemon.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and requests (~3 min)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--overhead-requests", type=int, default=None, help="figure 2: requests per path (50; 20 "
        "with --quick)",
    )  # fmt: skip
    parser.add_argument(
        "--overhead-tokens", type=int, default=4, help="figure 2: max_tokens per request (4)"
    )
    args = parser.parse_args()
    per_model = settings_for(args.quick)
    overhead_requests = args.overhead_requests or (20 if args.quick else 50)
    config = "hot_spare = false\n"
    settings = {
        "quick": args.quick,
        "models": {m: asdict(s) for m, s in per_model.items()},
        "overhead": {
            "requests_per_path": overhead_requests,
            "max_tokens": args.overhead_tokens,
            "paths": list(OVERHEAD_PATHS),
            "model": TINY,
        },
        "daemon_config": config.strip() + " (no idle spare process beside the measurements)",
        "daemon_http": "MLX_SUPERVISOR_HTTP=127.0.0.1:0",
        "theirs": "python -m mlx_lm.server --model DIR --host 127.0.0.1 --port P (defaults)",
        "http_client": f"httpx {httpx.__version__}",
        "prompts": {
            "decode": messages_for("Story", 0, DECODE_USER),
            "ttft": messages_for("Request", 0, TTFT_USER),
            "overhead": messages_for("Short", 0, TTFT_USER),
        },
    }
    results: dict[str, Any] = {
        "machine": machine_info(mlx_device()),
        "settings": settings,
        "complete": False,
        "decode": {},
        "ttft": {},
    }
    started = time.perf_counter()

    def save() -> None:
        """Save what we have so far: a run that fails late keeps the families before it
        (``complete`` says whether it ended)."""
        results["wall_s"] = time.perf_counter() - started
        write_json(results, args.out)

    try:
        run(args, per_model, overhead_requests, config, results, save)
    finally:  # the tables of whatever was measured, even if the run failed later
        print(tables(results), flush=True)
    results["children_left"] = children_left()
    results["machine"]["loadavg_end"] = load_average()
    results["checks"] = checks = token_checks(results)
    results["complete"] = True
    save()
    bad = [c for c in checks if not c["ok"]]
    for c in bad:
        note(f"CHECK FAILED: {c['what']}: {c['detail']}")
    if results["children_left"]:
        note(f"WARNING: child processes left: {results['children_left']}")
    note(f"done in {results['wall_s']:.0f} s; wrote {args.out}")
    return 1 if bad else 0


def tables(results: dict[str, Any]) -> str:
    """The tables of the families measured so far, in order."""
    parts = []
    if results["decode"]:
        parts.append(decode_table(results["decode"]))
    if results["ttft"]:
        parts.append(ttft_table(results["ttft"]))
    if "overhead" in results:
        parts.append(overhead_table(results["overhead"]))
    return "\n\n".join(parts) + "\n" if parts else ""


def token_checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every pair of sides must have generated the same number of tokens (greedy, same
    model files, same max_tokens)."""
    checks = []
    for family in ("decode", "ttft"):
        for model, r in results[family].items():
            checks.append({
                "what": f"{family} {SHORT_NAMES[model]}: same completion tokens",
                "ok": r["same_tokens"] == r["pairs"],
                "detail": f"{r['same_tokens']}/{r['pairs']} pairs",
            })  # fmt: skip
            if family == "decode":
                checks.append({
                    "what": f"decode {SHORT_NAMES[model]}: same completion tokens, HTTP and socket",
                    "ok": r["same_tokens_socket"] == r["pairs"],
                    "detail": f"{r['same_tokens_socket']}/{r['pairs']} rounds",
                })  # fmt: skip
    o = results.get("overhead")
    if o is not None:
        checks.append({
            "what": "overhead: same completion tokens on every path",
            "ok": o["same_tokens"] == o["requests_per_path"],
            "detail": f"{o['same_tokens']}/{o['requests_per_path']} rounds",
        })  # fmt: skip
    return checks


if __name__ == "__main__":
    sys.exit(main())

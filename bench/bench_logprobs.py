"""Decode speed with logprobs on ÷ off, through the daemon, alone and in a batch.

Usage::

    python bench/bench_logprobs.py [--models builtin:tiny,builtin:small] [--tokens 256]
                                   [--rounds 5] [--batch 3] [--top 5]
                                   [--out bench/results/logprobs.json]

Side by side in one run, on one runner per model (so process-to-process speed
differences do not enter the ratio), alternating which side goes first each
round: the same chat prompt generated greedily for ``--tokens`` tokens with
``logprobs`` off, and with ``logprobs`` on and ``--top`` alternatives per token.
"Alone" is one request at a time; "batch" is ``--batch`` requests at once, each
with the same setting. The figure is the runner's decode rate
(``GenerationDone.generation_tps``, tokens after the first ÷ their time), the
median over rounds, on ÷ off (target ≥ 0.95).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS_DIR,
    Daemon,
    machine_info,
    mlx_device,
    note,
    run_alternating,
    verdict,
    write_json,
)
from ipc.messages import ChatMessage, GenerationDone, SamplingParams
from supervisor.client import Client
from supervisor.figures import median, render_table

DEFAULT_OUT = RESULTS_DIR / "logprobs.json"
TARGET_RATIO = 0.95
PROMPT = [ChatMessage("user", "Write a long story about a lighthouse keeper and a storm.")]


def decode_tps(client: Client, name: str, sampling: SamplingParams, together: int) -> float:
    """``together`` requests at once with ``sampling``: the median of their decode rates."""
    dones: list[GenerationDone] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            with client.generate(name, messages=PROMPT, sampling=sampling, cache=False) as gen:
                for _ in gen:
                    pass
                assert gen.done is not None
                dones.append(gen.done)
        except BaseException as exc:  # reported below, not lost in a thread
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(together)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return median(d.generation_tps for d in dones)


def bench_model(d: Daemon, model: str, args: argparse.Namespace) -> dict[str, Any]:
    name = model.removeprefix("builtin:")
    d.client.load(model, name, max_concurrent=max(args.batch, 1), prefix_cache=False)
    off = SamplingParams(max_tokens=args.tokens)
    on = SamplingParams(max_tokens=args.tokens, logprobs=True, top_logprobs=args.top)
    decode_tps(d.client, name, off, 1)  # warm-up: the first request pays for compiling
    result: dict[str, Any] = {}
    for label, together in (("alone", 1), ("batch", args.batch)):
        rounds = []
        for index in range(args.rounds):
            with_on, with_off = run_alternating(
                index,
                lambda t=together: decode_tps(d.client, name, on, t),
                lambda t=together: decode_tps(d.client, name, off, t),
            )
            rounds.append({"on_tps": with_on, "off_tps": with_off, "ratio": with_on / with_off})
            note(f"{model} {label} round {index + 1}: on {with_on:.0f} tok/s, "
                 f"off {with_off:.0f} tok/s")  # fmt: skip
        result[label] = {"together": together, "rounds": rounds,
                         "median_ratio": median(r["ratio"] for r in rounds)}  # fmt: skip
    d.client.unload(name)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="builtin:tiny,builtin:small")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    models = [m for m in args.models.split(",") if m]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-logprobs-") as tmp_name, \
            contextlib.ExitStack() as stack:  # fmt: skip
        daemon = Daemon.start(stack, Path(tmp_name), "logprobs",
                              "hot_spare = false\nnext_turn_prefill = false\n",
                              client_timeout_s=3600)  # fmt: skip
        for model in models:
            results[model] = bench_model(daemon, model, args)
        daemon.shutdown()

    rows = []
    met = True
    for model, result in results.items():
        for label in ("alone", "batch"):
            r = result[label]
            ok = r["median_ratio"] >= TARGET_RATIO
            met = met and ok
            rows.append([model, f"{label} ({r['together']})",
                         f"{median(x['on_tps'] for x in r['rounds']):.0f}",
                         f"{median(x['off_tps'] for x in r['rounds']):.0f}",
                         f"{r['median_ratio']:.3f}", verdict(ok)])  # fmt: skip
    print(f"\nDecode tok/s, logprobs on (top {args.top}) ÷ off, {args.tokens} tokens, "
          f"median of {args.rounds} rounds")  # fmt: skip
    print(render_table(["model", "requests", "on tok/s", "off tok/s", "on ÷ off", "≥ 0.95"],
                       rows))  # fmt: skip
    write_json({
        "figure": "decode tok/s with logprobs on ÷ off",
        "tokens": args.tokens, "top_logprobs": args.top, "results": results,
        "target_ratio": TARGET_RATIO, "machine": machine_info(mlx_device()),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }, args.out)  # fmt: skip
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())

"""A long prefill on a slow model: first token through the daemon ÷ in-process mlx-lm.

Usage::

    python bench/bench_prefill.py [--model builtin:small] [--system-tokens 1900]
                                  [--rounds 1] [--stall-s 30] [--out bench/results/prefill.json]

The case of issue 22: a chat whose system prompt is ~1,900 tokens on
builtin:small (12 layers, which prefills ~15-20 tokens/s on this machine's
CPU). mlx-lm prefills it in one step of up to 2,048 tokens, minutes long;
the daemon prefills it in steps of ``prefill_chunk_s`` sized from the rate it
measures, reporting after each. Side by side in one run, alternating which
goes first each round:

- in-process: ``mlx_lm.stream_generate`` in a plain python process
  (``bench/inproc_worker.py``) with the model loaded: the time to its first
  response;
- ours: the same prompt text through a daemon whose ``prefill_stall_s`` is
  ``--stall-s`` (30 s, a quarter of the default), the prefix cache off (each
  round computes the whole prompt): the time from the request to the first
  text, as the client sees it.

Figures: ours ÷ in-process per round (target ≤ 1.1) and whether the runner
was killed as stalled (it must not be: the same pid answers every round).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS_DIR,
    Daemon,
    daemon_generate,
    inproc_generate,
    log_records,
    machine_info,
    mlx_device,
    note,
    ratio,
    run_alternating,
    runner_info,
    verdict,
    worker,
    write_json,
)
from runner.builtin import ensure_builtin_model
from supervisor.figures import median, render_table

DEFAULT_OUT = RESULTS_DIR / "prefill.json"
TARGET_RATIO = 1.1
MAX_TOKENS = 4
SYSTEM_LINE = "Rule {i}: answer the user briefly, in plain words, and cite the rule you used.\n"


def chat_prompt(model_dir: Path, system_tokens: int) -> tuple[str, int]:
    """A chat (a long system prompt and one question) rendered by the model's
    template as text, and its token count: both sides get this text."""
    from mlx_lm import load

    _, tokenizer = load(str(model_dir))
    lines: list[str] = []
    while True:
        lines.append(SYSTEM_LINE.format(i=len(lines) + 1))
        messages = [{"role": "system", "content": "".join(lines)},
                    {"role": "user", "content": "What is the capital of France?"}]  # fmt: skip
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        tokens = len(tokenizer.encode(text, add_special_tokens=False))
        if tokens >= system_tokens:
            return str(text), tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--system-tokens", type=int, default=1900)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--stall-s", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    model_dir = ensure_builtin_model(args.model)
    prompt, prompt_tokens = chat_prompt(model_dir, args.system_tokens)
    note(f"{args.model}: a {prompt_tokens}-token chat prompt, {args.rounds} round(s) per side")
    config = (f"hot_spare = false\nprefix_cache = false\nnext_turn_prefill = false\n"
              f"prefill_stall_s = {args.stall_s}\n")  # fmt: skip
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-prefill-") as tmp_name, \
            contextlib.ExitStack() as stack:  # fmt: skip
        tmp = Path(tmp_name)
        daemon = Daemon.start(stack, tmp, "prefill", config, client_timeout_s=3600)
        loaded = daemon.client.load(args.model, "model")
        w = stack.enter_context(worker(tmp / "worker.log"))
        w.request("load", key="model", path=str(model_dir))
        for index in range(args.rounds):
            note(f"round {index + 1}: both sides prefill {prompt_tokens} tokens")
            ours, theirs = run_alternating(
                index,
                lambda: daemon_generate(daemon.client, "model", prompt, MAX_TOKENS),
                lambda: inproc_generate(w, "model", prompt, MAX_TOKENS),
            )
            rounds.append({
                "ours_ttft_s": ours["e2e_ttft_s"], "theirs_ttft_s": theirs["ttft_s"],
                "ratio": ours["e2e_ttft_s"] / theirs["ttft_s"],
                "same_text": ours["text"] == theirs["text"],
            })  # fmt: skip
            note(f"  ours {ours['e2e_ttft_s']:.1f} s, in-process {theirs['ttft_s']:.1f} s")
        stalls = log_records(daemon.process, "runner_stalled")
        exits = log_records(daemon.process, "runner_exited")
        same_pid = runner_info(daemon.client, "model").pid == loaded.pid
        daemon.shutdown()

    median_ratio = median(r["ratio"] for r in rounds)
    killed = bool(stalls) or bool(exits) or not same_pid
    header = ["round", "ours (s)", "in-process (s)", "ours ÷ in-process", "same text"]
    rows = [[str(i + 1), f"{r['ours_ttft_s']:.1f}", f"{r['theirs_ttft_s']:.1f}",
             ratio(r["ours_ttft_s"], r["theirs_ttft_s"]), str(r["same_text"])]
            for i, r in enumerate(rounds)]  # fmt: skip
    print(f"\nFirst token of a {prompt_tokens}-token prompt on {args.model}, "
          f"prefill_stall_s = {args.stall_s:g}")  # fmt: skip
    print(render_table(header, rows))
    print(
        f"median ours ÷ in-process: {median_ratio:.3f} (target ≤ {TARGET_RATIO}) "
        f"{verdict(median_ratio <= TARGET_RATIO)}"
    )
    print(f"runner killed as stalled: {'yes' if killed else 'no'} {verdict(not killed)}")
    write_json({
        "figure": "long prefill, first token: ours ÷ in-process stream_generate",
        "model": args.model, "prompt_tokens": prompt_tokens, "prefill_stall_s": args.stall_s,
        "rounds": rounds, "median_ratio": median_ratio, "target_ratio": TARGET_RATIO,
        "killed_as_stalled": killed, "stall_records": stalls,
        "machine": machine_info(mlx_device()),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }, args.out)  # fmt: skip
    return 0 if median_ratio <= TARGET_RATIO and not killed else 1


if __name__ == "__main__":
    sys.exit(main())

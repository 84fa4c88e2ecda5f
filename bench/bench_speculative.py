"""Speculative decoding: decode tok/s with a draft model ÷ without, and the draft's
acceptance rate, ours and mlx_lm.server's (``--draft-model``) side by side in one run.

The pair is builtin:spec-target with builtin:spec-draft (``--pair spec``, the default: a
draft that predicts its target, being the target's own embeddings, first layer, norm and head
where the target's other layers are quiet), or builtin:small with builtin:small-draft
(``--pair small``: a draft that proposes its input token again). Four sides, each served its
own way: our daemon's model ``plain`` (the target) and ``spec`` (the same with
``draft_model``), and two mlx_lm.server processes on the same directories, without and with
``--draft-model``. Both sides compute with the same BLAS: our runners with the daemon's
``cpu_blas`` (``--cpu-blas``, default ``auto``: OpenBLAS where found), mlx_lm.server with the
library our runner maps preloaded (``--theirs-blas same``, the default) or mlx's bundled one.
mlx_lm.server with ``--draft-model`` runs with its prompt cache off (``--prompt-cache-size 0``;
``--theirs-draft-prompt-cache`` keeps it): with it on, mlx_lm-0.32.2's server answers a prompt
whose prefix it has cached with other tokens than plain greedy decoding (probably as it stores
the caches under the prompt and answer tokens, which a speculative run's caches do not hold
exactly), and the texts would not compare. Decode tok/s leaves prefill out, so the cache does
not change it.

Every request is a greedy chat through the OpenAI API, streamed; decode tok/s is the
completion's tokens after the first over the time from the first streamed text to the end
(prefill left out), measured by the client alike on every side. The sides take turns per
prompt, in rotating order. Every side must give the same text (greedy, same weights).

    .venv/bin/python bench/bench_speculative.py [--pair spec|small] [--tokens 48] [--prompts 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench_http import runner_pid, server_pid
from common import (
    RESULTS_DIR,
    Daemon,
    load_average,
    machine_info,
    mapped_blas,
    mlx_device,
    mlx_lm_server,
    note,
    write_json,
)
from runner.builtin import ensure_builtin_model

# --pair: (model, draft, default output)
PAIRS = {
    "spec": ("builtin:spec-target", "builtin:spec-draft", RESULTS_DIR / "speculative.json"),
    "small": ("builtin:small", "builtin:small-draft", RESULTS_DIR / "speculative_small.json"),
}
PROMPTS = [
    "Tell me about the river and the mountains.",
    "hello",
    "Please count from one to ten.",
    "Why is the sky blue?",
    "Write a letter to a friend.",
]


def stream_chat(base: str, model: str, prompt: str, tokens: int) -> dict[str, Any]:
    """One greedy streamed chat; client-side timings, the usage and our ``supervisor``."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    pieces: list[str] = []
    first: float | None = None
    usage: dict[str, Any] | None = None
    ours: dict[str, Any] | None = None
    chunks = 0
    started = time.perf_counter()
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            usage = event.get("usage") or usage
            ours = event.get("supervisor") or ours
            for choice in event.get("choices", []):
                text = (choice.get("delta") or {}).get("content") or ""
                if text:
                    chunks += 1
                    if first is None:
                        first = time.perf_counter()
                    pieces.append(text)
    end = time.perf_counter()
    generated = usage["completion_tokens"] if usage else chunks
    decode_s = end - (first if first is not None else end)
    return {
        "text": "".join(pieces),
        "generation_tokens": generated,
        "ttft_s": (first or end) - started,
        "decode_s": decode_s,
        "decode_tps": (generated - 1) / decode_s if decode_s > 0 else None,
        "supervisor": ours,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=48, help="tokens per answer")
    parser.add_argument("--prompts", type=int, default=3, help=f"prompts (at most {len(PROMPTS)})")
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    parser.add_argument(
        "--pair",
        choices=tuple(PAIRS),
        default="spec",
        help="spec: spec-target + spec-draft; small: small + small-draft",
    )
    parser.add_argument("--cpu-blas", default="auto", help="our daemon's cpu_blas")
    parser.add_argument(
        "--theirs-blas",
        choices=("same", "bundled"),
        default="same",
        help="mlx_lm.server with the BLAS our runner maps preloaded, or mlx's own",
    )
    parser.add_argument(
        "--theirs-draft-prompt-cache",
        action="store_true",
        help="keep mlx_lm.server's prompt cache on with --draft-model",
    )
    parser.add_argument("--out", type=Path, default=None,
                        help="default bench/results/speculative.json (speculative_small.json "
                             "with --pair small)")  # fmt: skip
    args = parser.parse_args()
    target_ref, draft_ref, default_out = PAIRS[args.pair]
    args.out = args.out or default_out
    k = args.num_draft_tokens
    model_dir, draft_dir = ensure_builtin_model(target_ref), ensure_builtin_model(draft_ref)
    config = f"""hot_spare = false
cpu_blas = "{args.cpu_blas}"
[[models]]
name = "plain"
model = "{target_ref}"
[[models]]
name = "spec"
model = "{target_ref}"
draft_model = "{draft_ref}"
num_draft_tokens = {k}
"""
    results: dict[str, Any] = {"machine": machine_info(mlx_device()),
                               "settings": {**vars(args), "out": str(args.out),
                                            "model": target_ref, "draft": draft_ref}}  # fmt: skip
    samples: dict[str, list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        daemon = Daemon.start(stack, tmp, "ours", config, http="127.0.0.1:0")
        daemon.client.load(target_ref, name="plain")
        daemon.client.load(target_ref, name="spec")
        daemon.settle()
        ours = daemon.client.status().supervisor.http
        assert ours is not None
        ours_blas = mapped_blas(runner_pid(daemon.client, "spec"))
        their_env = {}
        if args.theirs_blas == "same" and ours_blas is not None and "openblas" in ours_blas:
            their_env = {"LD_PRELOAD": ours_blas}
        plain_port = stack.enter_context(mlx_lm_server(model_dir, tmp / "plain.log", their_env))
        draft_args: tuple[str, ...] = (
            "--draft-model",
            str(draft_dir),
            "--num-draft-tokens",
            str(k),
        )
        if not args.theirs_draft_prompt_cache:
            draft_args += ("--prompt-cache-size", "0")
        spec_port = stack.enter_context(
            mlx_lm_server(model_dir, tmp / "spec.log", their_env, args=draft_args)
        )
        results["machine"]["blas"] = {
            "ours": ours_blas, "theirs": mapped_blas(server_pid(spec_port))}  # fmt: skip
        note(f"BLAS: {results['machine']['blas']}")
        sides = {
            "ours plain": (ours, "plain"),
            "ours speculative": (ours, "spec"),
            "mlx_lm.server plain": (f"http://127.0.0.1:{plain_port}", str(model_dir)),
            "mlx_lm.server --draft-model": (f"http://127.0.0.1:{spec_port}", str(model_dir)),
        }
        for name, (base, model) in sides.items():  # warm each side (first-request costs)
            stream_chat(base, model, "warm up", 4)
            samples[name] = []
        order = list(sides)
        for index, prompt in enumerate(PROMPTS[: args.prompts]):
            turn = order[index % len(order) :] + order[: index % len(order)]
            for name in turn:
                base, model = sides[name]
                sample = stream_chat(base, model, prompt, args.tokens)
                samples[name].append(sample)
                note(f"{name:28s} {prompt[:30]!r}: {sample['decode_tps']:.2f} tok/s")
        results["draft_status"] = [
            r.draft and {"requests": r.draft.requests, "drafted": r.draft.drafted,
                         "accepted": r.draft.accepted}
            for r in daemon.client.status().runners if r.name == "spec"
        ]  # fmt: skip
    results["samples"] = samples
    texts = {name: [s["text"] for s in runs] for name, runs in samples.items()}
    same = all(t == texts["ours plain"] for t in texts.values())
    tps = {name: statistics.median(s["decode_tps"] for s in runs) for name, runs in samples.items()}
    drafted = sum(s["supervisor"].get("draft_tokens", 0) for s in samples["ours speculative"])
    accepted = sum(s["supervisor"].get("draft_accepted", 0) for s in samples["ours speculative"])
    ours_ratio = tps["ours speculative"] / tps["ours plain"]
    theirs_ratio = tps["mlx_lm.server --draft-model"] / tps["mlx_lm.server plain"]
    results["figures"] = {"decode_tps_median": tps, "ours_speculative_over_plain": ours_ratio,
                          "theirs_speculative_over_plain": theirs_ratio,
                          "ours_drafted": drafted, "ours_accepted": accepted,
                          "acceptance_rate": accepted / drafted if drafted else None,
                          "same_text_on_every_side": same}  # fmt: skip
    results["machine"]["loadavg_end"] = load_average()
    write_json(results, args.out)
    print(f"\nspeculative decoding: {target_ref} + {draft_ref}, num_draft_tokens {k}, "
          f"{args.prompts} greedy chats x {args.tokens} tokens, device {mlx_device()}")  # fmt: skip
    blas = results["machine"]["blas"]
    print(f"BLAS: ours {blas['ours']}, mlx_lm.server {blas['theirs']}; "
          f"load average at start {results['machine']['loadavg_start']}, at end "
          f"{results['machine']['loadavg_end']}")  # fmt: skip
    print(f"{'side':30s} {'decode tok/s (median)':>22s}")
    for name, value in tps.items():
        print(f"{name:30s} {value:22.2f}")
    print(f"ours: speculative / plain = {ours_ratio:.2f}x; mlx_lm.server: "
          f"--draft-model / plain = {theirs_ratio:.2f}x")  # fmt: skip
    rate = f"{accepted / drafted:.1%}" if drafted else "n/a"
    print(f"acceptance (ours): {accepted} of {drafted} draft tokens = {rate}")
    print(f"same greedy text on all four sides: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())

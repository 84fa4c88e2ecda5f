"""mlx on a Linux CPU with the BLAS its wheel bundles, and with OpenBLAS preloaded
(what a runner gets under ``cpu_blas = "auto"``), side by side in one run.

Each round starts two fresh python processes, one per BLAS (the order alternating),
each loading the model and measuring in process: a float32 matmul the size of a
small model's MLP, a prompt's prefill (tokens/s), greedy decoding (tokens/s) and
the greedy answer to one chat question. Ratios are OpenBLAS ÷ bundled.

    python bench/bench_blas.py [--model builtin:smollm2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, alternate, machine_info, mlx_device, note, write_json
from runner.builtin import ensure_builtin_model
from supervisor.figures import median, render_table
from supervisor.runners.blas import AUTO, preload_for

DEFAULT_OUT = RESULTS_DIR / "blas.json"
QUESTION = "What is the capital of France?"

PROBE = r"""
import json, sys, time
import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
model_dir, prefill_tokens, decode_tokens, question = sys.argv[1:5]
a = mx.random.normal((64, 576)); w = mx.random.normal((1536, 576)); mx.eval(a, w)
mx.eval(a @ w.T)
t = time.perf_counter()
for _ in range(20):
    mx.eval(a @ w.T)
matmul_s = (time.perf_counter() - t) / 20
model, tokenizer = load(model_dir)
ids = [(7 * i) % 1000 + 100 for i in range(int(prefill_tokens))]
cache = make_prompt_cache(model)
t = time.perf_counter()
model(mx.array([ids]), cache=cache)
mx.eval([c.state for c in cache])
prefill_s = time.perf_counter() - t
messages = [{"role": "user", "content": question}]
prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
tokens, text, decode_tps = [], "", 0.0
for r in stream_generate(model, tokenizer, prompt, max_tokens=int(decode_tokens),
                         sampler=make_sampler(0.0)):
    tokens.append(r.token); text += r.text; decode_tps = r.generation_tps
maps = open("/proc/self/maps").read()
print(json.dumps({"matmul_s": matmul_s, "prefill_tps": len(ids) / prefill_s,
                  "decode_tps": decode_tps, "tokens": tokens, "text": text,
                  "openblas_mapped": "libopenblas" in maps}))
"""


def probe(model_dir: Path, preload: Path | None, prefill: int, decode: int) -> dict[str, Any]:
    env = dict(os.environ)
    if preload is not None:
        env["LD_PRELOAD"] = f"{preload} {env.get('LD_PRELOAD', '')}".strip()
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(model_dir), str(prefill), str(decode), QUESTION],
        env=env, capture_output=True, text=True, check=True, timeout=1800,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - started
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefill-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    openblas = preload_for(AUTO)  # None without mlx-cpu's bundled reference BLAS or OpenBLAS
    if openblas is None:
        note("no bundled reference BLAS or no OpenBLAS here: nothing to compare")
        return 1
    model_dir = ensure_builtin_model(args.model)
    results: dict[str, Any] = {
        "machine": machine_info(mlx_device()),
        "settings": {**vars(args), "out": str(args.out), "openblas": str(openblas)},
        "rounds": [],
    }
    sides = {"bundled": None, "openblas": openblas}
    for index in range(args.rounds):
        order = alternate(index, "bundled", "openblas")
        row: dict[str, Any] = {"round": index, "order": order}
        for side in order:
            row[side] = probe(model_dir, sides[side], args.prefill_tokens, args.decode_tokens)
            note(f"round {index} {side}: prefill {row[side]['prefill_tps']:.1f} tok/s, "
                 f"decode {row[side]['decode_tps']:.1f} tok/s, {row[side]['text']!r}")  # fmt: skip
        results["rounds"].append(row)
        write_json(results, args.out)
    rounds = results["rounds"]
    summary = {}
    for key in ("matmul_s", "prefill_tps", "decode_tps"):
        ours = median([r["openblas"][key] for r in rounds])
        theirs = median([r["bundled"][key] for r in rounds])
        ratio = theirs / ours if key == "matmul_s" else ours / theirs
        summary[key] = {"bundled": theirs, "openblas": ours, "speedup": ratio}
    summary["same_tokens"] = sum(r["openblas"]["tokens"] == r["bundled"]["tokens"] for r in rounds)
    summary["openblas_mapped"] = all(r["openblas"]["openblas_mapped"] for r in rounds)
    summary["bundled_clean"] = not any(r["bundled"]["openblas_mapped"] for r in rounds)
    results["summary"] = summary
    results["machine"]["loadavg_end"] = os.getloadavg()
    write_json(results, args.out)
    m, p, d = summary["matmul_s"], summary["prefill_tps"], summary["decode_tps"]
    rows = [
        ["64x576 @ 576x1536 float32 matmul", f"{m['bundled'] * 1e3:.2f} ms",
         f"{m['openblas'] * 1e3:.2f} ms", f"{m['speedup']:.1f}x"],
        [f"prefill, {args.prefill_tokens} tokens", f"{p['bundled']:.1f} tok/s",
         f"{p['openblas']:.1f} tok/s", f"{p['speedup']:.1f}x"],
        [f"greedy decode, {args.decode_tokens} tokens", f"{d['bundled']:.1f} tok/s",
         f"{d['openblas']:.1f} tok/s", f"{d['speedup']:.1f}x"],
    ]  # fmt: skip
    print(render_table(["", "bundled (reference BLAS)", "OpenBLAS preloaded", "speedup"], rows))
    print(f"greedy answers equal in {summary['same_tokens']} of {len(rounds)} rounds; "
          f"answer with OpenBLAS: {rounds[-1]['openblas']['text']!r}")  # fmt: skip
    note(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

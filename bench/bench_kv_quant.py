"""What a quantized KV cache saves, and what it changes: peak MLX memory of a
long context with 8-bit and 4-bit KV ÷ 16-bit, and the greedy tokens that
differ.

Usage::

    python bench/bench_kv_quant.py [--model builtin:smollm2] [--context 4096]
                                   [--tokens 256] [--out bench/results/kv_quant.json]

In-process, no daemon: the model loaded with ``mlx_lm.load`` and cast to
float16 (builtin:smollm2 is stored in float32; the anchor is a 16-bit KV
cache, as most models' are), its caches made by the runner's own
``runner.kv_quant.make_cache`` (the caches a ``kv_bits`` model's runner
serves with, the dense prefill included). A prompt of ``--context`` tokens
(the chat template around a long text), then ``--tokens`` greedy tokens, one
side after the other, each from a fresh cache:

- 16-bit (the anchor), 8-bit in groups of 64 and 32, 4-bit in groups of 64
  and 32.

For each: the peak MLX memory over the request (weights included), the peak
above the memory in use before it (the request's own: the KV cache and the
activations), the KV cache's bytes at the end, each ÷ the anchor's; and the
greedy tokens against the anchor's: how many differ, and where the first
does. Also the answer to "What is the capital of France?" with each cache,
which the issue asks to stay "The capital of France is Paris." at 8 bits.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step

from common import RESULTS_DIR, fmt, load_average, machine_info, mlx_device, note, write_json
from runner.builtin import ensure_builtin_model
from runner.kv_quant import make_cache
from supervisor.figures import render_table

DEFAULT_OUT = RESULTS_DIR / "kv_quant.json"
SIDES: list[tuple[int | None, int]] = [(None, 64), (8, 64), (8, 32), (4, 64), (4, 32)]
TEXT = (
    "The lighthouse stood on a rock at the edge of the bay, and every night its keeper "
    "climbed the hundred and twelve steps to light the lamp. She kept a log of the ships "
    "that passed, the weather, the birds that rested on the gallery, and the letters that "
    "came with the supply boat once a fortnight. "
)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def label(bits: int | None, group: int) -> str:
    return "16-bit" if bits is None else f"{bits}-bit / {group}"


def long_prompt(tokenizer: Any, tokens: int) -> list[int]:
    """The chat template around as much of TEXT, repeated, as makes ``tokens`` tokens."""
    unit = len(tokenizer.encode(TEXT))
    text = TEXT * (tokens // unit + 2)
    messages = [{"role": "user", "content": f"{text}\nSummarize the keeper's log."}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    head = prompt[: tokens - 16]  # cut inside the text; the template's end is kept
    return head + prompt[-16:]


def greedy(
    model: Any, cache: list[Any], prompt: list[int], tokens: int, eos: set[int]
) -> list[int]:
    """Up to ``tokens`` greedy tokens, ending at any of ``eos``."""
    out: list[int] = []
    for token, _ in generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=tokens):
        if int(token) in eos:
            break
        out.append(int(token))
    return out


def cache_bytes(cache: list[Any]) -> int:
    return sum(layer.nbytes for layer in cache)


def side(
    model: Any, bits: int | None, group: int, prompt: list[int], tokens: int
) -> dict[str, Any]:
    """One long request on a fresh cache: its memory figures and tokens."""
    gc.collect()
    mx.clear_cache()
    cache = make_cache(model, bits, group)
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    started = time.perf_counter()
    out = greedy(model, cache, prompt, tokens, set())
    elapsed = time.perf_counter() - started
    peak = mx.get_peak_memory()
    figures = {"peak_bytes": peak, "request_peak_bytes": peak - before,
               "kv_bytes": cache_bytes(cache), "tokens": out, "seconds": elapsed}  # fmt: skip
    del cache
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16",
                        help="the model's (and so the anchor KV cache's) dtype")  # fmt: skip
    parser.add_argument("--sides", nargs="+", default=["16", "8/64", "8/32", "4/64", "4/32"],
                        help="the caches, as BITS/GROUP; 16 is the anchor")  # fmt: skip
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    load_before = load_average()
    path = ensure_builtin_model(args.model) if args.model.startswith("builtin:") else args.model
    model, tokenizer = mlx_lm.load(str(path))
    model.set_dtype(getattr(mx, args.dtype))
    mx.eval(model.parameters())
    eos = set(tokenizer.eos_token_ids)
    question = list(tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True))
    prompt = long_prompt(tokenizer, args.context)
    results: dict[str, dict[str, Any]] = {}
    wanted = {side.replace(" ", "").replace("-bit", "") for side in args.sides} | {"16"}
    for bits, group in SIDES:
        name = label(bits, group)
        if name.replace(" ", "").replace("-bit", "") not in wanted:
            continue
        note(f"{name}: {len(prompt)}-token prompt, {args.tokens} tokens")
        figures = side(model, bits, group, prompt, args.tokens)
        note(f"{name}: {figures['seconds']:.1f} s")
        answer = greedy(model, make_cache(model, bits, group), question, 24, eos)
        figures["answer"] = tokenizer.decode(answer)
        results[name] = figures
    anchor = results[label(None, 64)]
    rows = []
    for name, f in results.items():
        differ = [i for i, (a, b) in enumerate(zip(f["tokens"], anchor["tokens"], strict=True))
                  if a != b]  # fmt: skip
        f["differing_tokens"] = len(differ)
        f["first_difference"] = differ[0] if differ else None
        rows.append([
            name, fmt(f["peak_bytes"] / anchor["peak_bytes"], ".3f"),
            fmt(f["request_peak_bytes"] / anchor["request_peak_bytes"], ".3f"),
            fmt(f["kv_bytes"] / anchor["kv_bytes"], ".3f"),
            f"{len(differ)} / {args.tokens}", "-" if not differ else str(differ[0]),
            repr(f["answer"]),
        ])  # fmt: skip
    header = ["KV cache", "peak ÷ 16-bit", "request peak ÷", "KV bytes ÷",
              "tokens differing", "first at", "capital of France"]  # fmt: skip
    print(f"{args.model} ({args.dtype}), {len(prompt)}-token prompt, {args.tokens} greedy tokens")
    print(render_table(header, rows))
    for f in results.values():
        f["tokens"] = len(f["tokens"])
    write_json({
        "machine": machine_info(mlx_device()),
        "load_average": {"start": load_before, "end": load_average()},
        "settings": vars(args) | {"out": str(args.out), "prompt_tokens": len(prompt)},
        "sides": results,
    }, args.out)  # fmt: skip


if __name__ == "__main__":
    main()

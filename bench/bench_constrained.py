"""What a JSON schema costs per token: decode with the grammar ÷ decode without.

Usage::

    python bench/bench_constrained.py [--models builtin:tiny builtin:small]
                                      [--tokens 256] [--rounds 3] [--batch 4]
                                      [--out bench/results/constrained.json]

In-process, no daemon: the model loaded with ``mlx_lm.load``, the same chat
prompt, ``--tokens`` tokens greedy, two sides alternating which goes first
each round (``common.run_alternating``):

- free: no logits processor;
- constrained: ``runner.constrained``'s processor for a JSON schema (an array
  of small objects with a string, an integer and an enum; at least 10,000 of
  them, so the answer is never complete and the run never ends early: every
  step pays for a mask, in strings and in the structure between them).

Each side runs alone (mlx-lm's ``generate_step``) and in a batch of
``--batch`` identical requests (mlx-lm's ``BatchGenerator``, each constrained
request with its own processor). The figure is decode tokens per second,
timed from the first token to the last (the prefill left out), and
constrained ÷ free, with the step time the grammar adds per token. On a
slow model (builtin:small on a loaded CPU) that difference drowns in the
model's own variation, so the constrained solo run also times the
processor's calls themselves once their tokens are computed ("in grammar":
the matcher and the mask, without the wait for the model), a figure the
noise leaves alone. Also timed once per model: building the llguidance
tokenizer (once per loaded model) and compiling the schema (once per
request).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import BatchGenerator, generate_step

from common import (
    RESULTS_DIR,
    fmt,
    load_average,
    machine_info,
    mlx_device,
    note,
    ratio,
    run_alternating,
    write_json,
)
from ipc.messages import ChatOptions, ResponseFormat
from runner.builtin import ensure_builtin_model
from runner.constrained import constraint_processor, grammar_tokenizer
from supervisor.figures import median, render_table

DEFAULT_OUT = RESULTS_DIR / "constrained.json"
SCHEMA = {
    "type": "object",
    "properties": {
        "places": {
            "type": "array",
            "minItems": 10_000,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "population": {"type": "integer", "minimum": 0, "maximum": 1_000_000},
                    "kind": {"enum": ["town", "city", "village"]},
                },
                "required": ["name", "population", "kind"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["places"],
    "additionalProperties": False,
}
CHAT = ChatOptions(response_format=ResponseFormat(type="json_schema", schema=SCHEMA))
MESSAGES = [{"role": "user", "content": "List the places you know, as JSON."}]


def decode_rate(times: list[float], tokens: int) -> float:
    """Decode tokens per second: the tokens after the first, over the time
    from the first to the last."""
    return (tokens - 1) / (times[-1] - times[0])


class Timed:
    """A processor, and the time each call of it took once the tokens it is
    given are computed: the grammar's own work per token (its matcher, its
    mask), without the wait for the model that the call starts with."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.seconds: list[float] = []

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        mx.eval(tokens)
        started = time.perf_counter()
        logits = self.processor(tokens, logits)
        self.seconds.append(time.perf_counter() - started)
        return logits


def solo(
    model: Any, tokenizer: Any, prompt: list[int], tokens: int, grammar: bool
) -> tuple[float, float | None]:
    """One request through ``generate_step``: decode tokens per second, and
    the grammar's median time per token (None without one)."""
    timed = Timed(constraint_processor(CHAT, tokenizer, model.args.vocab_size, prompt))
    times = []
    for _ in generate_step(
        mx.array(prompt),
        model,
        max_tokens=tokens,
        logits_processors=[timed] if grammar else None,
    ):
        times.append(time.perf_counter())
    assert len(times) == tokens
    return decode_rate(times, tokens), median(timed.seconds) if grammar else None


def batched(
    model: Any, tokenizer: Any, prompt: list[int], tokens: int, size: int, grammar: bool
) -> float:
    """``size`` requests in one ``BatchGenerator``: decode tokens per second,
    all requests together (steps after the first, each a token per request)."""
    vocab = model.args.vocab_size
    processors = [
        [constraint_processor(CHAT, tokenizer, vocab, prompt)] if grammar else []
        for _ in range(size)
    ]
    batch = BatchGenerator(model, completion_batch_size=size, prefill_batch_size=size)
    batch.insert([prompt] * size, max_tokens=[tokens] * size, logits_processors=processors)
    times, done = [], 0
    while done < size:
        responses = batch.next_generated()
        times.append(time.perf_counter())
        done += sum(r.finish_reason is not None for r in responses)
    batch.close()
    assert len(times) == tokens
    return size * decode_rate(times, tokens)


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Both sides, alone and batched, ``args.rounds`` times, on one model."""
    model, tokenizer = mlx_lm.load(str(ensure_builtin_model(name)))
    prompt = list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True))
    vocab = model.args.vocab_size
    started = time.perf_counter()
    grammar_tokenizer(tokenizer, vocab)
    tokenizer_s = time.perf_counter() - started
    started = time.perf_counter()
    constraint_processor(CHAT, tokenizer, vocab, prompt)
    compile_s = time.perf_counter() - started
    solo(model, tokenizer, prompt, 8, grammar=True)  # warm both paths up
    batched(model, tokenizer, prompt, 8, args.batch, grammar=True)

    rounds = []
    for index in range(args.rounds):
        (free, _), (constrained, in_grammar) = run_alternating(
            index,
            lambda: solo(model, tokenizer, prompt, args.tokens, grammar=False),
            lambda: solo(model, tokenizer, prompt, args.tokens, grammar=True),
        )
        free_batch, constrained_batch = run_alternating(
            index,
            lambda: batched(model, tokenizer, prompt, args.tokens, args.batch, grammar=False),
            lambda: batched(model, tokenizer, prompt, args.tokens, args.batch, grammar=True),
        )
        rounds.append(
            {
                "solo": {
                    "free_tok_s": free,
                    "constrained_tok_s": constrained,
                    "grammar_s_per_token": in_grammar,
                },
                "batch": {"free_tok_s": free_batch, "constrained_tok_s": constrained_batch},
            }
        )
        note(f"{name} round {index + 1}/{args.rounds}: solo {free:.1f} vs {constrained:.1f}, "
             f"batch {free_batch:.1f} vs {constrained_batch:.1f} tok/s")  # fmt: skip
    figures = {}
    for mode, size in (("solo", 1), ("batch", args.batch)):
        free = median(r[mode]["free_tok_s"] for r in rounds)
        constrained = median(r[mode]["constrained_tok_s"] for r in rounds)
        figures[mode] = {
            "requests": size,
            "free_tok_s": free,
            "constrained_tok_s": constrained,
            "ratio": constrained / free,
            # The step time the grammar adds, per request's token.
            "added_s_per_token": size * (1 / constrained - 1 / free),
        }
    return {
        "model": name,
        "grammar_s_per_token": median(r["solo"]["grammar_s_per_token"] for r in rounds),
        "vocab_size": vocab,
        "prompt_tokens": len(prompt),
        "grammar_tokenizer_s": tokenizer_s,
        "schema_compile_s": compile_s,
        "figures": figures,
        "rounds": rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["builtin:tiny", "builtin:small"])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    machine = machine_info(mlx_device())
    results = [measure(name, args) for name in args.models]
    machine["loadavg_end"] = load_average()

    header = ["model", "requests", "free tok/s", "schema tok/s", "schema ÷ free",
              "added per token", "in grammar", "tokenizer build", "schema compile"]  # fmt: skip
    rows = []
    for result in results:
        for figures in result["figures"].values():
            rows.append([
                result["model"], str(figures["requests"]),
                fmt(figures["free_tok_s"], ".1f"), fmt(figures["constrained_tok_s"], ".1f"),
                ratio(figures["constrained_tok_s"], figures["free_tok_s"]),
                fmt(figures["added_s_per_token"], ".3f", 1000, " ms"),
                fmt(result["grammar_s_per_token"], ".3f", 1000, " ms"),
                fmt(result["grammar_tokenizer_s"], ".1f", 1000, " ms"),
                fmt(result["schema_compile_s"], ".1f", 1000, " ms"),
            ])  # fmt: skip
    print(f"\nDecode with a JSON schema ÷ without, {args.tokens} tokens, "
          f"median of {args.rounds} rounds")  # fmt: skip
    print(render_table(header, rows))
    write_json(
        {
            "figure": "decode tokens/s with a JSON schema (llguidance) ÷ without",
            "settings": {
                "tokens": args.tokens,
                "rounds": args.rounds,
                "batch": args.batch,
                "schema": SCHEMA,
            },
            "results": results,
            "machine": machine,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        args.out,
    )
    note(f"wrote {args.out}")


if __name__ == "__main__":
    main()

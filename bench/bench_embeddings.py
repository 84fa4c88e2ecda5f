"""Embeddings per second through the daemon ÷ mlx-lm in this process, a batch of 32 texts.

Usage::

    python bench/bench_embeddings.py [--model builtin:tiny-embed] [--batch 32]
                                     [--rounds 7] [--requests 5]
                                     [--out bench/results/embeddings.json]

Side by side in one run: ``--rounds`` times ``--requests`` requests of the same ``--batch``
texts (of 6 to 60 words), each request timed alone, the three sides taking turns request by
request (which goes first rotates), on

- ours over HTTP: OpenAI's client, ``client.embeddings.create(input=texts,
  encoding_format="float")`` on ``/v1/embeddings`` (the runner batches the texts,
  right-padded, a batch per turn of its loop);
- ours over the socket: our own client's ``embed``;
- in-process: mlx-lm in this process on the same directory, the anchor: tokenize, right-pad
  into one batch, the decoder (``model.model``), pool as the model's ``1_Pooling`` says,
  normalize, and the vectors as lists of floats (what a client gets).

The figure is embeddings/s: the batch ÷ the median time of a request (the median keeps
out the requests another process on the machine slowed down), ours ÷ in-process. The
runner computes with mlx's bundled BLAS (``cpu_blas = "bundled"``), as this process does,
so both sides multiply alike. Also printed: the largest difference between our vectors
and the in-process ones.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import openai

from common import RESULTS_DIR, Daemon, machine_info, mlx_device, note, write_json
from runner.builtin import ensure_builtin_model
from runner.embeddings import read_embedding_config
from supervisor.figures import median, render_table

DEFAULT_OUT = RESULTS_DIR / "embeddings.json"
SENTENCE = ("the river runs from the mountains to the sea and children swim in it while "
            "herons wait in the reeds for fish under the old stone bridge")  # fmt: skip
WORDS = SENTENCE.split(" ")


def texts_for(batch: int) -> list[str]:
    """``batch`` different texts of 6 to 60 words."""
    return [f"{i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(6 + (i * 7) % 55))
            for i in range(batch)]  # fmt: skip


class InProcess:
    """mlx-lm in this process: the same texts, one right-padded batch, pooled."""

    def __init__(self, path: Path) -> None:
        import mlx_lm

        config = read_embedding_config(path)
        assert config is not None, f"{path} is not an embedding model"
        self.config = config
        self.model, self.tokenizer = mlx_lm.load(str(path))[:2]

    def embed(self, texts: list[str]) -> list[list[float]]:
        import mlx.core as mx

        rows = [list(self.tokenizer.encode(text)) for text in texts]
        width = max(len(row) for row in rows)
        hidden = self.model.model(mx.array([row + [0] * (width - len(row)) for row in rows]))
        hidden = hidden.astype(mx.float32)
        n = mx.array([len(row) for row in rows])
        if self.config.pooling == "last-token":
            pooled = hidden[mx.arange(len(rows)), n - 1]
        else:  # mean
            mask = (mx.arange(width)[None, :] < n[:, None])[..., None]
            pooled = mx.where(mask, hidden, 0.0).sum(axis=1) / n[:, None]
        if self.config.normalize:
            pooled = pooled / mx.linalg.norm(pooled, axis=-1, keepdims=True)
        vectors: list[list[float]] = pooled.tolist()  # type: ignore[assignment]
        return vectors


def timed(run: Callable[[], Any]) -> float:
    """Seconds one call of ``run`` takes."""
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:tiny-embed")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    path = (ensure_builtin_model(args.model) if args.model.startswith("builtin:")
            else Path(args.model))  # fmt: skip
    texts = texts_for(args.batch)
    local = InProcess(path)
    with tempfile.TemporaryDirectory(prefix="bench-embeddings-") as tmp_name, \
            contextlib.ExitStack() as stack:  # fmt: skip
        daemon = Daemon.start(stack, Path(tmp_name), "embeddings",
                              'hot_spare = false\ncpu_blas = "bundled"\n',
                              client_timeout_s=600, http="127.0.0.1:0")  # fmt: skip
        daemon.client.load(args.model, "embed")
        daemon.settle()
        url = daemon.client.status().supervisor.http
        assert url is not None
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)

        def http() -> list[list[float]]:
            answer = api.embeddings.create(model="embed", input=texts, encoding_format="float")
            return [d.embedding for d in answer.data]

        def socket() -> list[list[float]]:
            return daemon.client.embed("embed", texts).floats()

        def inproc() -> list[list[float]]:
            return local.embed(texts)

        reference = inproc()
        max_diff = max(abs(a - b) for side in (http(), socket())  # also the warm-up
                       for got, want in zip(side, reference, strict=True)
                       for a, b in zip(got, want, strict=True))  # fmt: skip
        sides = {"http": http, "socket": socket, "in_process": inproc}
        seconds: dict[str, list[float]] = {side: [] for side in sides}
        for index in range(args.rounds * args.requests):
            order = list(sides)[index % 3:] + list(sides)[:index % 3]
            for side in order:
                seconds[side].append(timed(sides[side]))
            if (index + 1) % args.requests == 0:
                note(f"round {(index + 1) // args.requests}: " + ", ".join(
                    f"{side} {args.batch / median(s[-args.requests:]):.0f}/s"
                    for side, s in seconds.items()))  # fmt: skip
        daemon.shutdown()

    rate = {side: args.batch / median(s) for side, s in seconds.items()}
    anchor = rate["in_process"]
    rows = []
    summary: dict[str, Any] = {}
    for side, label in (("http", "ours, /v1/embeddings (openai client)"),
                        ("socket", "ours, socket (our client)"),
                        ("in_process", "mlx-lm in-process")):  # fmt: skip
        summary[side] = {"embeddings_per_s": rate[side], "ratio": rate[side] / anchor,
                         "median_request_s": median(seconds[side])}  # fmt: skip
        rows.append([label, f"{rate[side]:.0f}", f"{1000 * median(seconds[side]):.1f}",
                     f"{rate[side] / anchor:.3f}"])  # fmt: skip
    print(f"\nEmbeddings/s, {args.model}, batch of {args.batch}, median of "
          f"{args.rounds * args.requests} requests a side; largest difference from in-process "
          f"{max_diff:.2e}")  # fmt: skip
    print(render_table(["side", "embeddings/s", "ms a request", "÷ in-process"], rows))
    write_json({
        "figure": "embeddings/s ours ÷ mlx-lm in-process", "model": args.model,
        "batch": args.batch, "requests": args.rounds * args.requests, "seconds": seconds,
        "summary": summary,
        "max_abs_difference": max_diff, "machine": machine_info(mlx_device()),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }, args.out)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

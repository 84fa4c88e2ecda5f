"""Image chat first-token time through HTTP: our daemon next to ``mlx_lm.server``.

Both serve builtin:tiny-vision's directory (mlx-lm's muse_spark, random weights) and are
asked the same streamed OpenAI chat: a short question and one PNG as a data URL, greedy,
a few tokens. The first-token time is from sending the request to the first content
delta, the client's view (the decode, the vision tower and the prefill of the image's
tokens all fall in it). Each round sends a new image (the same images to both sides, in
alternating order), so neither prefix cache holds it.

Where Metal is missing (Linux), the runner replaces muse_spark's Metal kernels with plain
mlx ops (``runner.muse_spark_cpu``); mlx_lm.server gets the same through a
``sitecustomize`` on its path, so both compute alike; and on a Linux CPU mlx_lm.server gets
the BLAS our runner maps (OpenBLAS with the default ``cpu_blas``) preloaded, as
bench_real.py's ``--theirs-blas same`` does. Results go to ``bench/results/vision.json``.

    python bench/bench_vision.py [--quick] [--rounds N] [--size PIXELS] [--out FILE]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from bench_http import runner_pid, server_pid
from common import (
    RESULTS_DIR,
    Daemon,
    machine_info,
    mapped_blas,
    mlx_device,
    mlx_lm_server,
    note,
    run_alternating,
    write_json,
)
from runner.builtin import ensure_builtin_model

MODEL = "builtin:tiny-vision"
QUESTION = "What is in this picture?"
SRC = Path(__file__).resolve().parent.parent / "src"


def image_url(seed: int, size: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def first_token_s(client: httpx.Client, base: str, model: str, url: str, tokens: int) -> float:
    body = {
        "model": model, "stream": True, "max_tokens": tokens, "temperature": 0,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "image_url", "image_url": {"url": url}}]}],
    }  # fmt: skip
    started = time.perf_counter()
    first = None
    with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and '"content":' in line and '"content":""' not in line:
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError(f"no content from {base}")
    return first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds of 128-pixel images")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--size", type=int, default=256, help="image side in pixels")
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "vision.json")
    args = parser.parse_args()
    rounds, size = (5, 128) if args.quick else (args.rounds, args.size)
    model_dir = ensure_builtin_model(MODEL)
    with tempfile.TemporaryDirectory(prefix="mlx-bench-vision-") as tmp_name, \
            contextlib.ExitStack() as stack:  # fmt: skip
        tmp = Path(tmp_name)
        daemon = Daemon.start(stack, tmp, "vision", "hot_spare = false\n", http="127.0.0.1:0")
        ours = daemon.client.status().supervisor.http
        if ours is None:
            raise RuntimeError("the daemon's HTTP front is off")
        daemon.client.load(MODEL, "eyes")
        daemon.settle()
        site = tmp / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(
            "import runner.muse_spark_cpu as m\nm.install()\n", encoding="utf-8")
        env = {"PYTHONPATH": f"{site}:{SRC}"}
        ours_blas = mapped_blas(runner_pid(daemon.client, "eyes"))
        if ours_blas is not None and "openblas" in ours_blas:
            env["LD_PRELOAD"] = ours_blas
        client = stack.enter_context(httpx.Client(timeout=300))
        with mlx_lm_server(model_dir, tmp / "mlx_lm_server.log", env) as port:
            theirs = f"http://127.0.0.1:{port}"
            blas = {"ours": ours_blas, "theirs": mapped_blas(server_pid(port))}
            note(f"warming up: ours {ours}, mlx_lm.server {theirs}")
            for side, name in ((ours, "eyes"), (theirs, "default_model")):
                first_token_s(client, side, name, image_url(10_000, size), args.tokens)
            ours_s, theirs_s = [], []
            for i in range(rounds):
                url = image_url(i, size)
                a, b = run_alternating(
                    i,
                    lambda u=url: first_token_s(client, ours, "eyes", u, args.tokens),
                    lambda u=url: first_token_s(client, theirs, "default_model", u, args.tokens),
                )
                ours_s.append(a)
                theirs_s.append(b)
        image_tokens = (size // 16) ** 2
        o, t = statistics.median(ours_s), statistics.median(theirs_s)
        print(f"image chat first-token time, {MODEL}, {size}x{size} PNG ({image_tokens} image "
              f"tokens), {rounds} rounds, median:")
        print(f"  ours           {o * 1000:8.1f} ms")
        print(f"  mlx_lm.server  {t * 1000:8.1f} ms")
        print(f"  ours / mlx_lm.server = {o / t:.2f}")
        print(f"  BLAS: ours {blas['ours']}, mlx_lm.server {blas['theirs']}")
        machine = machine_info(mlx_device())
        machine["blas"] = blas
        write_json({"machine": machine, "model": MODEL, "image_side": size,
                    "image_tokens": image_tokens, "rounds": rounds, "tokens": args.tokens,
                    "ours_first_token_s": ours_s, "theirs_first_token_s": theirs_s,
                    "ours_median_s": o, "theirs_median_s": t, "ours_over_theirs": o / t},
                   args.out)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

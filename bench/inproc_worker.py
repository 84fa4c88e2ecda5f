"""The in-process side of bench_daemon.py: plain mlx-lm in a plain python process.

Started as ``python bench/inproc_worker.py``; it imports mlx-lm, says ``ready``
and then answers one JSON request per stdin line with one JSON reply per stdout
line. Nothing of mlx-supervisor is imported here: this is what a user gets by
calling ``mlx_lm.stream_generate`` in their own process.

Requests (``op``):

- ``load`` ``{key, path}``: ``mlx_lm.load(path)`` (non-lazy) and keep it as ``key``.
- ``generate`` ``{key, prompt, max_tokens}``: greedy ``stream_generate``; replies
  with the time to the first yielded response, the time to the end of the loop,
  the token count, the text and mlx-lm's own ``generation_tps``; then, untimed,
  ``mx.synchronize()`` so that no work of this process is left in flight.
- ``release`` ``{key}``: ``del model, tokenizer; gc.collect(); mx.clear_cache()``.
- ``exit``.

Every reply has ``ok``; a failed request replies ``{"ok": false, "error": ...}``.
stdout carries only the protocol: fd 1 is pointed at stderr so that a stray
print from a library cannot corrupt it.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from importlib import metadata
from typing import IO, Any

_protocol_out: IO[str] = os.fdopen(os.dup(1), "w", encoding="utf-8")
os.dup2(2, 1)

_started = time.perf_counter()
import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402

_IMPORT_S = time.perf_counter() - _started

Models = dict[str, tuple[Any, Any]]


def reply(message: dict[str, Any]) -> None:
    _protocol_out.write(json.dumps(message) + "\n")
    _protocol_out.flush()


def load(models: Models, key: str, path: str) -> dict[str, Any]:
    started = time.perf_counter()
    loaded = mlx_lm.load(path)  # (model, tokenizer)
    models[key] = (loaded[0], loaded[1])
    return {"load_s": time.perf_counter() - started, "active_bytes": mx.get_active_memory()}


def generate(models: Models, key: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One greedy generation, timed the way the bench's client times the daemon."""
    model, tokenizer = models[key]
    sampler = make_sampler(temp=0.0, top_p=1.0)
    pieces: list[str] = []
    first_s: float | None = None
    response: Any = None
    started = time.perf_counter()
    for response in mlx_lm.stream_generate(
        model, tokenizer, prompt, max_tokens=max_tokens, sampler=sampler
    ):
        if first_s is None:
            first_s = time.perf_counter() - started
        pieces.append(response.text)
    end_s = time.perf_counter() - started
    # Outside the timed part: wait for any evaluation mlx still has in flight (mlx-lm
    # queues the next token ahead), so nothing of ours runs while the daemon is measured.
    sync_started = time.perf_counter()
    mx.synchronize()
    sync_s = time.perf_counter() - sync_started
    if response is None or first_s is None:
        raise RuntimeError("stream_generate yielded nothing")
    return {
        "first_s": first_s,
        "end_s": end_s,
        "sync_s": sync_s,
        "frames": len(pieces),
        "generation_tokens": response.generation_tokens,
        "generation_tps": response.generation_tps,
        "prompt_tokens": response.prompt_tokens,
        "finish_reason": response.finish_reason,
        "text": "".join(pieces),
    }


def release(models: Models, key: str) -> dict[str, Any]:
    model, tokenizer = models.pop(key)
    del model, tokenizer
    gc.collect()
    mx.clear_cache()
    return {"active_bytes": mx.get_active_memory(), "cache_bytes": mx.get_cache_memory()}


def handle(models: Models, request: dict[str, Any]) -> dict[str, Any]:
    op = request["op"]
    if op == "load":
        return load(models, request["key"], request["path"])
    if op == "generate":
        return generate(models, request["key"], request["prompt"], int(request["max_tokens"]))
    if op == "release":
        return release(models, request["key"])
    raise ValueError(f"unknown op {op!r}")


def main() -> int:
    models: Models = {}
    reply(
        {
            "ok": True,
            "ready": True,
            "pid": os.getpid(),
            "import_s": _IMPORT_S,
            "device": str(mx.default_device()),
            "mlx": metadata.version("mlx"),
            "mlx_lm": metadata.version("mlx-lm"),
        }
    )
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") == "exit":
            reply({"ok": True})
            return 0
        try:
            result = handle(models, request)
        except Exception as exc:
            reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        else:
            reply({"ok": True, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())

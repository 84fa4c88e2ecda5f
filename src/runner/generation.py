"""One generation request: mlx-lm's stream_generate, streamed as frames."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx_lm.sample_utils import make_sampler

from ipc.messages import FinishReason, Generate, GenerationDone, Heartbeat, TextChunk
from runner.faults import Faults

HEARTBEAT_INTERVAL_S = 0.5


def build_prompt(tokenizer: Any, request: Generate) -> str | list[int]:
    """The prompt as mlx-lm takes it: raw text, or chat-templated token ids."""
    if request.messages is not None:
        turns = [{"role": m.role, "content": m.content} for m in request.messages]
        return list(tokenizer.apply_chat_template(turns, add_generation_prompt=True))
    if request.prompt is None:
        raise ValueError("a generate request needs a prompt or messages")
    return request.prompt


def run_generation(
    model: Any,
    tokenizer: Any,
    request: Generate,
    *,
    max_tokens_cap: int | None,
    cancelled: threading.Event,
    send: Callable[[TextChunk | Heartbeat], None],
    faults: Faults,
) -> GenerationDone:
    """Generate for ``request``, calling ``send`` for every token.

    Prefill progress goes out as Heartbeats, so the supervisor's stall
    watchdog can tell a long prompt from a hung one.

    Stops within one token of ``cancelled`` being set; the result then says
    ``finish_reason="cancelled"``.
    """
    received = time.perf_counter()
    sampling = request.sampling
    max_tokens = sampling.max_tokens
    if max_tokens_cap is not None:
        max_tokens = min(max_tokens, max_tokens_cap)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    if sampling.seed is not None:
        mx.random.seed(sampling.seed)
    sampler = make_sampler(temp=sampling.temperature, top_p=sampling.top_p)
    prompt = build_prompt(tokenizer, request)

    finish: FinishReason = "length"
    ttft_s = 0.0
    response = None
    mx.reset_peak_memory()

    last_beat = [received]

    def prefill_progress(processed: int, total: int) -> None:
        # Enough for the watchdog (whose timeouts are many seconds), without
        # waking the supervisor for every prompt chunk.
        now = time.perf_counter()
        if now - last_beat[0] >= HEARTBEAT_INTERVAL_S:
            last_beat[0] = now
            send(Heartbeat("prefill", processed))

    for response in mlx_lm.stream_generate(
        model,
        tokenizer,
        prompt,
        max_tokens=max_tokens,
        sampler=sampler,
        prompt_progress_callback=prefill_progress,
    ):
        if response.generation_tokens == 1:
            ttft_s = time.perf_counter() - received
        faults.at_token(response.generation_tokens)
        send(TextChunk(request.request_id, response.text, response.generation_tokens))
        if response.finish_reason is not None:
            finish = "stop" if response.finish_reason == "stop" else "length"
        if cancelled.is_set():
            finish = "cancelled"
            break
    if response is None:
        raise RuntimeError("mlx-lm produced no tokens")
    return GenerationDone(
        request_id=request.request_id,
        prompt_tokens=response.prompt_tokens,
        generation_tokens=response.generation_tokens,
        prompt_tps=response.prompt_tps,
        generation_tps=response.generation_tps,
        ttft_s=ttft_s,
        peak_memory_bytes=int(mx.get_peak_memory()),
        finish_reason=finish,
    )

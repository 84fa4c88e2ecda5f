"""One generation request: mlx-lm's stream_generate, streamed as frames,
with the hard token cap and the generation memory guard."""

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
from runner.guard import MemoryGuard

HEARTBEAT_INTERVAL_S = 0.5


def build_prompt(tokenizer: Any, request: Generate) -> str | list[int]:
    """The prompt as mlx-lm takes it: raw text, or chat-templated token ids."""
    if request.messages is not None:
        turns = [{"role": m.role, "content": m.content} for m in request.messages]
        return list(tokenizer.apply_chat_template(turns, add_generation_prompt=True))
    if request.prompt is None:
        raise ValueError("a generate request needs a prompt or messages")
    return request.prompt


class _StoppedInPrefill(Exception):
    """Raised from the prefill callback to leave mlx-lm's generator."""

    def __init__(self, detail: str, prompt_tokens: int) -> None:
        super().__init__(detail)
        self.detail = detail
        self.prompt_tokens = prompt_tokens


def run_generation(
    model: Any,
    tokenizer: Any,
    request: Generate,
    *,
    max_tokens_cap: int | None,
    cancelled: threading.Event,
    send: Callable[[TextChunk | Heartbeat], None],
    faults: Faults,
    guard: MemoryGuard | None = None,
) -> GenerationDone:
    """Generate for ``request``, calling ``send`` for every token.

    A request asking for more than ``max_tokens_cap`` tokens gets the cap,
    and the result says so (``max_tokens_clamped_to``). Heartbeats carrying
    ``guard``'s memory figures go out at most every
    :data:`HEARTBEAT_INTERVAL_S` in prefill (so the supervisor's stall
    watchdog can tell a long prompt from a hung one) and in decode.

    ``guard`` checks memory at each prefill step and every
    :data:`~runner.guard.CHECK_EVERY_TOKENS` tokens; when memory stays
    critical after an emergency cleanup the request ends with
    ``finish_reason="memory_pressure"`` and the numbers in ``detail``.
    Without a guard the figures are still measured, nothing is checked.

    Stops within one token of ``cancelled`` being set; the result then says
    ``finish_reason="cancelled"``.

    Raises:
        ValueError: no prompt, or ``max_tokens`` below 1.
    """
    received = time.perf_counter()
    guard = guard if guard is not None else MemoryGuard()
    sampling = request.sampling
    max_tokens = sampling.max_tokens
    clamped_to = None
    if max_tokens_cap is not None and max_tokens > max_tokens_cap:
        max_tokens = clamped_to = max_tokens_cap
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    if sampling.seed is not None:
        mx.random.seed(sampling.seed)
    sampler = make_sampler(temp=sampling.temperature, top_p=sampling.top_p)
    prompt = build_prompt(tokenizer, request)
    request_guard = guard.start_request(request.request_id)

    finish: FinishReason = "length"
    detail: str | None = None
    ttft_s = 0.0
    response = None
    mx.reset_peak_memory()

    last_beat = [received]

    def heartbeat_due() -> bool:
        # Enough for the watchdog (whose timeouts are many seconds), without
        # waking the supervisor for every prompt chunk or token.
        now = time.perf_counter()
        if now - last_beat[0] < HEARTBEAT_INTERVAL_S:
            return False
        last_beat[0] = now
        return True

    def prefill_progress(processed: int, total: int) -> None:
        stop = request_guard.check(f"in prefill ({processed}/{total} prompt tokens)")
        if stop is not None:
            raise _StoppedInPrefill(stop, total)
        if heartbeat_due():
            send(Heartbeat("prefill", processed, guard.figures))

    prompt_tokens = 0
    try:
        for response in mlx_lm.stream_generate(
            model,
            tokenizer,
            prompt,
            max_tokens=max_tokens,
            sampler=sampler,
            prompt_progress_callback=prefill_progress,
        ):
            tokens = response.generation_tokens
            if tokens == 1:
                ttft_s = time.perf_counter() - received
            faults.at_token(tokens)
            send(TextChunk(request.request_id, response.text, tokens))
            if response.finish_reason is not None:  # done anyway: no guard check to relabel it
                finish = "stop" if response.finish_reason == "stop" else "length"
                break
            detail = request_guard.at_token(tokens)
            if detail is not None:
                finish = "memory_pressure"
                break
            if cancelled.is_set():
                finish = "cancelled"
                break
            if heartbeat_due():
                guard.refresh()
                send(Heartbeat("decode", tokens, guard.figures))
    except _StoppedInPrefill as stopped:
        finish, detail, prompt_tokens = "memory_pressure", stopped.detail, stopped.prompt_tokens
    finally:
        faults.end_request()
    if finish == "memory_pressure":  # give back what the stopped request held, now
        guard.emergency_cleanup(f"request {request.request_id} stopped")
    elif response is None:
        raise RuntimeError("mlx-lm produced no tokens")
    return GenerationDone(
        request_id=request.request_id,
        prompt_tokens=prompt_tokens if response is None else response.prompt_tokens,
        generation_tokens=0 if response is None else response.generation_tokens,
        prompt_tps=0.0 if response is None else response.prompt_tps,
        generation_tps=0.0 if response is None else response.generation_tps,
        ttft_s=ttft_s,
        peak_memory_bytes=int(mx.get_peak_memory()),
        finish_reason=finish,
        max_tokens_clamped_to=clamped_to,
        detail=detail,
    )

"""A request's sampling settings as mlx-lm's own sampler and logits
processors, and the log probabilities a client asked for.

The sampler (temperature, ``top_p``, ``top_k``, ``min_p``, XTC) is
mlx-lm's ``make_sampler``, one object per setting shared by every request
that asks for it: a batch whose rows share a sampler samples them in one
call. The processors (``logit_bias``, repetition, presence and frequency
penalties) are mlx-lm's ``make_logits_processors``, one list per request.

Every setting is checked here, before the request starts: a bad one that
reached mlx-lm would raise inside a batch step and fail the whole batch.

Log probabilities are read from the vector mlx-lm hands out with each
token (``generate_step``'s second value, a ``BatchGenerator`` response's
``logprobs``): the log-softmax of the logits *after* the logits processors
(penalties, ``logit_bias``, a grammar's mask) and *before* the sampler's
temperature and truncation. That is the distribution the token was drawn
from before temperature, as mlx_lm.server reports it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    _byte_decoder,
)

from ipc.messages import SamplingParams, TokenLogprob

__all__ = [
    "MAX_TOP_LOGPROBS",
    "LogitsProcessor",
    "PendingLogprob",
    "Sampler",
    "TokenTexts",
    "check_logprobs",
    "logits_processors_for",
    "model_vocab_size",
    "read_logprobs",
    "sampler_for",
    "token_logprobs",
]

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

MAX_TOP_LOGPROBS = 20
"""The most alternatives per token a request may ask for (OpenAI's limit)."""
SAMPLER_CACHE_LIMIT = 256
"""Distinct sampler settings kept; past it the cache starts afresh (a request
that finds no shared sampler gets its own: only batched sampling slows)."""

SamplerKey = tuple[float, float, int, float, float, float]


def sampler_for(
    params: SamplingParams,
    cache: dict[SamplerKey, Sampler],
    *,
    vocab_size: int,
    xtc_special_tokens: list[int],
) -> Sampler:
    """mlx-lm's sampler for ``params``, the same object for the same setting.

    Args:
        params: the request's sampling settings.
        cache: the samplers made so far, by setting (the engine's).
        vocab_size: the model's logits width (``top_k`` at or past it keeps
            every token, which mlx-lm would refuse).
        xtc_special_tokens: tokens XTC never removes (a newline and the end
            tokens, as mlx_lm.server sets them).

    Raises:
        ValueError: a setting out of its range, naming it.
    """
    _check_range("temperature", params.temperature, 0.0, math.inf)
    _check_range("top_p", params.top_p, 0.0, 1.0)
    _check_range("min_p", params.min_p, 0.0, 1.0)
    _check_range("xtc_probability", params.xtc_probability, 0.0, 1.0)
    _check_range("xtc_threshold", params.xtc_threshold, 0.0, 0.5)
    if params.top_k < 0:
        raise ValueError(f"top_k must be 0 (off) or more, got {params.top_k}")
    top_k = params.top_k if params.top_k < vocab_size else 0
    key: SamplerKey = (params.temperature, params.top_p, top_k, params.min_p,
                       params.xtc_probability, params.xtc_threshold)  # fmt: skip
    sampler = cache.get(key)
    if sampler is None:
        if len(cache) >= SAMPLER_CACHE_LIMIT:
            cache.clear()
        sampler = cache[key] = make_sampler(
            temp=params.temperature,
            top_p=params.top_p,
            min_p=params.min_p,
            top_k=top_k,
            xtc_probability=params.xtc_probability,
            xtc_threshold=params.xtc_threshold,
            xtc_special_tokens=xtc_special_tokens,
        )
    return sampler


def logits_processors_for(params: SamplingParams, *, vocab_size: int) -> list[LogitsProcessor]:
    """mlx-lm's logits processors for ``params``' ``logit_bias`` and
    penalties (an empty list when none is asked for): one list per request,
    in mlx-lm's order (the bias, then the penalties).

    Raises:
        ValueError: a ``logit_bias`` token outside the vocabulary or a bias
            that is not a number, a negative repetition penalty, or a
            context size under 1.
    """
    bias = params.logit_bias or None
    if bias is not None:
        for token, value in bias.items():
            if not 0 <= token < vocab_size:
                raise ValueError(f"logit_bias names token {token}, outside the "
                                 f"vocabulary (0 to {vocab_size - 1})")  # fmt: skip
            if not math.isfinite(value):
                raise ValueError(f"logit_bias for token {token} is not a finite number")
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{name} is not a finite number")
    if params.repetition_penalty is not None and params.repetition_penalty < 0:
        raise ValueError(f"repetition_penalty must be 0 or more, got {params.repetition_penalty}")
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        size = getattr(params, name)
        if size < 1:
            raise ValueError(f"{name} must be at least 1, got {size}")
    processors: list[LogitsProcessor] = make_logits_processors(
        logit_bias=bias,
        repetition_penalty=params.repetition_penalty,
        repetition_context_size=params.repetition_context_size,
        presence_penalty=params.presence_penalty,
        presence_context_size=params.presence_context_size,
        frequency_penalty=params.frequency_penalty,
        frequency_context_size=params.frequency_context_size,
    )
    return processors


def check_logprobs(params: SamplingParams) -> None:
    """Raises ValueError if ``top_logprobs`` is out of its range (0 to
    MAX_TOP_LOGPROBS)."""
    if not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be 0 to {MAX_TOP_LOGPROBS}, got {params.top_logprobs}")


@dataclass(frozen=True)
class PendingLogprob:
    """A token's log probabilities on their way from the device: ``values``
    holds the token's, then those of ``ids`` (the top asked for)."""

    token: int
    values: mx.array
    ids: mx.array | None


class TokenTexts:
    """Each token's text and, where the text does not carry them, its bytes
    (see :class:`ipc.messages.TokenLogprob`), once per token id (a frame of
    top 20 alternatives would otherwise read 21 ids per token).

    A token's bytes are read as mlx-lm's streaming detokenizer reads them
    (the byte-level BPE's map, or SentencePiece's byte tokens): decoded
    alone, a token that holds part of a UTF-8 character would be "\\ufffd",
    its bytes lost. A tokenizer with no such map (and an added token, which
    is text) is decoded as it is."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._bytes_of = _token_bytes_reader(tokenizer)
        self._texts: dict[int, tuple[str, list[int] | None]] = {}

    def __call__(self, token: int) -> tuple[str, list[int] | None]:
        """The token's text, and its bytes if they are not that text's UTF-8."""
        found = self._texts.get(token)
        if found is None:
            raw = self._bytes_of(token)
            if raw is None:
                found = (str(self._tokenizer.decode([token])), None)
            else:
                try:
                    found = (raw.decode("utf-8"), None)
                except UnicodeDecodeError:  # part of a character
                    found = (raw.decode("utf-8", "backslashreplace"), list(raw))
            self._texts[token] = found
        return found


def _token_bytes_reader(tokenizer: Any) -> Callable[[int], bytes | None]:
    """How to read a token's bytes from ``tokenizer``'s streaming
    detokenizer's map (None for a token it cannot tell)."""
    detokenizer = tokenizer.detokenizer
    tokenmap = getattr(detokenizer, "tokenmap", None)
    if not isinstance(tokenmap, list):
        return lambda token: None
    added = set(getattr(tokenizer, "added_tokens_decoder", None) or ())
    if isinstance(detokenizer, BPEStreamingDetokenizer):
        decoder: dict[str, int] = _byte_decoder()

        def bpe(token: int) -> bytes | None:
            if token in added or not 0 <= token < len(tokenmap):
                return None
            return b"".join(bytes([decoder[c]]) if c in decoder else c.encode()
                            for c in tokenmap[token])  # fmt: skip

        return bpe
    if isinstance(detokenizer, SPMStreamingDetokenizer):
        sep = SPMStreamingDetokenizer._sep

        def spm(token: int) -> bytes | None:
            if token in added or not 0 <= token < len(tokenmap):
                return None
            return bytes(tokenmap[token]).replace(sep, b" ")

        return spm
    return lambda token: None


def token_logprobs(logprobs: mx.array, token: int, top_n: int) -> PendingLogprob:
    """Start reading ``token``'s log probability in ``logprobs`` (the vector
    mlx-lm gave with it) and those of the ``top_n`` most likely tokens.

    Nothing waits here: the values are computed on the device beside the
    next step, and :func:`read_logprobs` takes them when a frame goes out. A
    read per token would stall the pipeline that ``generate_step`` and a
    batch keep (the next step is already queued when a token comes out)."""
    top_n = min(top_n, logprobs.shape[-1])
    chosen = logprobs[token : token + 1]
    if top_n <= 0:
        values, ids = chosen.astype(mx.float32), None
        mx.async_eval(values)  # type: ignore[no-untyped-call]
    else:
        ids = mx.argpartition(-logprobs, kth=top_n - 1)[:top_n]
        values = mx.concatenate([chosen, logprobs[ids]]).astype(mx.float32)
        mx.async_eval(values, ids)  # type: ignore[no-untyped-call]
    return PendingLogprob(token, values, ids)


def read_logprobs(pending: list[PendingLogprob], texts: TokenTexts) -> list[TokenLogprob]:
    """The log probabilities started by :func:`token_logprobs`, as the wire
    carries them: the top alternatives most likely first (ties by token id),
    each token as its text (and its bytes, where the text cannot hold them).

    Tokens the processors ruled out (a grammar's mask: log probability
    -inf) are no alternatives and are left out, so ``top`` may be shorter."""
    entries = []
    for item in pending:
        read = cast(list[float], item.values.tolist())
        top: list[tuple[str, float]] = []
        top_bytes: list[list[int] | None] = []
        if item.ids is not None:
            top_ids = cast(list[int], item.ids.tolist())
            pairs = sorted(zip(top_ids, read[1:], strict=True), key=lambda p: (-p[1], p[0]))
            for token, value in pairs:
                if value != -math.inf:
                    text, raw = texts(token)
                    top.append((text, value))
                    top_bytes.append(raw)
        text, raw = texts(item.token)
        entries.append(TokenLogprob(text, read[0], top, bytes=raw,
                                    top_bytes=top_bytes if any(top_bytes) else None))  # fmt: skip
    return entries


def model_vocab_size(model: Any, tokenizer: Any) -> int:
    """The width of the model's logits: its configured vocabulary (which may
    pad the tokenizer's), or the tokenizer's size when the model's
    arguments do not say."""
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    if size is None:
        text_config = getattr(args, "text_config", None)
        if isinstance(text_config, dict):
            size = text_config.get("vocab_size")
    return int(size) if size is not None else len(tokenizer)


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:  # a NaN fails too
        bounds = f"{low:g} or more" if high == math.inf else f"{low:g} to {high:g}"
        raise ValueError(f"{name} must be {bounds}, got {value}")

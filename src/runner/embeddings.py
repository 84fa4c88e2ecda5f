"""Embeddings in the runner: the model kind, read from the model's files, and the
requests' vectors, computed a batch per turn of the runner's loop (commands are taken
between two batches, as between two engine steps).

A model is an embedding model when its directory is laid out for sentence-transformers, as
Qwen3-Embedding's is: ``modules.json`` names a Pooling module, whose ``config.json`` says how
the last hidden states become one vector (``pooling_mode_lasttoken``, ``_mean_tokens``,
``_cls_token``, ``_max_tokens`` or ``_mean_sqrt_len_tokens``), and maybe a Normalize module
(unit length). Anything else is a chat model. The hidden states are mlx-lm's own: the decoder
(``model.model``) without its output layer, on inputs right-padded into one batch. The models
are causal, so a token never sees the padding after it, and a text's vector does not depend on
what it was batched with.

``dimensions`` keeps the leading dimensions of each vector (then normalized again when the
model normalizes), for the models whose ``config.json`` says they were trained for it
(``is_matryoshka``, or ``matryoshka_dimensions`` listing the widths allowed), as vLLM reads
them.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from ipc import ProtocolError
from ipc.messages import EMBED_CANCELLED, Embed, Embeddings

if TYPE_CHECKING:
    from runner.faults import Faults
    from runner.guard import MemoryGuard, RequestGuard

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "EMBED_BATCH_TOKENS",
    "EmbeddingConfig",
    "EmbeddingQueue",
    "not_an_embedding_model",
    "read_embedding_config",
]

log = structlog.get_logger("runner.embeddings")

EMBED_BATCH_TOKENS = 8192
"""Padded tokens one forward pass takes at most (rows x longest row); a longer
input goes alone. Bounds the memory of a step and how long generations wait for it."""
EMBED_BATCH_ROWS = 64
DEFAULT_MAX_TOKENS = 8192
"""The longest input of a model whose config.json gives no max_position_embeddings."""
REPLY_MARGIN_BYTES = 4096
"""Room kept in a reply's frame for what is not the vectors (ids, counts, headers)."""
BYTES_PER_VECTOR = 8
"""msgpack's header of one vector's bytes, at most (bin 32: 5 bytes), rounded up."""

POOLING_MODES: dict[str, str] = {
    "pooling_mode_lasttoken": "last-token",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "first-token",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
}
"""1_Pooling/config.json's keys, and the pooling each names."""

_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"


class EmbeddingConfigError(ValueError):
    """The model's sentence-transformers files ask for what the runner cannot do."""


class MemoryShort(RuntimeError):
    """The memory guard found memory short before a batch: its requests fail."""


@dataclass(frozen=True)
class EmbeddingConfig:
    """How an embedding model's vectors are made.

    ``pooling``: last-token, mean, first-token (CLS), max or mean_sqrt_len. ``dimensions``: the
    vectors' width. ``max_tokens``: the longest input. ``matryoshka``: the
    widths ``dimensions`` may ask for (empty: none but the model's own;
    None: any from 1 to the model's).
    """

    pooling: str
    normalize: bool
    dimensions: int
    max_tokens: int
    vocab_size: int
    matryoshka: tuple[int, ...] | None = ()

    def describe(self) -> str:
        return f"{self.pooling} pooling{', normalized' if self.normalize else ''}"


def read_embedding_config(path: Path) -> EmbeddingConfig | None:
    """The embedding config of the model in directory ``path``; None for a
    chat model (no ``modules.json`` with a Pooling module).

    Raises:
        EmbeddingConfigError: the files name a module or pooling the runner
            does not apply (a Dense layer, weighted-mean pooling, ...).
    """
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text(encoding="utf-8"))
    if not isinstance(modules, list):
        raise EmbeddingConfigError(f"{modules_file}: not a list of modules")
    kinds = [str(module.get("type", "")) for module in modules if isinstance(module, dict)]
    pooling_paths = [str(m.get("path", "")) for m in modules if m.get("type") == _POOLING]
    if not pooling_paths:
        return None
    other = [kind for kind in kinds if kind not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
    if other:
        raise EmbeddingConfigError(f"{modules_file} names {', '.join(other)}, which "
                                   "mlx-supervisor does not apply")  # fmt: skip
    pooling_file = path / pooling_paths[0] / "config.json"
    pooling_config = json.loads(pooling_file.read_text(encoding="utf-8"))
    modes = [POOLING_MODES[key] for key in POOLING_MODES if pooling_config.get(key)]
    others = [key for key, on in pooling_config.items()
              if key.startswith("pooling_mode_") and on and key not in POOLING_MODES]  # fmt: skip
    if others or len(modes) != 1:
        raise EmbeddingConfigError(f"{pooling_file}: one of {', '.join(POOLING_MODES)} must be "
                                   f"on (found {', '.join(others) or len(modes)})")  # fmt: skip
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    text_config = config.get("text_config") or config
    hidden = int(pooling_config.get("word_embedding_dimension") or text_config["hidden_size"])
    max_tokens = int(text_config.get("max_position_embeddings") or DEFAULT_MAX_TOKENS)
    bert_file = path / "sentence_bert_config.json"
    if bert_file.is_file():
        limit = json.loads(bert_file.read_text(encoding="utf-8")).get("max_seq_length")
        max_tokens = min(max_tokens, int(limit)) if limit else max_tokens
    matryoshka: tuple[int, ...] | None = ()
    if config.get("matryoshka_dimensions"):
        matryoshka = tuple(int(d) for d in config["matryoshka_dimensions"])
    elif config.get("is_matryoshka"):
        matryoshka = None
    return EmbeddingConfig(
        pooling=modes[0],
        normalize=_NORMALIZE in kinds,
        dimensions=hidden,
        max_tokens=max_tokens,
        vocab_size=int(text_config["vocab_size"]),
        matryoshka=matryoshka,
    )


def not_an_embedding_model(name: str) -> str:
    """Why a chat model does not answer an embeddings request."""
    return (
        f"model {name} is a chat model, not an embedding model: its directory has no "
        "sentence-transformers pooling (modules.json naming a Pooling module, as "
        "Qwen3-Embedding has); use an embedding model such as builtin:tiny-embed"
    )


def not_a_chat_model(name: str, config: EmbeddingConfig) -> str:
    """Why an embedding model does not answer a chat or completion."""
    return (
        f"model {name} is an embedding model ({config.describe()}, from its modules.json): "
        "it answers /v1/embeddings and /api/embed, not chat or completions"
    )


@dataclass
class _Request:
    """One Embed in progress: its vectors as they are computed."""

    request_id: int
    dimensions: int
    vectors: list[bytes | None]
    tokens: int
    guard: RequestGuard | None = None
    batches: int = 0  # batches of its rows computed (or being computed)
    left: int = field(init=False)

    def __post_init__(self) -> None:
        self.left = len(self.vectors)


@dataclass(frozen=True)
class _Row:
    request: _Request
    index: int
    tokens: list[int]


class EmbeddingQueue:
    """The runner's embed requests: tokenized and checked when they come, then
    computed a batch per :meth:`step` (rows of several requests share one, in
    the order they came, sorted by length within a request), each answered
    with :class:`Embeddings` when its last row is done. A request cancelled
    (or every one, when the runner shuts down) loses its rows still queued
    and is answered :data:`EMBED_CANCELLED`.

    Args:
        model: the mlx-lm model (its decoder, ``model.model``, gives the hidden states).
        tokenizer: mlx-lm's tokenizer wrapper.
        config: how the vectors are made.
        name: the model's name, for messages.
        send: where the answers go.
        max_reply_bytes: the largest frame the runner may send: a request
            whose vectors would not fit in one is refused before computing.
        is_cancelled: whether a request (by id) was cancelled.
        guard: the runner's memory guard (checked before each batch).
        faults: fault injection (``slow_prefill`` slows each batch).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: EmbeddingConfig,
        name: str,
        send: Callable[[Embeddings], None],
        *,
        max_reply_bytes: int,
        is_cancelled: Callable[[int], bool] = lambda request_id: False,
        guard: MemoryGuard | None = None,
        faults: Faults | None = None,
    ) -> None:
        decoder = getattr(model, "model", None)
        if not callable(decoder):
            raise EmbeddingConfigError(f"{type(model).__module__} has no decoder (model.model) "
                                       "whose hidden states could be pooled")  # fmt: skip
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.config = config
        self.name = name
        self.send = send
        self.max_reply_bytes = max_reply_bytes
        self.is_cancelled = is_cancelled
        self.guard = guard
        self.faults = faults
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if isinstance(pad, int) else 0
        self._rows: deque[_Row] = deque()

    @property
    def has_work(self) -> bool:
        return bool(self._rows)

    def submit(self, command: Embed) -> None:
        """Take ``command``: refuse it at once (an :class:`Embeddings` with
        ``invalid_request``) when it cannot run, else queue its rows."""
        try:
            dimensions = self._dimensions(command.dimensions)
            self._check_reply_size(len(command.inputs), dimensions)
            rows = [self._tokens(i, item, command.truncate)
                    for i, item in enumerate(command.inputs)]  # fmt: skip
            if not rows:
                raise ValueError("input is empty: give at least one text")
        except ValueError as exc:
            self.send(Embeddings(command.request_id, error=str(exc), invalid_request=True))
            return
        guard = self.guard.start_request(command.request_id) if self.guard else None
        request = _Request(command.request_id, dimensions, [None] * len(rows),
                           sum(len(r) for r in rows), guard)  # fmt: skip
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        self._rows.extend(_Row(request, i, rows[i]) for i in order)

    def step(self) -> None:
        """Compute the next batch of rows; answer each request they finish.
        A failure fails the requests of that batch (and their other rows);
        so does memory the guard finds short before the batch."""
        self._drop_cancelled()
        if not self._rows:
            return
        batch = self._next_batch()
        requests = list({id(row.request): row.request for row in batch}.values())
        try:
            first = requests[0]
            first.batches += 1
            width = max(len(row.tokens) for row in batch)
            if first.guard is not None:
                detail = first.guard.at_cadence(f"before an embedding batch ({len(batch)} x "
                                                f"{width} tokens)")  # fmt: skip
                if detail is not None:
                    raise MemoryShort(f"memory_pressure: {detail}")
            if self.faults is not None:
                self.faults.prefill_chunk(first.batches, len(batch) * width)
            pooled = self._embed([row.tokens for row in batch])
            vectors = [self._finish(pooled[i], row.request.dimensions)
                       for i, row in enumerate(batch)]  # fmt: skip
        except Exception as exc:
            short = isinstance(exc, MemoryShort)
            if not short:
                log.exception("embedding_failed", rows=len(batch))
            error = str(exc) if short else f"{type(exc).__name__}: {exc}"
            self._drop({request.request_id for request in requests}, error)
            return
        finally:
            if self.guard is not None:
                self.guard.refresh()  # the figures Pongs carry, after the batch's memory
        for row, vector in zip(batch, vectors, strict=True):
            request = row.request
            request.vectors[row.index] = vector
            request.left -= 1
            if request.left == 0:
                done = [v for v in request.vectors if v is not None]
                self._answer(Embeddings(request.request_id, done, request.tokens))

    def cancel_all(self) -> None:
        """Answer every queued request :data:`EMBED_CANCELLED` (the runner shuts down)."""
        self.fail_all(EMBED_CANCELLED)

    def fail_all(self, error: str) -> None:
        """Answer every queued request ``error`` and drop its rows."""
        self._drop({row.request.request_id for row in self._rows}, error)

    def _drop_cancelled(self) -> None:
        cancelled = {row.request.request_id for row in self._rows
                     if self.is_cancelled(row.request.request_id)}  # fmt: skip
        if cancelled:
            log.info("embed_cancelled", requests=sorted(cancelled))
            self._drop(cancelled, EMBED_CANCELLED)

    def _drop(self, request_ids: set[int], error: str) -> None:
        """Drop the rows of ``request_ids`` and answer each with ``error``."""
        self._rows = deque(row for row in self._rows
                           if row.request.request_id not in request_ids)  # fmt: skip
        for request_id in sorted(request_ids):
            self.send(Embeddings(request_id, error=error))

    def _answer(self, answer: Embeddings) -> None:
        """Send ``answer``; one too large for a frame fails its request instead."""
        try:
            self.send(answer)
        except ProtocolError as exc:  # raised before a byte is written: the pipe is whole
            log.error("embeddings_reply_too_large", request_id=answer.request_id, error=str(exc))
            self.send(Embeddings(answer.request_id, error=f"the reply is too large: {exc}",
                                 invalid_request=True))  # fmt: skip

    # --- checks --------------------------------------------------------------

    def _dimensions(self, asked: int | None) -> int:
        full = self.config.dimensions
        if asked is None or asked == full:
            return full
        allowed = self.config.matryoshka
        if allowed is not None and not allowed:
            raise ValueError(f"dimensions: model {self.name} gives {full}-dimensional vectors "
                             "and was not trained to be cut shorter (its config.json has no "
                             "is_matryoshka or matryoshka_dimensions)")  # fmt: skip
        if allowed and asked not in allowed:
            widths = ", ".join(str(d) for d in allowed)
            raise ValueError(f"dimensions: model {self.name} takes one of {widths}")
        if not 1 <= asked <= full:
            raise ValueError(f"dimensions: model {self.name} takes 1 to {full}, not {asked}")
        return asked

    def _check_reply_size(self, inputs: int, dimensions: int) -> None:
        """Refuse a request whose vectors would not fit in one reply frame."""
        per_vector = dimensions * 4 + BYTES_PER_VECTOR
        need = inputs * per_vector + REPLY_MARGIN_BYTES
        if need > self.max_reply_bytes:
            most = max((self.max_reply_bytes - REPLY_MARGIN_BYTES) // per_vector, 0)
            raise ValueError(f"input: {inputs} inputs x {dimensions} dimensions make a reply of "
                             f"{need} bytes, over the {self.max_reply_bytes}-byte frame limit "
                             f"(max_frame_bytes); send fewer inputs (at most {most})")  # fmt: skip

    def _tokens(self, index: int, item: str | list[int], truncate: bool) -> list[int]:
        if isinstance(item, str):
            if not item:
                raise ValueError(f"input[{index}] is an empty string")
            tokens = list(self.tokenizer.encode(item))
        else:
            tokens = item
            if not tokens:
                raise ValueError(f"input[{index}] is an empty list of tokens")
            vocab = self.config.vocab_size
            bad = next((t for t in tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"input[{index}] has token id {bad}, outside the model's "
                                 f"vocabulary (0 to {vocab - 1})")  # fmt: skip
        limit = self.config.max_tokens
        if len(tokens) > limit:
            if not truncate:
                raise ValueError(f"input[{index}] has {len(tokens)} tokens, over model "
                                 f"{self.name}'s {limit}")  # fmt: skip
            tokens = self._cut(item, tokens, limit) if isinstance(item, str) else tokens[:limit]
        return tokens

    def _cut(self, text: str, tokens: list[int], limit: int) -> list[int]:
        """``text``'s ``tokens`` cut to ``limit``, keeping the special tokens
        the tokenizer adds around the text (the end token Qwen3-Embedding's
        appends is the one its last-token pooling reads): the text's own
        tokens are cut, not those."""
        plain = list(self.tokenizer.encode(text, add_special_tokens=False))
        for head in range(len(tokens) - len(plain) + 1):
            if tokens[head : head + len(plain)] == plain:
                tail = tokens[head + len(plain) :]
                keep = limit - head - len(tail)
                if keep >= 1:
                    return tokens[:head] + plain[:keep] + tail
                break
        return tokens[:limit]

    # --- computing -----------------------------------------------------------

    def _next_batch(self) -> list[_Row]:
        batch = [self._rows.popleft()]
        longest = len(batch[0].tokens)
        while self._rows and len(batch) < EMBED_BATCH_ROWS:
            width = max(longest, len(self._rows[0].tokens))
            if width * (len(batch) + 1) > EMBED_BATCH_TOKENS:
                break
            batch.append(self._rows.popleft())
            longest = width
        return batch

    def _embed(self, rows: list[list[int]]) -> Any:
        """The pooled float32 vectors of ``rows`` (a numpy array, one row each):
        one forward pass, right-padded."""
        import mlx.core as mx
        import numpy as np

        lengths = [len(row) for row in rows]
        width = max(lengths)
        padded = mx.array([row + [self.pad_id] * (width - len(row)) for row in rows])
        hidden = self.decoder(padded).astype(mx.float32)
        n = mx.array(lengths)
        mask = (mx.arange(width)[None, :] < n[:, None])[..., None]
        pooling = self.config.pooling
        if pooling == "last-token":
            pooled = hidden[mx.arange(len(rows)), n - 1]
        elif pooling == "first-token":
            pooled = hidden[:, 0]
        elif pooling == "max":
            pooled = mx.where(mask, hidden, -mx.inf).max(axis=1)
        else:
            total = mx.where(mask, hidden, 0.0).sum(axis=1)
            count = n[:, None].astype(mx.float32)
            pooled = total / (count if pooling == "mean" else mx.sqrt(count))
        return np.array(pooled, dtype=np.float32)

    def _finish(self, vector: Any, dimensions: int) -> bytes:
        """One vector cut to ``dimensions`` and normalized (when the model
        normalizes), as little-endian float32 bytes."""
        import numpy as np

        values = np.asarray(vector[:dimensions], dtype="<f4")
        if not np.isfinite(values).all():
            raise ArithmeticError(f"model {self.name} gave a vector that is not finite")
        if self.config.normalize:
            norm = float(np.linalg.norm(values.astype(np.float64)))
            values = (values / np.float32(max(norm, 1e-12))).astype("<f4")
        out: bytes = values.tobytes()
        return out

"""Quantized KV caches (a model's ``kv_bits``): mlx-lm's ``QuantizedKVCache``,
for a lone request and for a batch.

Each token's keys and values are stored as ``kv_bits``-bit integers, in groups
of ``kv_group_size`` values along the head dimension with a scale and a bias
per group (in the model's dtype).

Only plain ``KVCache`` layers are quantized: sliding-window, SSM and chunked
layers keep their own caches (mlx-lm cannot quantize them).

**Dense prefill.** mlx-lm's attention over a quantized cache
(``quantized_scaled_dot_product_attention``) builds the whole score block
(heads by step tokens by context) in memory: for a prefill chunk that is more
than the 16-bit cache it saves. So a step of more than one token is handed the
stored K/V dequantized, and mlx-lm takes its fused attention (it picks the
quantized one by ``hasattr(cache, "bits")``, which is False for that step);
a one-token step (decode) reads the quantized triples. The choice is by
the step's length, so a one-token prefill chunk takes the quantized
attention too: the K/V a later layer stores may differ in its last bits
with the chunk a token was computed in, as a 16-bit cache's do. Our code
reads :attr:`QuantizedKV.kv_bits`, never ``.bits``.

**Batches.** mlx-lm has no batched quantized cache: :class:`BatchQuantizedKV`
is ours, mirroring its ``BatchKVCache`` on the (packed, scales, biases)
triples. ``BatchGenerator`` makes a 16-bit cache for a request inserted
without one, so every insert into a quantized batch carries its cache
(:func:`make_cache`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    _BaseCache,
    dynamic_roll,
    make_prompt_cache,
)

__all__ = ["BatchQuantizedKV", "QuantizedKV", "check_quantizable", "make_cache"]

Triple = tuple[mx.array, mx.array, mx.array]
"""A quantized tensor: packed uint32 values, scales, biases."""


def make_cache(model: Any, kv_bits: int | None, group_size: int = 64) -> list[Any]:
    """A fresh cache for one sequence of ``model``: mlx-lm's, with each plain
    ``KVCache`` layer quantized to ``kv_bits`` (None: mlx-lm's cache as it is)."""
    cache = make_prompt_cache(model)
    if kv_bits is None:
        return cache
    # Exactly KVCache: not its rotating, chunked or batch kin, which cannot be quantized.
    return [QuantizedKV(group_size, kv_bits) if type(c) is KVCache else c for c in cache]


def check_quantizable(model: Any, kv_bits: int, group_size: int) -> None:
    """Check that ``model`` runs with a quantized KV cache: two small forwards,
    a two-token step (dense prefill) then a one-token step (quantized
    attention), through a fresh :func:`make_cache`.

    Raises:
        ValueError: no layer has a plain KV cache, or the model's attention
            cannot read a quantized one (keys used as an array, attention
            sinks, a head dimension the group size does not divide); the
            message names the model type and the reason."""
    kind = getattr(model, "model_type", type(model).__name__)
    cache = make_cache(model, kv_bits, group_size)
    where = f"kv_bits={kv_bits}: {kind} cannot use a quantized KV cache"
    if not any(isinstance(layer, QuantizedKV) for layer in cache):
        layers = ", ".join(sorted({type(layer).__name__ for layer in cache})) or "none"
        raise ValueError(f"{where}: none of its layers has a plain KV cache ({layers})")
    try:
        model(mx.array([[0, 0]]), cache=cache)
        mx.eval(model(mx.array([[0]]), cache=cache))
    except Exception as exc:
        raise ValueError(f"{where}: {exc}") from exc


def _dequantized(parts: Triple, group_size: int, bits: int, dtype: Any) -> mx.array:
    return mx.dequantize(*parts, group_size=group_size, bits=bits).astype(dtype)


def _as_fetched(k: Triple, v: Triple, dense: bool, group_size: int, bits: int) -> tuple[Any, Any]:
    """Stored triples as the last step fetched them: dequantized (in the
    scales' dtype, the model's) after a multi-token step."""
    if not dense:
        return k, v
    dtype = k[1].dtype
    return _dequantized(k, group_size, bits, dtype), _dequantized(v, group_size, bits, dtype)


def _check_head_dim(keys: mx.array, values: mx.array, group_size: int) -> None:
    for name, x in (("keys", keys), ("values", values)):
        if x.shape[-1] % group_size:
            raise ValueError(f"the head dimension of its {name} ({x.shape[-1]}) is not a "
                             f"multiple of kv_group_size ({group_size})")  # fmt: skip


class QuantizedKV(QuantizedKVCache):
    """One sequence's quantized KV cache layer: mlx-lm's ``QuantizedKVCache``
    with dense prefill, a size (the prefix cache checks it), and a batch
    form (:class:`BatchQuantizedKV`)."""

    _dense = False  # the last step had more than one token: ``bits`` is hidden

    @property
    def bits(self) -> int:
        if self._dense:  # mlx-lm asks hasattr(cache, "bits"): no, so its fused attention
            raise AttributeError("bits")
        return int(self._bits)

    @bits.setter
    def bits(self, value: int) -> None:
        self._bits = value

    @property
    def kv_bits(self) -> int:
        """The bits per stored value (readable whatever the last step was)."""
        return int(self._bits)

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.group_size, self._bits

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.group_size, self._bits = v

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        if self.keys is None:
            _check_head_dim(keys, values, self.group_size)
        self._dense = False
        k, v = super().update_and_fetch(keys, values)  # type: ignore[no-untyped-call]
        if keys.shape[2] == 1:
            return k, v
        self._dense = True
        return (_dequantized(k, self.group_size, self._bits, keys.dtype),
                _dequantized(v, self.group_size, self._bits, values.dtype))  # fmt: skip

    def keys_and_values(self) -> tuple[Any, Any]:
        """The stored K/V as a layer that shares this cache reads them
        (gemma3n's KV-shared layers): dequantized after a multi-token step,
        as :meth:`update_and_fetch` gave them, so that they too take the
        fused attention."""
        k, v = super().keys_and_values()  # type: ignore[no-untyped-call]
        return _as_fetched(k, v, self._dense, self.group_size, self._bits)

    def size(self) -> int:
        return int(self.offset)

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else int(super().nbytes)

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKV:
        return BatchQuantizedKV.merge(caches)


class BatchQuantizedKV(_BaseCache):
    """A batch's quantized KV cache layer, for mlx-lm's ``BatchGenerator``:
    its ``BatchKVCache`` (left-padded rows, ``offset`` per row) over quantized
    triples, with dense prefill as :class:`QuantizedKV` has it.

    Args:
        left_padding: each row's padding before its first token.
        group_size, bits: the quantization."""

    step = 256
    _dense = False

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8) -> None:
        self.keys: Triple | None = None
        self.values: Triple | None = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-pad for pad in left_padding])
        self._idx = 0
        self._right_padding: mx.array | None = None
        self.group_size = group_size
        self._bits = bits

    @property
    def bits(self) -> int:
        if self._dense:
            raise AttributeError("bits")
        return self._bits

    @property
    def kv_bits(self) -> int:
        return self._bits

    def _map(self, f: Callable[[mx.array], mx.array]) -> None:
        """Apply ``f`` to every part of the stored keys and values."""
        self.keys, self.values = tree_map(f, (self.keys, self.values))

    def _zeros(self, batch: int, heads: int, steps: int, dim: int, dtype: Any) -> Triple:
        packed = dim // (32 // self._bits)  # as mlx-lm's QuantizedKVCache packs them
        groups = dim // self.group_size
        return (mx.zeros((batch, heads, steps, packed), mx.uint32),
                mx.zeros((batch, heads, steps, groups), dtype),
                mx.zeros((batch, heads, steps, groups), dtype))  # fmt: skip

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        self._dense = False
        batch, heads, length, k_dim = keys.shape
        prev = self._idx
        if self.keys is None or self.values is None or prev + length > self.keys[0].shape[2]:
            _check_head_dim(keys, values, self.group_size)
            steps = (self.step + length - 1) // self.step * self.step
            new_k = self._zeros(batch, heads, steps, k_dim, keys.dtype)
            new_v = self._zeros(batch, heads, steps, values.shape[3], keys.dtype)
            if self.keys is None or self.values is None:
                self.keys, self.values = new_k, new_v
            else:
                if prev % self.step:
                    self._map(lambda x: x[..., :prev, :])
                self.keys = _concat(self.keys, new_k, axis=2)
                self.values = _concat(self.values, new_v, axis=2)
        self.offset = self.offset + length
        self._idx += length
        quantized_k = mx.quantize(keys, group_size=self.group_size, bits=self._bits)
        quantized_v = mx.quantize(values, group_size=self.group_size, bits=self._bits)
        for i in range(3):
            self.keys[i][..., prev : self._idx, :] = quantized_k[i]
            self.values[i][..., prev : self._idx, :] = quantized_v[i]
        k, v = tree_map(lambda x: x[..., : self._idx, :], (self.keys, self.values))
        if length == 1:
            return k, v
        self._dense = True
        return (_dequantized(k, self.group_size, self._bits, keys.dtype),
                _dequantized(v, self.group_size, self._bits, values.dtype))  # fmt: skip

    def keys_and_values(self) -> tuple[Any, Any]:
        """The stored K/V, as :meth:`QuantizedKV.keys_and_values` gives them."""
        assert self.keys is not None and self.values is not None
        k, v = tree_map(lambda x: x[..., : self._idx, :], (self.keys, self.values))
        return _as_fetched(k, v, self._dense, self.group_size, self._bits)

    def prepare(self, *, left_padding: list[int] | None = None, lengths: Any = None,
                right_padding: list[int] | None = None) -> None:  # fmt: skip
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty BatchQuantizedKV")
            pad = mx.array(left_padding)
            self.left_padding += pad
            self.offset = self.offset - pad
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        if self._right_padding is not None:
            pad = self._right_padding
            self._map(lambda x: dynamic_roll(x, pad[:, None], axis=2))  # type: ignore[no-untyped-call]
            self.offset = self.offset - pad
            self.left_padding += pad
            self._right_padding = None

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.left_padding

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.left_padding = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def filter(self, batch_indices: Any) -> None:
        """Keep the rows ``batch_indices``, in place."""
        if self.keys is not None:
            self._map(lambda x: x[batch_indices])
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = cast(int, self.left_padding.min().item())  # padding every row has: drop it
        if shift > 0:
            if self.keys is not None:
                self._map(lambda x: x[..., shift:, :])
            self._idx -= shift
            self.left_padding -= shift

    def extend(self, other: BatchQuantizedKV) -> None:
        """Append ``other``'s rows, in place (both right-aligned at the longer one)."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        reference = self if self.keys is not None else other
        assert reference.keys is not None and reference.values is not None
        ref_keys, ref_values = reference.keys, reference.values
        max_idx = max(self._idx, other._idx)
        max_size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def padded(c: BatchQuantizedKV) -> tuple[Triple, Triple]:
            if c.keys is None or c.values is None:
                rows = c.offset.shape[0]
                k, v = tree_map(lambda x: mx.zeros((rows, x.shape[1], 0, x.shape[3]), x.dtype),
                                (ref_keys, ref_values))  # fmt: skip
            else:
                k, v = c.keys, c.values
            left = max_idx - c._idx
            right = max_size - k[0].shape[2] - left
            if right < 0:
                k, v = tree_map(lambda x: x[..., :right, :], (k, v))
                right = 0
            if left or right:
                widths = [(0, 0), (0, 0), (left, right), (0, 0)]
                k, v = tree_map(lambda x: mx.pad(x, widths), (k, v))
            return k, v

        (k1, v1), (k2, v2) = padded(self), padded(other)
        lefts = [self.left_padding + max_idx - self._idx, other.left_padding + max_idx - other._idx]
        self.keys, self.values = _concat(k1, k2, axis=0), _concat(v1, v2, axis=0)
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate(lefts)
        self._idx = max_idx

    def extract(self, idx: int) -> QuantizedKV:
        """Row ``idx`` as a lone sequence's cache, in its own buffers."""
        assert self.keys is not None and self.values is not None
        cache = QuantizedKV(self.group_size, self._bits)
        pad = cast(int, self.left_padding[idx].item())
        keys, values = tree_map(
            lambda x: mx.contiguous(x[idx : idx + 1, :, pad : self._idx]), (self.keys, self.values)
        )
        cache.keys, cache.values, cache.offset = keys, values, keys[0].shape[2]
        return cache

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKV:
        """Lone sequences' caches (:class:`QuantizedKV`, alike) as one batch, left-padded.

        Raises:
            TypeError: a cache is not a QuantizedKV of the first one's bits
                and group size (a request inserted without its cache)."""
        group_size, bits = caches[0].group_size, caches[0].kv_bits
        for c in caches:
            if not isinstance(c, QuantizedKV) or (c.group_size, c.kv_bits) != (group_size, bits):
                raise TypeError(f"a {type(c).__name__} cannot join a batch of {bits}-bit "
                                f"quantized caches (group size {group_size})")  # fmt: skip
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches), group_size, bits)
        filled = [c for c in caches if c.keys is not None and c.size()]
        ref_keys, ref_values = filled[0].keys, filled[0].values
        rows = len(caches)
        keys, values = tree_map(lambda x: mx.zeros((rows, x.shape[1], longest, x.shape[3]),
                                                   x.dtype), (ref_keys, ref_values))  # fmt: skip
        pads = [longest - n for n in lengths]
        for i, (pad, c) in enumerate(zip(pads, caches, strict=True)):
            if c.keys is None or not c.size():
                continue
            for j in range(3):
                keys[j][i : i + 1, :, pad : pad + c.offset] = c.keys[j][..., : c.offset, :]
                values[j][i : i + 1, :, pad : pad + c.offset] = c.values[j][..., : c.offset, :]
        out = cls(pads, group_size, bits)
        out.keys, out.values = keys, values
        out.offset += longest
        out._idx = longest
        return out

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return sum(int(x.nbytes) for x in (*self.keys, *self.values))


def _concat(a: Triple, b: Triple, axis: int) -> Triple:
    first, second, third = (mx.concatenate([x, y], axis=axis) for x, y in zip(a, b, strict=True))
    return first, second, third

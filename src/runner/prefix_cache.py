"""The runner's KV prefix cache: the mlx glue around :class:`PrefixIndex`.

After a request the KV cache of its whole sequence (prompt + output) is
stored, keyed by those tokens. A later prompt that shares a prefix with a
stored sequence takes that prefix's KV from it and computes only the rest:
a chat client resends the system prompt and the whole history every turn.

Stored caches are never written to. A hit hands out a *view*: new cache
objects over the same arrays that end at the shared prefix. mlx-lm's caches
write in place only into room they allocated themselves, and a view has no
room left, so the first token written to it copies into a new buffer (the
one copy a request makes; merging into a batch is that copy on the batched
path). Caches that cannot be cut back (SSM and linear-attention layers:
``ArraysCache`` and friends) are reused only when their whole key is a prefix
of the prompt, and then copied, since they are updated in place.

The index (tokens, recency, bytes) is pure Python in
:mod:`runner.prefix_index`; this module only measures and copies caches.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import structlog
from mlx_lm.models.cache import KVCache, QuantizedKVCache, can_trim_prompt_cache

from ipc.messages import PrefixCacheStats
from runner.prefix_index import PrefixIndex

__all__ = ["PrefixCache", "cache_nbytes", "prefix_view"]

log = structlog.get_logger("runner.prefix_cache")

PromptCache = list[Any]
"""One model's cache: an object per layer (KVCache, RotatingKVCache, ...)."""


def cache_nbytes(cache: PromptCache) -> int:
    """The bytes the arrays of ``cache`` hold (their whole buffers)."""
    return sum(int(layer.nbytes) for layer in cache)


def _layer_view(layer: Any, length: int) -> Any:
    """A cache layer holding the first ``length`` tokens of ``layer``, sharing its
    arrays where the layer type allows it, else a copy cut to ``length``."""
    kind = type(layer)
    if kind is KVCache and layer.keys is not None:
        view: Any = KVCache()  # type: ignore[no-untyped-call]
        view.keys = layer.keys[..., :length, :]
        view.values = layer.values[..., :length, :]
        view.offset = length
        return view
    if issubclass(kind, QuantizedKVCache) and layer.keys is not None:
        # Its bits from its state: runner.kv_quant.QuantizedKV hides .bits after a prefill step.
        view = kind(group_size=layer.group_size, bits=layer.state[4])
        view.keys = tuple(part[..., :length, :] for part in layer.keys)
        view.values = tuple(part[..., :length, :] for part in layer.values)
        view.offset = length
        return view
    copied = copy.deepcopy(layer)
    extra = copied.size() - length if copied.is_trimmable() else 0
    if extra > 0:
        copied.trim(extra)
    return copied


def prefix_view(cache: PromptCache, length: int) -> PromptCache:
    """``cache`` as it was after its first ``length`` tokens, without writing to it."""
    return [_layer_view(layer, length) for layer in cache]


class PrefixCache:
    """Stored KV caches of finished requests, found by longest shared prefix.

    Args:
        budget_bytes: the most the stored caches may hold together.
        max_entries: the most sequences stored.
    """

    def __init__(self, budget_bytes: int, max_entries: int) -> None:
        self.index: PrefixIndex[PromptCache] = PrefixIndex(budget_bytes, max_entries)
        self._evictions_released = 0

    def fetch(self, tokens: Sequence[int]) -> tuple[PromptCache | None, int]:
        """The cache to start ``tokens`` from and how many of them it holds.

        Always leaves at least one token to compute. A miss is ``(None, 0)``.
        """
        match = self.index.lookup(tokens)
        if match is None:
            return None, 0
        return prefix_view(match.value, match.reuse), match.reuse

    def store(self, tokens: Sequence[int], cache: PromptCache) -> bool:
        """Keep ``cache``, which holds exactly ``tokens``; False if it is
        larger than the whole budget (then it is not kept)."""
        trimmable = can_trim_prompt_cache(cache)
        if trimmable and cache and cache[0].size() != len(tokens):
            # A cache that does not hold what its key says would poison every later hit.
            log.error("prefix_cache_key_mismatch", tokens=len(tokens), cached=cache[0].size())
            return False
        # A cache taken out of a batch is a lazy slice of the batch's arrays:
        # evaluate it so that it holds its own buffer, not the whole batch's.
        mx.eval([layer.state for layer in cache])
        stored = self.index.insert(tokens, cache, cache_nbytes(cache), trimmable=trimmable)
        self._release_evicted()
        return stored

    def evict(self, nbytes: int | None = None) -> int:
        """Free at least ``nbytes`` (all with None), least recently used
        first, and return MLX's freed buffers to the system. Returns bytes freed."""
        before = self.index.bytes
        if nbytes is None:
            self.index.clear()
        else:
            self.index.evict_bytes(nbytes)
        self._release_evicted()
        return before - self.index.bytes

    def clear(self) -> tuple[int, int]:
        """Drop every entry; returns the entries and bytes dropped."""
        entries, nbytes = len(self.index), self.index.bytes
        self.evict(None)
        return entries, nbytes

    def _release_evicted(self) -> None:
        """After evictions, hand MLX's freed buffers back to the system.

        (An entry superseded by a longer one is not an eviction: its memory
        is reused by the next request, so it stays in MLX's buffer cache.)
        """
        evictions = self.index.stats.evictions
        if evictions != self._evictions_released:
            self._evictions_released = evictions
            mx.clear_cache()

    def stats(self) -> PrefixCacheStats:
        s = self.index.stats
        return PrefixCacheStats(
            entries=s.entries,
            bytes=s.bytes,
            budget_bytes=s.budget_bytes,
            hits=s.hits,
            misses=s.misses,
            evictions=s.evictions,
            tokens_reused=s.tokens_reused,
        )

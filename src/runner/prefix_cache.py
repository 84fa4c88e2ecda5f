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

Under the RAM tier, a disk tier (:mod:`runner.disk_cache`) keeps what is
stored in files that outlive the process: on a RAM miss, or a RAM hit shorter
than what the disk holds, the disk's blocks are read, verified and promoted
into the RAM tier; a RAM hit counts as a use of the disk's blocks too.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import structlog
from mlx_lm.models.cache import KVCache, QuantizedKVCache, can_trim_prompt_cache

from ipc.messages import DiskCacheStats, PrefixCacheStats
from runner.prefix_index import PrefixIndex

if TYPE_CHECKING:
    from runner.disk_cache import DiskTier

__all__ = ["KEY_SPACE_STRIDE", "PrefixCache", "cache_nbytes", "keyed", "prefix_view"]

log = structlog.get_logger("runner.prefix_cache")

PromptCache = list[Any]
"""One model's cache: an object per layer (KVCache, RotatingKVCache, ...)."""

KEY_SPACE_STRIDE = 1 << 40
"""Key space ``s`` keys token ``t`` as ``t + s * KEY_SPACE_STRIDE``: far above
any vocabulary and any negative id a key may hold, so no two spaces share a key."""


def keyed(tokens: Sequence[int], space: int) -> Sequence[int]:
    """``tokens`` as the cache keys them in key space ``space``: 0 for the
    model as loaded, 1.. for each of its LoRA adapters (see
    :mod:`runner.adapters`), whose KV must never serve another's request.
    Keys keep their length: a key still counts the tokens its KV holds."""
    if not space:
        return tokens
    offset = space * KEY_SPACE_STRIDE
    return [token + offset for token in tokens]


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
        disk: the disk tier under it, if any.
        disk_off: why there is none (shown in status), if so.
    """

    def __init__(
        self,
        budget_bytes: int,
        max_entries: int,
        disk: DiskTier | None = None,
        disk_off: str | None = None,
    ) -> None:
        self.index: PrefixIndex[PromptCache] = PrefixIndex(budget_bytes, max_entries)
        self.disk = disk
        self.disk_off = disk_off
        self._evictions_released = 0

    def fetch(self, tokens: Sequence[int], space: int = 0) -> tuple[PromptCache | None, int]:
        """The cache to start ``tokens`` from and how many of them it holds,
        in key space ``space`` (see :func:`keyed`; the disk tier keeps space 0 only).

        Always leaves at least one token to compute. A miss is ``(None, 0)``.
        """
        if space:
            match = self.index.lookup(keyed(tokens, space))
            return (None, 0) if match is None else (prefix_view(match.value, match.reuse),
                                                     match.reuse)  # fmt: skip
        restored = self._from_disk(tokens)
        if restored is not None:
            return restored
        match = self.index.lookup(tokens)
        if match is None:
            return None, 0
        if self.disk is not None:
            self.disk.touch_prefix(tokens[: match.reuse])
        return prefix_view(match.value, match.reuse), match.reuse

    def reuse(self, tokens: Sequence[int], space: int = 0) -> int:
        """How many of ``tokens`` :meth:`fetch` would give (no disk I/O, no counters)."""
        match = self.index.peek(keyed(tokens, space))
        reuse = 0 if match is None else match.reuse
        if self.disk is not None and len(tokens) > 1 and not space:
            reuse = max(reuse, min(self.disk.reuse(tokens), len(tokens) - 1))
        return reuse

    def _from_disk(self, tokens: Sequence[int]) -> tuple[PromptCache, int] | None:
        """Promote the disk's blocks for ``tokens`` into RAM when they hold more
        of it than RAM does. Returns a view to start from only when they could
        not be kept in RAM (then the RAM lookup would not find them)."""
        if self.disk is None:
            return None
        match = self.index.peek(tokens)
        restored = self.disk.restore(tokens, better_than=0 if match is None else match.reuse)
        if restored is None:
            return None
        kept, cache = restored
        if self._store_ram(kept, cache):
            return None
        reuse = 0
        limit = min(len(kept), len(tokens) - 1)
        while reuse < limit and kept[reuse] == tokens[reuse]:
            reuse += 1
        return prefix_view(cache, reuse), reuse

    def store(self, tokens: Sequence[int], cache: PromptCache, space: int = 0) -> bool:
        """Keep ``cache``, which holds exactly ``tokens``, in RAM and on disk
        (RAM only outside key space 0); False if it is larger than the whole
        RAM budget (then RAM does not keep it)."""
        stored = self._store_ram(keyed(tokens, space), cache)
        if self.disk is not None and not space and cache and cache[0].size() == len(tokens):
            try:
                self.disk.save(tokens, cache)
            except Exception:  # the disk is a cache: a failure costs a recompute, no more
                log.exception("prefix_cache_disk_save_failed")
        return stored

    def _store_ram(self, tokens: Sequence[int], cache: PromptCache) -> bool:
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

    def clear(self, *, ram: bool = True, disk: bool = True) -> tuple[int, int, int, int]:
        """Drop the entries of the tiers named; returns the entries and bytes
        dropped in RAM, then the blocks and bytes dropped on disk."""
        entries, nbytes = (len(self.index), self.index.bytes) if ram else (0, 0)
        if ram:
            self.evict(None)
        blocks, disk_bytes = self.disk.clear() if disk and self.disk is not None else (0, 0)
        return entries, nbytes, blocks, disk_bytes

    def close(self, timeout_s: float) -> None:
        """Let the disk tier write what is queued, for at most ``timeout_s``."""
        if self.disk is not None:
            self.disk.close(timeout_s)

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
            disk=self.disk.stats() if self.disk is not None
            else DiskCacheStats(reason=self.disk_off) if self.disk_off is not None else None,
        )  # fmt: skip

"""The prefix cache's disk tier: KV blocks in files, so that a chat comes
back warm after its runner's process ends (an unload, an expiry, an
eviction, a crash, a restart after a guard).

What the RAM tier stores goes to disk too, written behind by a thread, in
blocks (:mod:`runner.disk_index`): the main thread only copies the new
tokens' KV out of the cache it stores and queues them. On a RAM miss (or a
RAM hit shorter than what the disk holds) the longest chain of blocks for
the prompt is read, every block verified, put together into one cache and
promoted into the RAM tier.

**What makes a block valid** is in its key or checked on read:

- the model: :func:`model_identity` digests the weight files' headers and
  sizes, the config, the tokenizer's files and chat template, the KV cache's
  quantization and its layout (each layer's cache class, K/V shapes and
  dtypes, measured by one forward step at load). The blocks of one identity
  live in their own directory, and each file names its identity again;
- the token ids of the whole prefix (the block's key chains its parent's);
- its bytes: a SHA-256 in the index, checked before the file is parsed,
  then its tokens, key and array shapes against the index and the layout.

A block that fails any check is dropped with the blocks after it, counted
by reason (``rejected_by``), and its tokens are computed again.

**Only caches that can be cut at any token are stored**: mlx-lm's ``KVCache``
and our quantized one. Sliding windows (``RotatingKVCache``) and recurrent
state (``ArraysCache``) are not: the tier is off for such a model, and
status says why.

**Durability.** A block's file is written under a temporary name, synced,
renamed into place, and only then recorded in the index; a SIGKILL at any
moment leaves no half-written block that the index names. Orphan files
(killed between the rename and the record) are swept when a later runner
opens the directory.

**Limits.** The directory holds at most ``budget_bytes``: the least recently
used blocks (RAM hits count as uses) go first, with the blocks after them.
Writes stop, and are counted as skipped, while the disk has less than
``min_free_bytes`` free or the queue holds more than :data:`MAX_PENDING_BYTES`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import queue
import shutil
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import mlx.core as mx
import structlog
from mlx_lm.models.cache import KVCache

from ipc.messages import DiskCacheStats, EngineSettings
from modelfiles.cache import fsync_dir
from runner.disk_index import Block, BlockStore, BlockTree, plan_blocks
from runner.kv_quant import QuantizedKV

__all__ = ["DiskTier", "Layout", "model_identity", "open_disk_tier", "probe_layout"]

log = structlog.get_logger("runner.disk_cache")

FORMAT = "2"
"""The block files' format; part of every identity."""

MAX_PENDING_BYTES = 512 << 20
"""Blocks queued for writing beyond this many bytes are skipped, not queued."""

ORPHAN_AGE_S = 60.0
"""Files the index does not name, older than this, are leftovers of a killed writer."""

STALE_IDENTITY_S = 30 * 86_400.0
"""Another identity's directory no runner has used for this long is removed."""

PromptCache = list[Any]

LayerLayout = dict[str, tuple[list[int], str]]
"""A layer's stored arrays by name: (shape with the token axis as -1, dtype)."""

Layout = list[LayerLayout]


def _layer_arrays(layer: Any, start: int, end: int) -> dict[str, mx.array]:
    """The arrays of ``layer`` for tokens ``start:end``, by name (token axis -2)."""
    stored: Any = layer
    if type(layer) is KVCache:
        return {"k": stored.keys[..., start:end, :], "v": stored.values[..., start:end, :]}
    if isinstance(layer, QuantizedKV):
        arrays: dict[str, mx.array] = {}
        for side, parts in (("k", stored.keys), ("v", stored.values)):
            for index, part in enumerate(parts):
                arrays[f"{side}{index}"] = part[..., start:end, :]
        return arrays
    raise TypeError(f"{type(layer).__name__} cannot be stored in blocks")


def _storable(layer: Any) -> bool:
    return type(layer) is KVCache or isinstance(layer, QuantizedKV)


def probe_layout(model: Any, new_cache: Callable[[], PromptCache]) -> Layout | str:
    """Each layer's stored arrays after one forward step of ``model``; or,
    when its cache cannot be cut at any token, why (a sentence)."""
    cache = new_cache()
    kinds = sorted({type(layer).__name__ for layer in cache if not _storable(layer)})
    if kinds:
        return (f"its cache has layers ({', '.join(kinds)}) that cannot be cut at any token "
                "(sliding windows, recurrent state): they are not stored")  # fmt: skip
    mx.eval(model(mx.array([[0]]), cache=cache))
    layout: Layout = []
    for index, layer in enumerate(cache):
        if layer.keys is None:
            return f"layer {index} holds no KV of its own (it shares another's): not stored"
        arrays = _layer_arrays(layer, 0, 1)
        layout.append({name: ([-1 if axis == a.ndim - 2 else size
                               for axis, size in enumerate(a.shape)], str(a.dtype))
                       for name, a in arrays.items()})  # fmt: skip
    return layout


_TOKENIZER_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)


def _file_digest(path: Path, limit: int | None = None) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        digest.update(file.read() if limit is None else file.read(limit))
    return digest.hexdigest()


def _weights_digest(path: Path) -> list[Any]:
    """A weight file's size, its header's digest (a safetensors file's names,
    dtypes, shapes and offsets; the first MiB of another) and what names its
    contents: the blob a Hugging Face snapshot links it to (the blob's name
    is its hash), else its modification time (weights rewritten in place with
    the same shapes are another model)."""
    if path.suffix != ".safetensors":
        header = _file_digest(path, 1 << 20)
    else:
        with path.open("rb") as file:
            header_size = int.from_bytes(file.read(8), "little")
            header = hashlib.sha256(file.read(min(header_size, 100 << 20))).hexdigest()
    version = path.resolve().name if path.is_symlink() else path.stat().st_mtime_ns
    return [path.stat().st_size, header, version]


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"


def model_identity(
    path: Path, tokenizer: Any, layout: Layout, kv_bits: int | None, group_size: int
) -> tuple[str, dict[str, Any]]:
    """The digest of everything a block's KV depends on besides its tokens,
    and what it was made of (written beside the blocks for a person)."""
    files = sorted(p for p in path.iterdir() if p.is_file())
    weights = {p.name: _weights_digest(p)
               for p in files if p.suffix in (".safetensors", ".gguf", ".npz")}  # fmt: skip
    tokenizer_files = {p.name: _file_digest(p) for p in files if p.name in _TOKENIZER_FILES}
    template = getattr(tokenizer, "chat_template", None)
    described: dict[str, Any] = {
        "format": FORMAT,
        "mlx": str(getattr(mx, "__version__", "unknown")),
        "mlx_lm": _version("mlx-lm"),
        "model": str(path),
        "weights": weights,
        "tokenizer": tokenizer_files,
        "chat_template": hashlib.sha256(str(template).encode()).hexdigest(),
        "kv_bits": kv_bits,
        "kv_group_size": group_size if kv_bits is not None else None,
        "layout": layout,
    }
    without_path = {k: v for k, v in described.items() if k != "model"}
    digest = hashlib.sha256(json.dumps(without_path, sort_keys=True).encode()).hexdigest()
    return digest[:32], described


@dataclass
class _Write:
    """A block queued for the writer: its arrays, already copied out."""

    block: Block
    arrays: dict[str, mx.array]
    nbytes: int


_TOUCH = "touch"
"""Queued for the writer: record the uses (RAM hits, restores) in the index."""


class DiskTier:
    """One model's KV blocks on disk.

    Args:
        root: the directory of every model's blocks; this model's go in
            ``root/<identity>``.
        budget_bytes: the most its blocks may take.
        identity: :func:`model_identity`'s digest and description.
        layout: :func:`probe_layout`'s layout.
        new_cache: a fresh cache for one sequence (the classes restored blocks go into).
        min_free_bytes: writes stop while the disk has less free (None:
            the larger of 1 GiB and 5% of the disk).
        fault: test tooling, called as ``fault(stage)`` at each stage of a
            block's write (``tmp_written``, ``renamed``, ``recorded``).

    Nothing it does on the main thread raises: a failure of the disk costs
    a recompute (logged and counted), never a request or the runner.

    Raises:
        OSError, sqlite3.Error: the directory or its index cannot be opened.
    """

    def __init__(
        self,
        root: Path,
        budget_bytes: int,
        identity: tuple[str, dict[str, Any]],
        layout: Layout,
        new_cache: Callable[[], PromptCache],
        *,
        min_free_bytes: int | None = None,
        fault: Callable[[str], None] | None = None,
    ) -> None:
        self.identity, described = identity
        self.directory = root / self.identity
        self.blocks_dir = self.directory / "blocks"
        self.blocks_dir.mkdir(parents=True, exist_ok=True)
        described_path = self.directory / "identity.json"
        if not described_path.exists():
            scratch = self.directory / f".identity.{os.getpid()}.tmp"
            scratch.write_text(json.dumps(described, indent=1, sort_keys=True))
            os.replace(scratch, described_path)
        self.budget_bytes = budget_bytes
        self.layout = layout
        self.new_cache = new_cache
        if min_free_bytes is None:
            min_free_bytes = max(1 << 30, shutil.disk_usage(self.directory).total // 20)
        self.min_free_bytes = min_free_bytes
        self.fault = fault
        self.tree = BlockTree()
        self.broken: str | None = None  # why the writer stopped, if it did
        self._lock = threading.Lock()  # the tree, the counters, the uses
        self._io = threading.Lock()  # one block write, eviction or clear at a time
        self._reader = BlockStore(self.directory / "index.sqlite")  # the main thread's
        self._seen = 0  # the last row this runner has read
        self._generation = -1  # the index's deletions, as last seen
        self._used: dict[str, float] = {}  # uses not yet recorded in the index
        self._reading: set[str] = set()  # blocks a restore reads now: not evicted
        self._queue: queue.SimpleQueue[_Write | str | None] = queue.SimpleQueue()
        self._pending = 0
        self._pending_bytes = 0
        self._idle = threading.Condition(self._lock)
        self._entries = self._bytes = 0
        self._hits = self._tokens_restored = self._written = 0
        self._write_errors = self._skipped = self._evictions = 0
        self._save_s = self._writer_cpu_s = 0.0
        self._rejected: Counter[str] = Counter()
        self._refresh()
        with contextlib.suppress(OSError):
            (self.directory / "opened").touch()  # in use: another runner's sweep keeps it
        try:
            self._sweep(self._reader)
        except Exception as exc:
            log.warning("prefix_cache_disk_sweep_failed", error=f"{type(exc).__name__}: {exc}")
        self._thread = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._thread.start()

    # --- the main thread ---------------------------------------------------

    def reuse(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the blocks on disk hold (no disk I/O)."""
        with self._lock:
            _, matched = self.tree.match(tokens, written_only=True)
        return matched

    def restore(
        self, tokens: Sequence[int], better_than: int
    ) -> tuple[list[int], PromptCache] | None:
        """Read the blocks that hold the most of ``tokens``, if that is more
        than ``better_than`` of the tokens a caller must compute (it always
        computes the last one): their tokens and their cache, verified.
        None when the disk holds no more than that, or its blocks fail."""
        try:
            return self._restore(tokens, better_than)
        except Exception:
            log.exception("prefix_cache_disk_restore_failed")
            return None
        finally:
            with self._lock:
                self._reading.clear()

    def _restore(
        self, tokens: Sequence[int], better_than: int
    ) -> tuple[list[int], PromptCache] | None:
        self._refresh()
        with self._lock:
            chain, matched = self.tree.match(tokens, written_only=True)
            self._reading.update(block.key for block in chain)
        if min(matched, len(tokens) - 1) <= better_than:
            return None
        self.touch(chain)  # first: the writer's eviction goes by recency
        parts: list[tuple[Block, dict[str, mx.array]]] = []
        for block in chain:
            arrays = self._read(block)
            if arrays is None:
                break
            parts.append((block, arrays))
        covered = min(parts[-1][0].end if parts else 0, matched, len(tokens) - 1)
        if covered <= better_than:
            return None
        cache = self._assemble([arrays for _, arrays in parts])
        restored = [token for block, _ in parts for token in block.tokens]
        with self._lock:
            self._hits += 1
            self._tokens_restored += covered
        log.info("prefix_cache_disk_restored", tokens=covered, blocks=len(parts))
        return restored, cache

    def touch_prefix(self, tokens: Sequence[int]) -> None:
        """Record a use of the blocks that hold ``tokens`` (a RAM hit: the two
        tiers agree on what is recent)."""
        with self._lock:
            chain, _ = self.tree.match(tokens, written_only=True)
        self.touch(chain)

    def touch(self, blocks: Sequence[Block]) -> None:
        """Record a use of ``blocks``; the writer puts it in the index."""
        if not blocks:
            return
        now = time.time()
        with self._lock:
            first = not self._used
            for block in blocks:
                block.last_used = now
                self._used[block.key] = now
        if first:  # one marker queued while uses wait, not one per use
            self._queue.put(_TOUCH)

    def save(self, tokens: Sequence[int], cache: PromptCache) -> int:
        """Queue the blocks ``tokens`` needs beyond those on disk (or queued),
        copied out of ``cache``, which holds exactly ``tokens``; return how
        many were queued."""
        if self.broken is not None:
            return 0
        started = time.perf_counter()
        try:
            return self._save(tokens, cache)
        finally:
            elapsed = time.perf_counter() - started
            with self._lock:
                self._save_s += elapsed

    def _save(self, tokens: Sequence[int], cache: PromptCache) -> int:
        with self._lock:
            planned = plan_blocks(self.tree, self.identity, tokens)
        queued: list[_Write] = []
        for block in planned:
            start, end = block.start, block.end
            arrays = {f"{index}.{name}": mx.contiguous(array)
                      for index, layer in enumerate(cache)
                      for name, array in _layer_arrays(layer, start, end).items()}  # fmt: skip
            nbytes = sum(int(a.nbytes) for a in arrays.values())
            if self._pending_bytes + sum(w.nbytes for w in queued) + nbytes > MAX_PENDING_BYTES:
                with self._lock:
                    self._skipped += len(planned) - len(queued)
                break
            queued.append(_Write(block, arrays, nbytes))
        if not queued:
            return 0
        mx.eval([write.arrays for write in queued])
        with self._lock:
            if self.broken is not None:  # the writer died meanwhile: nobody would take them
                return 0
            # Pending blocks: later saves build on them. One whose key came in from
            # another runner meanwhile is not written again.
            queued = [write for write in queued if self.tree.add(write.block)]
            self._pending += len(queued)
            self._pending_bytes += sum(write.nbytes for write in queued)
            for write in queued:
                self._queue.put(write)
        return len(queued)

    def flush(self, timeout_s: float) -> bool:
        """Wait until the queued blocks are written; False if ``timeout_s`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def clear(self) -> tuple[int, int]:
        """Drop every block of this model (queued ones too); return the
        blocks and bytes that were on disk. A failure is logged, not raised."""
        entries = nbytes = 0
        with self._io:
            while True:
                try:
                    write = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(write, _Write):
                    self._done(write, written=False)
                elif write is None:
                    self._queue.put(None)  # closing: the writer still has to see it
                    break
            try:
                entries, nbytes = self._reader.totals()
                keys = self._reader.clear()
            except sqlite3.Error as exc:
                log.warning("prefix_cache_disk_clear_failed", error=str(exc))
                keys = []
            with self._lock:
                self.tree = BlockTree()
                self._used.clear()
                self._entries = self._bytes = 0
            for key in keys:
                with contextlib.suppress(OSError):
                    self._path(key).unlink(missing_ok=True)
        log.info("prefix_cache_disk_cleared", blocks=entries, bytes=nbytes)
        return entries, nbytes

    def close(self, timeout_s: float = 2.0) -> None:
        """Write what is queued and the uses (for at most ``timeout_s`` in
        all), then stop the writer."""
        deadline = time.monotonic() + timeout_s
        self.flush(timeout_s)
        self._queue.put(None)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(sqlite3.Error):
            self._reader.close()

    def stats(self) -> DiskCacheStats:
        with self._lock:
            return DiskCacheStats(
                directory=str(self.directory),
                entries=self._entries,
                bytes=self._bytes,
                budget_bytes=self.budget_bytes,
                hits=self._hits,
                tokens_restored=self._tokens_restored,
                rejected=sum(self._rejected.values()),
                rejected_by=dict(self._rejected),
                written=self._written,
                write_errors=self._write_errors,
                skipped=self._skipped,
                evictions=self._evictions,
                pending=self._pending,
                save_s=round(self._save_s, 6),
                writer_cpu_s=round(self._writer_cpu_s, 6),
                reason=self.broken,
            )

    def _refresh(self) -> None:
        """Learn what other runners of this model did since the last look:
        the blocks they wrote, and (when the index's deletions moved) the whole
        index again. Errors leave the tree as it was."""
        try:
            generation = self._reader.generation()
            again = generation != self._generation
            rows = self._reader.rows(0 if again else self._seen)
            totals = self._reader.totals()
        except sqlite3.Error as exc:
            log.warning("prefix_cache_disk_index_unreadable", error=str(exc))
            return
        with self._lock:
            if again:  # rebuilt from the index, with this runner's queued blocks on it
                queued = sorted((b for b in self.tree.blocks.values() if not b.written),
                                key=lambda b: b.start)  # fmt: skip
                self.tree = BlockTree()
                self._generation = generation
            for seq, block in rows:
                self._seen = max(self._seen, seq)
                known = self.tree.blocks.get(block.key)
                if known is not None:  # queued here, and written by another runner
                    known.written = True
                    known.nbytes, known.checksum = block.nbytes, block.checksum
                else:
                    self.tree.add(block)
            if again:
                for block in queued:
                    block.children = {}  # its queued children are added again below it
                    self.tree.add(block)
            self._entries, self._bytes = totals

    def _read(self, block: Block) -> dict[str, mx.array] | None:
        """``block``'s arrays, every check passed; None (the block rejected,
        or gone: another runner evicted it) otherwise."""
        checked = self._check(block)
        if isinstance(checked, dict):
            return checked
        if checked == "missing" and self._gone(block):
            with self._lock:
                self.tree.remove(block.key)
            return None
        self._reject(block, checked)
        return None

    def _gone(self, block: Block) -> bool:
        """Whether the index no longer has ``block`` (evicted or cleared)."""
        try:
            return self._reader.get(block.key) is None
        except sqlite3.Error:
            return False

    def _check(self, block: Block) -> dict[str, mx.array] | str:
        """``block``'s arrays, or why they cannot be used."""
        try:
            data = self._path(block.key).read_bytes()
        except FileNotFoundError:
            return "missing"
        except OSError as exc:
            log.warning("prefix_cache_disk_read_failed", key=block.key, error=str(exc))
            return "unreadable"
        if len(data) != block.nbytes:
            return "truncated" if len(data) < block.nbytes else "size"
        if hashlib.sha256(data).hexdigest() != block.checksum:
            return "checksum"
        try:
            loaded: Any = mx.load(io.BytesIO(data), format="safetensors", return_metadata=True)
            arrays: dict[str, mx.array] = dict(loaded[0])
            meta: dict[str, str] = dict(loaded[1])
        except Exception:
            return "unreadable"
        if any(meta.get(name) != value for name, value in self._metadata(block).items()):
            return "key"
        tokens = arrays.pop("tokens", None)
        if tokens is None or tokens.tolist() != list(block.tokens):
            return "tokens"
        if not self._shapes_fit(arrays, len(block.tokens)):
            return "layout"
        return arrays

    def _metadata(self, block: Block) -> dict[str, str]:
        """What a block's file says of itself (checked on read)."""
        return {"format": FORMAT, "identity": self.identity, "key": block.key,
                "parent": block.parent or "", "start": str(block.start)}  # fmt: skip

    def _shapes_fit(self, arrays: dict[str, mx.array], length: int) -> bool:
        wanted = {f"{index}.{name}": (shape, dtype)
                  for index, layer in enumerate(self.layout)
                  for name, (shape, dtype) in layer.items()}  # fmt: skip
        if set(arrays) != set(wanted):
            return False
        for name, array in arrays.items():
            shape, dtype = wanted[name]
            if str(array.dtype) != dtype:
                return False
            if list(array.shape) != [length if size == -1 else size for size in shape]:
                return False
        return True

    def _reject(self, block: Block, reason: str) -> None:
        """Drop ``block`` and the blocks after it, from the tree, the index and the disk."""
        log.warning("prefix_cache_disk_rejected", key=block.key, reason=reason,
                    start=block.start, tokens=len(block.tokens))  # fmt: skip
        with self._lock:
            self._rejected[reason] += 1
            self.tree.remove(block.key)
        try:
            with self._io:
                for key in self._reader.delete_subtrees([block.key]):
                    with contextlib.suppress(OSError):
                        self._path(key).unlink(missing_ok=True)
                totals = self._reader.totals()
            with self._lock:
                self._entries, self._bytes = totals
        except sqlite3.Error as exc:
            log.warning("prefix_cache_disk_index_unwritable", error=str(exc))

    def _assemble(self, parts: list[dict[str, mx.array]]) -> PromptCache:
        """One cache holding the blocks' tokens in order."""
        cache = self.new_cache()
        for index, layer in enumerate(cache):
            joined = {name: mx.concatenate([part[f"{index}.{name}"] for part in parts], axis=-2)
                      if len(parts) > 1 else parts[0][f"{index}.{name}"]
                      for name in self.layout[index]}  # fmt: skip
            layer_: Any = layer
            if isinstance(layer, QuantizedKV):
                layer_.keys = (joined["k0"], joined["k1"], joined["k2"])
                layer_.values = (joined["v0"], joined["v1"], joined["v2"])
                layer.offset = joined["k0"].shape[-2]
            else:
                layer.keys, layer.values = joined["k"], joined["v"]
                layer.offset = joined["k"].shape[-2]
        mx.eval([layer.state for layer in cache])
        return cache

    def _path(self, key: str) -> Path:
        return self.blocks_dir / key[:2] / f"{key}.safetensors"

    # --- the writer thread -------------------------------------------------

    def _write_loop(self) -> None:
        try:
            store = BlockStore(self.directory / "index.sqlite")
        except Exception as exc:
            self._stop_writing(f"its index cannot be opened: {exc}")
            return
        held: _Write | None = None  # taken from the queue, not yet done
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    break
                cpu = time.thread_time()
                if item == _TOUCH:
                    self._record_uses(store)
                else:
                    assert isinstance(item, _Write)
                    held = item
                    with self._io:
                        written = self._write_guarded(store, item)
                    if written:
                        self._after_write(store)
                    held = None
                    self._done(item, written)
                with self._lock:
                    self._writer_cpu_s += time.thread_time() - cpu
            self._record_uses(store)
        except Exception as exc:  # a bug here must not leave saves queued forever
            log.exception("prefix_cache_disk_writer_failed")
            if held is not None:
                self._done(held, written=False)
            self._stop_writing(f"its writer failed: {type(exc).__name__}: {exc}")
        finally:
            with contextlib.suppress(sqlite3.Error):
                store.close()

    def _stop_writing(self, why: str) -> None:
        """The writer is gone: no more saves; the queued ones are dropped."""
        with self._lock:  # a save checks it under the lock before it queues
            self.broken = why
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Write):
                self._done(item, written=False)

    def _write_guarded(self, store: BlockStore, write: _Write) -> bool:
        try:
            return self._write(store, write)
        except Exception as exc:
            log.warning("prefix_cache_disk_write_failed", key=write.block.key,
                        error=f"{type(exc).__name__}: {exc}")  # fmt: skip
            with self._lock:
                self._write_errors += 1
            return False

    def _write(self, store: BlockStore, write: _Write) -> bool:
        """Write one block's file and record it; False if it was not written.

        A block file is published with a hard link, which never replaces a
        file already there: a file under a block's name is only ever the
        first one written, whole, and its row's checksum is of its bytes."""
        block = write.block
        final = self._path(block.key)
        with self._lock:
            if self.tree.blocks.get(block.key) is not block:
                return False  # cleared, evicted or rejected (its parent) while it waited
            if block.written:
                return True  # another runner wrote it meanwhile
        if shutil.disk_usage(self.directory).free - write.nbytes < self.min_free_bytes:
            with self._lock:
                self._skipped += 1
            return False
        final.parent.mkdir(parents=True, exist_ok=True)
        scratch = final.with_name(f".{block.key}.{os.getpid()}.tmp.safetensors")
        arrays = dict(write.arrays, tokens=mx.array(block.tokens, dtype=mx.int32))
        try:
            mx.save_safetensors(str(scratch), arrays, metadata=self._metadata(block))
            with scratch.open("rb+") as file:
                data = file.read()
                os.fsync(file.fileno())
            self._fault("tmp_written")
            published = _publish(scratch, final)
        finally:
            scratch.unlink(missing_ok=True)
        fsync_dir(final.parent)
        self._fault("renamed")
        if not published:  # the first writer's file stays: its row is of those bytes
            data = final.read_bytes()
        nbytes, checksum = len(data), hashlib.sha256(data).hexdigest()
        with self._lock:
            block.nbytes, block.checksum, block.last_used = nbytes, checksum, time.time()
        if not store.insert(block):  # its parent was evicted meanwhile: useless now
            if published:
                final.unlink(missing_ok=True)
            return False
        self._fault("recorded")
        with self._lock:
            block.written = True
            self._written += 1
        return True

    def _after_write(self, store: BlockStore) -> None:
        """Uses recorded, the budget kept, the totals read: after a block is
        on disk (a failure here leaves the block as it is)."""
        try:
            self._record_uses(store)
            with self._io:
                self._evict(store)
                totals = store.totals()
            with self._lock:
                self._entries, self._bytes = totals
        except Exception as exc:
            log.warning("prefix_cache_disk_upkeep_failed", error=f"{type(exc).__name__}: {exc}")

    def _record_uses(self, store: BlockStore) -> None:
        with self._lock:
            used, self._used = self._used, {}
        try:
            store.touch(used)
        except sqlite3.Error as exc:
            log.warning("prefix_cache_disk_touch_failed", error=str(exc))

    def _done(self, write: _Write, written: bool) -> None:
        with self._lock:
            try:
                # A block that will never be on disk, nor will the ones after it.
                if not written and self.tree.blocks.get(write.block.key) is write.block:
                    self.tree.remove(write.block.key)
            finally:
                self._pending -= 1
                self._pending_bytes -= write.nbytes
                self._idle.notify_all()

    def _evict(self, store: BlockStore) -> None:
        """Drop the least recently used blocks that no block follows (the
        prefixes chats share go last) until the directory is within its
        budget. Blocks a restore is reading are left alone."""
        _, total = store.totals()
        while total > self.budget_bytes:
            with self._lock:
                reading = set(self._reading)
            victims = [
                (key, size) for key, size in store.least_recent_leaves() if key not in reading
            ]
            if not victims:
                break
            for key, size in victims:
                if total <= self.budget_bytes:
                    break
                for gone in store.delete_subtrees([key]):
                    with self._lock:
                        self.tree.remove(gone)
                        self._evictions += 1
                    with contextlib.suppress(OSError):
                        self._path(gone).unlink(missing_ok=True)
                total -= size

    def _sweep(self, store: BlockStore) -> None:
        """Remove files no index row names, left by a writer killed between
        its write and its record, and temporary files (old enough that no live
        writer owns them); and other identities' directories no runner has
        used for :data:`STALE_IDENTITY_S` (a model replaced, a kv_bits changed)."""
        known = store.keys()
        cutoff = time.time() - ORPHAN_AGE_S
        for path in self.blocks_dir.glob("*/*.safetensors"):
            orphan = path.name.startswith(".") or path.stem not in known
            with contextlib.suppress(OSError):
                if orphan and path.stat().st_mtime < cutoff:
                    path.unlink()
        stale = time.time() - STALE_IDENTITY_S
        for other in self.directory.parent.iterdir():
            if other == self.directory or not (other / "identity.json").is_file():
                continue
            with contextlib.suppress(OSError):
                marks = [*other.glob("index.sqlite*"), other / "identity.json", other / "opened"]
                used = max((p.stat().st_mtime for p in marks if p.exists()), default=0.0)
                if used < stale:
                    log.info("prefix_cache_disk_stale_identity_removed", directory=str(other))
                    shutil.rmtree(other, ignore_errors=True)

    def _fault(self, stage: str) -> None:
        if self.fault is not None:
            self.fault(stage)


def _publish(scratch: Path, final: Path) -> bool:
    """Put ``scratch`` in place as ``final`` unless a file is there already;
    whether it was put there."""
    try:
        os.link(scratch, final)
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: the rename is as good, but for a race
        if final.exists():
            return False
        os.replace(scratch, final)
    return True


def open_disk_tier(
    model: Any,
    tokenizer: Any,
    model_path: Path | None,
    settings: EngineSettings,
    new_cache: Callable[[], PromptCache],
    fault: Callable[[str], None] | None = None,
) -> DiskTier | str:
    """The disk tier ``settings`` ask for, or why there is none (a sentence
    for status). A directory that cannot be used turns the tier off; it
    never fails the load."""
    if settings.prefix_cache_disk_bytes <= 0 or not settings.prefix_cache_dir:
        return "off (prefix_cache_disk_bytes = 0)"
    if model_path is None or not model_path.is_dir():
        return "the model's files are unknown"
    try:
        layout = probe_layout(model, new_cache)
        if isinstance(layout, str):
            return layout
        identity = model_identity(model_path, tokenizer, layout, settings.kv_bits,
                                  settings.kv_group_size)  # fmt: skip
        return DiskTier(Path(settings.prefix_cache_dir), settings.prefix_cache_disk_bytes,
                        identity, layout, new_cache, fault=fault)  # fmt: skip
    except Exception as exc:
        log.warning("prefix_cache_disk_unusable", directory=settings.prefix_cache_dir,
                    error=f"{type(exc).__name__}: {exc}")  # fmt: skip
        return f"off: {type(exc).__name__}: {exc}"

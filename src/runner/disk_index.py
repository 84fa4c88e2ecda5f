"""The prefix cache's disk tier, its index: which KV blocks are on disk.

A *block* holds the KV of a run of tokens, ``tokens``, that follows its
parent block's (or starts the sequence, with no parent). Following parents
from a block back to the root spells the whole prefix its KV belongs to.
A block's key is a digest of the model's identity, its parent's key and its
own tokens, so it names the whole prefix: two runners that store the same
prefix, cut the same way, write the same file, and a block never says it
holds the KV of anything but exactly its prefix.

Blocks end at multiples of :data:`BLOCK_TOKENS` (or where the stored sequence
ends), so chats that share a long system prompt share its blocks, and a
chat's next turn writes only what it added.

Two structures, both pure Python:

- :class:`BlockTree`, in memory: the blocks by parent and first token, for
  the longest-prefix lookup a request makes (no disk I/O on that path).
- :class:`BlockStore`, a SQLite file in WAL mode: the blocks that are on disk,
  the one record that survives the process. A row is written only after its
  file is complete, synced and renamed into place, so a SIGKILL at any moment
  leaves either a whole block the index knows or an orphan file it does not
  (swept later); a half-written block is never read.

Each thread that uses a :class:`BlockStore` opens its own (sqlite3
connections are not shared between threads). The tree is not thread-safe:
its owner locks it.
"""

from __future__ import annotations

import contextlib
import hashlib
import sqlite3
import time
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BLOCK_TOKENS", "Block", "BlockStore", "BlockTree", "block_key", "plan_blocks"]

BLOCK_TOKENS = 256
"""Blocks end at multiples of this many tokens (and at a stored sequence's end)."""


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return array("i", tokens).tobytes()


def block_key(identity: str, parent: str | None, tokens: Sequence[int]) -> str:
    """The key of the block holding ``tokens`` after ``parent``'s prefix, for
    the model ``identity``: a digest of all three."""
    digest = hashlib.sha256()
    for part in (identity.encode(), b"\0", (parent or "").encode(), b"\0"):
        digest.update(part)
    digest.update(_token_bytes(tokens))
    return digest.hexdigest()[:40]


@dataclass(eq=False)
class Block:
    """One block: the KV of ``tokens``, which come after position ``start``."""

    key: str
    parent: str | None
    start: int
    tokens: tuple[int, ...]
    nbytes: int = 0
    checksum: str = ""
    """The SHA-256 of its file's bytes, checked on every read."""
    last_used: float = 0.0
    written: bool = False
    """On disk and in the index (False: queued for writing)."""
    children: dict[int, list[Block]] = field(default_factory=dict, repr=False)
    """The blocks that follow this one, by their first token."""

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def _shared(span: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    """How many leading tokens of ``span`` equal ``tokens[start:]``'s."""
    overlap = min(len(span), len(tokens) - start)
    if tuple(tokens[start : start + overlap]) == span[:overlap]:
        return overlap
    shared = 0
    while shared < overlap and span[shared] == tokens[start + shared]:
        shared += 1
    return shared


class BlockTree:
    """The blocks known on disk (and those queued for writing), as a tree."""

    def __init__(self) -> None:
        self.blocks: dict[str, Block] = {}
        self._roots: dict[int, list[Block]] = {}

    def __len__(self) -> int:
        return len(self.blocks)

    def _siblings(self, parent: str | None) -> dict[int, list[Block]] | None:
        if parent is None:
            return self._roots
        holder = self.blocks.get(parent)
        return None if holder is None else holder.children

    def add(self, block: Block) -> bool:
        """Add ``block`` under its parent; False (nothing added) if its key is
        known or its parent is not."""
        siblings = self._siblings(block.parent)
        if block.key in self.blocks or siblings is None or not block.tokens:
            return False
        self.blocks[block.key] = block
        siblings.setdefault(block.tokens[0], []).append(block)
        return True

    def remove(self, key: str) -> list[Block]:
        """Remove the block ``key`` and every block after it; return them
        (parents first). Unknown keys remove nothing."""
        block = self.blocks.get(key)
        if block is None:
            return []
        siblings = self._siblings(block.parent)
        if siblings is not None:
            same_start = siblings.get(block.tokens[0], [])
            if block in same_start:
                same_start.remove(block)
            if not same_start:
                siblings.pop(block.tokens[0], None)
        removed = list(self._subtree(block))
        for gone in removed:
            self.blocks.pop(gone.key, None)
        return removed

    def _subtree(self, block: Block) -> Iterator[Block]:
        stack = [block]
        while stack:
            current = stack.pop()
            yield current
            for group in current.children.values():
                stack.extend(group)

    def match(self, tokens: Sequence[int], *, written_only: bool) -> tuple[list[Block], int]:
        """The chain of blocks from the root that ``tokens`` follows, and how
        many of its tokens the chain holds.

        Every block of the chain but the last is matched whole; the last may
        be matched in part (the tokens leave it, or end, inside it).
        ``written_only``: blocks still queued for writing are not followed.
        """
        chain: list[Block] = []
        position, siblings = 0, self._roots
        while position < len(tokens):
            best, best_shared = None, 0
            for block in siblings.get(tokens[position], ()):
                if written_only and not block.written:
                    continue
                shared = _shared(block.tokens, tokens, position)
                if shared > best_shared:
                    best, best_shared = block, shared
            if best is None:
                break
            chain.append(best)
            position += best_shared
            if best_shared < len(best.tokens):
                break
            siblings = best.children
        return chain, position


def plan_blocks(
    tree: BlockTree, identity: str, tokens: Sequence[int], *, block_tokens: int = BLOCK_TOKENS
) -> list[Block]:
    """The new blocks that store ``tokens`` after the longest chain of whole
    blocks ``tree`` has for them (written or queued): cut at multiples of
    ``block_tokens`` and at the end. They are not added to ``tree``."""
    chain, matched = tree.match(tokens, written_only=False)
    if chain and matched < chain[-1].end:
        chain.pop()  # a block matched only in part cannot be a parent
    parent = chain[-1].key if chain else None
    start = chain[-1].end if chain else 0
    planned: list[Block] = []
    while start < len(tokens):
        end = min(len(tokens), (start // block_tokens + 1) * block_tokens)
        span = tuple(tokens[start:end])
        key = block_key(identity, parent, span)
        planned.append(Block(key, parent, start, span))
        parent, start = key, end
    return planned


_SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL UNIQUE,
    parent TEXT,
    start INTEGER NOT NULL,
    tokens BLOB NOT NULL,
    nbytes INTEGER NOT NULL,
    checksum TEXT NOT NULL,
    last_used REAL NOT NULL,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS blocks_parent ON blocks(parent);
CREATE INDEX IF NOT EXISTS blocks_last_used ON blocks(last_used);
CREATE TABLE IF NOT EXISTS generation (id INTEGER PRIMARY KEY CHECK (id = 0), value INTEGER);
INSERT OR IGNORE INTO generation VALUES (0, 0);
"""

_COLUMNS = "seq, key, parent, start, tokens, nbytes, checksum, last_used"


def _block(row: tuple[Any, ...]) -> tuple[int, Block]:
    seq, key, parent, start, blob, nbytes, checksum, last_used = row
    tokens = array("i")
    tokens.frombytes(blob)
    return seq, Block(key, parent, start, tuple(tokens), nbytes, checksum, last_used, True)


class BlockStore:
    """The blocks on disk, in a SQLite file (WAL mode) beside them.

    Rows are numbered in the order they were recorded (``seq``, never
    reused), so a reader learns new rows by asking for those after the last
    it saw; deletions bump :meth:`generation`, so a reader that sees it move
    reads every row again (another runner of the model evicted or cleared).

    Args:
        path: the database file.
        timeout_s: how long a write waits for another process's (two
            runners of the same model share the file).
    """

    def __init__(self, path: Path, timeout_s: float = 10.0) -> None:
        self.path = path
        self._db = sqlite3.connect(path, timeout=timeout_s, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # In WAL mode, NORMAL loses no committed row to a process kill (only to a power cut).
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    def generation(self) -> int:
        """Bumped by every deletion."""
        (value,) = self._db.execute("SELECT value FROM generation").fetchone()
        return int(value)

    def rows(self, after: int = 0) -> list[tuple[int, Block]]:
        """Every block recorded after row ``after`` (0: all), in the order
        they were recorded (a parent before its children)."""
        query = f"SELECT {_COLUMNS} FROM blocks WHERE seq > ? ORDER BY seq"
        return [_block(row) for row in self._db.execute(query, (after,))]

    def get(self, key: str) -> Block | None:
        row = self._db.execute(f"SELECT {_COLUMNS} FROM blocks WHERE key = ?", (key,)).fetchone()
        return None if row is None else _block(row)[1]

    def insert(self, block: Block) -> bool:
        """Record a block whose file is in place (a known key is kept as it
        is); False when its parent is no longer recorded (then nothing is)."""
        now = time.time()
        with self._transaction():
            self._db.execute(
                "INSERT OR IGNORE INTO blocks (key, parent, start, tokens, nbytes, checksum, "
                "last_used, created) SELECT ?, ?, ?, ?, ?, ?, ?, ? "
                "WHERE ? IS NULL OR EXISTS (SELECT 1 FROM blocks WHERE key = ?)",
                (block.key, block.parent, block.start, _token_bytes(block.tokens), block.nbytes,
                 block.checksum, block.last_used or now, now, block.parent, block.parent),
            )  # fmt: skip
            found = self._db.execute("SELECT 1 FROM blocks WHERE key = ?", (block.key,))
            return found.fetchone() is not None

    def touch(self, used: dict[str, float]) -> None:
        """Record when blocks were last used (never moving a time back)."""
        if used:
            self._db.executemany(
                "UPDATE blocks SET last_used = max(last_used, ?) WHERE key = ?",
                [(when, key) for key, when in used.items()],
            )

    def delete_subtrees(self, keys: Iterable[str]) -> list[str]:
        """Delete the blocks ``keys`` and every block after them; return the
        keys deleted (their files are the caller's to remove)."""
        deleted: list[str] = []
        with self._transaction():
            for key in keys:
                found = [row[0] for row in self._db.execute(
                    "WITH RECURSIVE below(k) AS (SELECT ? UNION ALL "
                    "SELECT blocks.key FROM blocks JOIN below ON blocks.parent = below.k) "
                    "SELECT k FROM below JOIN blocks ON blocks.key = below.k", (key,))]  # fmt: skip
                self._db.executemany("DELETE FROM blocks WHERE key = ?", [(k,) for k in found])
                deleted.extend(found)
            if deleted:
                self._db.execute("UPDATE generation SET value = value + 1")
        return deleted

    def least_recent_leaves(self, limit: int = 64) -> list[tuple[str, int]]:
        """The least recently used blocks that no block follows, as (key,
        nbytes): evicting them first keeps the prefixes chats share."""
        return list(self._db.execute(
            "SELECT key, nbytes FROM blocks AS b WHERE NOT EXISTS "
            "(SELECT 1 FROM blocks AS c WHERE c.parent = b.key) "
            "ORDER BY last_used ASC, start DESC LIMIT ?", (limit,)))  # fmt: skip

    def totals(self) -> tuple[int, int]:
        """The blocks recorded and their bytes."""
        query = "SELECT count(*), coalesce(sum(nbytes), 0) FROM blocks"
        count, nbytes = self._db.execute(query).fetchone()
        return int(count), int(nbytes)

    def keys(self) -> set[str]:
        return {row[0] for row in self._db.execute("SELECT key FROM blocks")}

    def clear(self) -> list[str]:
        """Delete every row; return their keys."""
        with self._transaction():
            keys = [row[0] for row in self._db.execute("SELECT key FROM blocks")]
            self._db.execute("DELETE FROM blocks")
            self._db.execute("UPDATE generation SET value = value + 1")
        return keys

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """Its body as one transaction (rolled back if it raises)."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

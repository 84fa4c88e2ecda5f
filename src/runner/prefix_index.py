"""The runner's KV prefix cache index: stored values keyed by token sequence.

Chat clients resend the whole history every turn. The runner keeps the KV
cache of finished requests keyed by their tokens; for a new prompt,
:meth:`PrefixIndex.lookup` finds the stored entry that lets it skip the most
tokens, so only the rest are computed.

The index is pure Python and imports nothing outside the standard library:
it stores opaque values (the mlx caches) with their byte sizes and never
looks inside them. The mlx glue (copy, trim, measure) lives beside it.

The rules:

- A *trimmable* entry (KVCache-like) can be cut back to any shorter prefix of
  its key; a non-trimmable one (SSM-style state) is usable only when its
  whole key is a prefix of the prompt.
- The caller always computes at least one prompt token (to get logits), so a
  match reuses at most ``len(tokens) - 1`` tokens.
- Among the candidates the largest reuse wins; ties prefer an entry that
  needs no trim, then the most recently used one.
- A lookup hit makes its entry the most recent (true LRU). Evictions take the
  least recently used entry first, to stay within a byte budget and an entry
  cap.
- A trimmable entry supersedes the stored entries whose keys are strict
  prefixes of its own key: it can be trimmed to any of them.

The structure is a radix tree with compressed edges: a node's ``edge`` holds
the tokens from its parent, and nodes exist only at the root, at branch points
and at entry ends. Each node also keeps the trimmable entries of its subtree,
ordered by recency, so "which trimmable entry shares this prefix" is answered
in O(1) per node. A lookup therefore costs O(len(tokens)), whatever the
number of entries.

Not thread-safe: the runner's main thread alone uses it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["IndexStats", "Match", "PrefixIndex"]

V = TypeVar("V")


@dataclass(frozen=True)
class Match(Generic[V]):
    """A stored entry the caller may reuse for a prompt.

    The caller takes the entry's cache, trims ``trim`` tokens off its end
    (leaving the KV for ``key[:reuse]``, which equals ``tokens[:reuse]``), then
    computes ``tokens[reuse:]``. The value still belongs to the index.
    """

    key: tuple[int, ...]
    """The stored entry's full token key."""
    value: V
    reuse: int
    """Tokens of the prompt the caller may take from this entry."""
    trim: int
    """``len(key) - reuse``: tokens to trim off the entry's cache (0 when the
    key is a prefix of the prompt)."""


@dataclass(frozen=True)
class IndexStats:
    """A snapshot of the index's size and counters."""

    entries: int
    bytes: int
    budget_bytes: int
    max_entries: int
    hits: int
    misses: int
    evictions: int
    """Entries dropped for the budget, the entry cap, or by an explicit evict."""
    tokens_reused: int
    """The sum of ``reuse`` over all hits."""
    superseded: int = 0
    """Entries dropped because a trimmable entry extending their key came in."""
    replaced: int = 0
    """Entries dropped because an entry with the same key came in."""


class _Entry(Generic[V]):
    """One stored value with its key, its size and its node in the tree."""

    __slots__ = ("key", "nbytes", "node", "serial", "trimmable", "value")

    def __init__(
        self,
        key: tuple[int, ...],
        value: V,
        nbytes: int,
        trimmable: bool,
        node: _Node[V],
        serial: int,
    ) -> None:
        self.key = key
        self.value = value
        self.nbytes = nbytes
        self.trimmable = trimmable
        self.node = node
        self.serial = serial
        """Unique per entry; the key of the recency dicts."""


class _Node(Generic[V]):
    """A radix-tree node: the root, a branch point, or an entry's end."""

    __slots__ = ("children", "depth", "edge", "entry", "parent", "trimmable_below")

    def __init__(self, edge: tuple[int, ...], parent: _Node[V] | None, depth: int) -> None:
        self.edge = edge
        """The tokens from the parent to this node (empty for the root)."""
        self.parent = parent
        self.depth = depth
        """The number of tokens from the root to the end of this node's edge."""
        self.children: dict[int, _Node[V]] = {}
        """Keyed by the first token of the child's edge."""
        self.entry: _Entry[V] | None = None
        self.trimmable_below: OrderedDict[int, _Entry[V]] = OrderedDict()
        """The trimmable entries at or below this node, least recent first."""

    def path_to_root(self) -> Iterator[_Node[V]]:
        """Yield this node, then each ancestor up to and including the root."""
        node: _Node[V] | None = self
        while node is not None:
            yield node
            node = node.parent


def _common_prefix_length(edge: tuple[int, ...], key: tuple[int, ...], start: int) -> int:
    """Return how many leading tokens of ``edge`` equal those of ``key[start:]``.

    Slices compare at C speed. When the whole overlap is not equal, a binary
    search finds the first difference; each step compares only the half not
    yet known to be equal, so the cost stays linear in the overlap.
    """
    overlap = min(len(edge), len(key) - start)
    if key[start : start + overlap] == edge[:overlap]:
        return overlap
    equal, unequal = 0, overlap  # the prefix of length `equal` matches; of `unequal` does not
    while unequal - equal > 1:
        middle = (equal + unequal) // 2
        if key[start + equal : start + middle] == edge[equal:middle]:
            equal = middle
        else:
            unequal = middle
    return equal


class PrefixIndex(Generic[V]):
    """Stored values keyed by token sequences, found by longest usable prefix.

    Args:
        budget_bytes: the most bytes the stored values may take together.
        max_entries: the most entries kept.
        on_evict: called as ``on_evict(key, value)`` once for every value the
            index drops (evicted, superseded, replaced or cleared), after the
            index has forgotten it. It must not call back into the index. If it
            raises, the exception propagates at once: the index stays
            consistent, but values dropped later in the same call are not
            handed to it and the index may be left over its budget until the
            next insert or evict.

    Raises:
        ValueError: if ``budget_bytes`` is negative or ``max_entries`` is
            below 1.
    """

    def __init__(
        self,
        budget_bytes: int,
        max_entries: int = 256,
        on_evict: Callable[[tuple[int, ...], V], None] | None = None,
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self._budget_bytes = budget_bytes
        self._max_entries = max_entries
        self._on_evict = on_evict
        self._root: _Node[V] = _Node((), None, 0)
        self._recency: OrderedDict[int, _Entry[V]] = OrderedDict()
        """Every entry by serial, least recent first."""
        self._bytes = 0
        self._next_serial = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._tokens_reused = 0
        self._superseded = 0
        self._replaced = 0

    # -- queries ---------------------------------------------------------------

    def lookup(self, tokens: Sequence[int]) -> Match[V] | None:
        """Return the entry that lets the caller reuse the most of ``tokens``.

        A match counts as a hit and makes its entry the most recent; None (no
        entry gives a reuse of at least one token, or ``tokens`` has fewer
        than two) counts as a miss.
        """
        found = self._best_match(tuple(tokens))
        if found is None:
            self._misses += 1
            return None
        entry, reuse = found
        self._hits += 1
        self._tokens_reused += reuse
        self._touch(entry)
        return Match(key=entry.key, value=entry.value, reuse=reuse, trim=len(entry.key) - reuse)

    def peek(self, tokens: Sequence[int]) -> Match[V] | None:
        """Return what :meth:`lookup` would, changing no counter and no recency."""
        found = self._best_match(tuple(tokens))
        if found is None:
            return None
        entry, reuse = found
        return Match(key=entry.key, value=entry.value, reuse=reuse, trim=len(entry.key) - reuse)

    def __len__(self) -> int:
        return len(self._recency)

    def __contains__(self, tokens: Sequence[int]) -> bool:
        """Whether an entry has exactly this key."""
        return self._find_entry(tuple(tokens)) is not None

    def keys(self) -> list[tuple[int, ...]]:
        """Return every stored key, least recently used first."""
        return [entry.key for entry in self._recency.values()]

    @property
    def bytes(self) -> int:
        """The sum of the stored entries' ``nbytes``."""
        return self._bytes

    @property
    def budget_bytes(self) -> int:
        return self._budget_bytes

    @property
    def max_entries(self) -> int:
        return self._max_entries

    @property
    def stats(self) -> IndexStats:
        return IndexStats(
            entries=len(self._recency),
            bytes=self._bytes,
            budget_bytes=self._budget_bytes,
            max_entries=self._max_entries,
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
            tokens_reused=self._tokens_reused,
            superseded=self._superseded,
            replaced=self._replaced,
        )

    # -- changes ---------------------------------------------------------------

    def insert(self, tokens: Sequence[int], value: V, nbytes: int, *, trimmable: bool) -> bool:
        """Store ``value`` under ``tokens`` as the most recent entry.

        An entry with the same key is replaced (its value goes to on_evict,
        unless it is this very value). If the new entry is trimmable, the
        entries whose keys are strict prefixes of ``tokens`` are superseded.
        Then least recently used entries, never the new one, are evicted until
        the index is within its budget and entry cap.

        Returns:
            True if stored; False if ``tokens`` is empty or ``nbytes`` exceeds
            the budget (the value is then not kept, and on_evict is not called
            for it; an entry already under this key stays).

        Raises:
            ValueError: if ``nbytes`` is negative.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        key = tuple(tokens)
        if not key or nbytes > self._budget_bytes:
            return False
        node = self._make_node(key)
        dropped: list[_Entry[V]] = []
        replaced = node.entry
        if replaced is not None:
            self._unlink(replaced)  # the node keeps its place: the new entry goes there
            self._replaced += 1
            if replaced.value is not value:
                dropped.append(replaced)
        self._link(node, key, value, nbytes, trimmable)
        if trimmable:
            superseded = [
                ancestor.entry
                for ancestor in node.path_to_root()
                if ancestor.entry is not None and ancestor is not node
            ]
            for old in superseded:
                self._remove(old)
                self._superseded += 1
                dropped.append(old)
        for old in dropped:
            self._notify(old)
        # The new entry alone fits (nbytes <= budget, max_entries >= 1), and it is
        # the most recent, so the least recent one is never it.
        while self._bytes > self._budget_bytes or len(self._recency) > self._max_entries:
            self._evict_least_recent()
        return True

    def pop(self, tokens: Sequence[int]) -> V | None:
        """Remove the entry with exactly this key and return its value.

        The caller now owns the value: on_evict is not called and nothing is
        counted. Returns None if no entry has this key.
        """
        entry = self._find_entry(tuple(tokens))
        if entry is None:
            return None
        self._remove(entry)
        return entry.value

    def evict_lru(self, count: int = 1) -> int:
        """Evict up to ``count`` least recently used entries; return how many."""
        evicted = 0
        while evicted < count and self._recency:
            self._evict_least_recent()
            evicted += 1
        return evicted

    def evict_bytes(self, nbytes: int) -> int:
        """Evict least recently used entries until ``nbytes`` were freed or none is left.

        Returns the bytes freed (possibly more than ``nbytes``).
        """
        freed = 0
        while freed < nbytes and self._recency:
            freed += self._evict_least_recent().nbytes
        return freed

    def clear(self) -> int:
        """Evict every entry (counted as evictions); return how many were dropped."""
        return self.evict_lru(len(self._recency))

    def set_budget(self, budget_bytes: int) -> None:
        """Change the byte budget, evicting least recently used entries to fit it.

        Raises:
            ValueError: if ``budget_bytes`` is negative.
        """
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self._budget_bytes = budget_bytes
        while self._bytes > self._budget_bytes:
            self._evict_least_recent()

    # -- the tree --------------------------------------------------------------

    def _best_match(self, key: tuple[int, ...]) -> tuple[_Entry[V], int] | None:
        """Return the entry to reuse for the prompt ``key`` and its reuse, or None."""
        limit = len(key) - 1  # the caller computes at least one token
        if limit < 1:
            return None
        path: list[_Node[V]] = []  # the nodes whose edges the prompt enters, root first
        exact_reuse = 0  # the longest entry key that is a prefix of the prompt, up to limit
        shared = 0  # the tokens shared with the deepest subtree holding a trimmable entry
        node = self._root
        while True:
            path.append(node)
            if node.entry is not None and node.depth <= limit:
                exact_reuse = node.depth
            if node.trimmable_below:
                shared = node.depth
            if node.depth == len(key):
                break
            child = node.children.get(key[node.depth])
            if child is None:
                break
            matched = _common_prefix_length(child.edge, key, node.depth)
            if matched < len(child.edge):
                # The prompt leaves the tree (or ends) inside this edge: every
                # entry below shares exactly the tokens matched so far.
                path.append(child)
                if child.trimmable_below:
                    shared = node.depth + matched
                break
            node = child
        reuse = max(exact_reuse, min(shared, limit))
        if reuse == 0:
            return None
        # Every candidate with this reuse lies at or below the first path node
        # reaching that depth: an entry ending right there needs no trim;
        # otherwise the most recent trimmable entry below it.
        holder = next(n for n in path if n.depth >= reuse)
        if holder.depth == reuse and holder.entry is not None:
            return holder.entry, reuse
        return next(reversed(holder.trimmable_below.values())), reuse

    def _find_entry(self, key: tuple[int, ...]) -> _Entry[V] | None:
        """Return the entry with exactly this key, or None."""
        node = self._root
        while node.depth < len(key):
            child = node.children.get(key[node.depth])
            if child is None or key[node.depth : child.depth] != child.edge:
                return None
            node = child
        return node.entry if node.depth == len(key) else None

    def _make_node(self, key: tuple[int, ...]) -> _Node[V]:
        """Return the node ending at ``key``, splitting an edge or adding a leaf as needed."""
        node = self._root
        while node.depth < len(key):
            first = key[node.depth]
            child = node.children.get(first)
            if child is None:
                leaf: _Node[V] = _Node(key[node.depth :], node, len(key))
                node.children[first] = leaf
                return leaf
            matched = _common_prefix_length(child.edge, key, node.depth)
            if matched < len(child.edge):
                # Split the edge: a new node where the key leaves it (or ends).
                middle: _Node[V] = _Node(child.edge[:matched], node, node.depth + matched)
                middle.trimmable_below = OrderedDict(child.trimmable_below)
                child.edge = child.edge[matched:]
                child.parent = middle
                middle.children[child.edge[0]] = child
                node.children[first] = middle
                child = middle
            node = child
        return node

    def _link(
        self, node: _Node[V], key: tuple[int, ...], value: V, nbytes: int, trimmable: bool
    ) -> None:
        """Store a new entry at ``node`` (which has none) as the most recent."""
        entry = _Entry(key, value, nbytes, trimmable, node, self._next_serial)
        self._next_serial += 1
        node.entry = entry
        self._recency[entry.serial] = entry
        self._bytes += nbytes
        if trimmable:
            for ancestor in node.path_to_root():
                ancestor.trimmable_below[entry.serial] = entry

    def _unlink(self, entry: _Entry[V]) -> None:
        """Forget ``entry`` everywhere but leave its node in the tree."""
        entry.node.entry = None
        del self._recency[entry.serial]
        self._bytes -= entry.nbytes
        if entry.trimmable:
            for ancestor in entry.node.path_to_root():
                del ancestor.trimmable_below[entry.serial]

    def _remove(self, entry: _Entry[V]) -> None:
        """Forget ``entry`` and prune the nodes it alone needed."""
        self._unlink(entry)
        self._prune(entry.node)

    def _prune(self, node: _Node[V]) -> None:
        """Drop ``node`` if it is an empty leaf, or merge it into its only child.

        Dropping a leaf may leave its parent entry-less with one child, so the
        parent is looked at next.
        """
        while node.parent is not None and node.entry is None:
            parent = node.parent
            if not node.children:
                del parent.children[node.edge[0]]
                node = parent
                continue
            if len(node.children) == 1:
                (child,) = node.children.values()
                child.edge = node.edge + child.edge
                child.parent = parent
                parent.children[child.edge[0]] = child
            return

    def _touch(self, entry: _Entry[V]) -> None:
        """Make ``entry`` the most recent, in the index and in its ancestors' sets."""
        self._recency.move_to_end(entry.serial)
        if entry.trimmable:
            for ancestor in entry.node.path_to_root():
                ancestor.trimmable_below.move_to_end(entry.serial)

    def _evict_least_recent(self) -> _Entry[V]:
        """Evict the least recently used entry (there must be one) and return it."""
        entry = next(iter(self._recency.values()))
        self._remove(entry)
        self._evictions += 1
        self._notify(entry)
        return entry

    def _notify(self, entry: _Entry[V]) -> None:
        """Hand a dropped value to on_evict."""
        if self._on_evict is not None:
            self._on_evict(entry.key, entry.value)

    def _node_count(self) -> int:
        """Count the tree's nodes, the root included (for tests of pruning)."""
        count = 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count

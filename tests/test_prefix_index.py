"""The KV prefix cache index on its own: matching rules, LRU, budget, tree pruning.

Unit tests pin each rule; property tests run random operation sequences
against a brute-force reference of the same rules.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from runner.prefix_index import IndexStats, Match, PrefixIndex

Key = tuple[int, ...]


def recording_index(
    budget_bytes: int = 1000, max_entries: int = 256
) -> tuple[PrefixIndex[str], list[tuple[Key, str]]]:
    """An index whose on_evict calls are recorded, in order."""
    dropped: list[tuple[Key, str]] = []
    index = PrefixIndex[str](
        budget_bytes, max_entries, on_evict=lambda key, value: dropped.append((key, value))
    )
    return index, dropped


def reuse_and_trim(match: Match[Any] | None) -> tuple[Key, int, int] | None:
    return None if match is None else (match.key, match.reuse, match.trim)


# -- matching rules ------------------------------------------------------------


def test_entry_whose_key_is_a_prefix_of_the_prompt_is_reused_without_trim() -> None:
    index, _ = recording_index()
    for trimmable in (True, False):
        index.clear()
        index.insert([1, 2, 3], "cache", 10, trimmable=trimmable)
        match = index.lookup([1, 2, 3, 4, 5])
        assert match == Match(key=(1, 2, 3), value="cache", reuse=3, trim=0)


def test_longer_trimmable_entry_is_trimmed_back_to_the_prompt() -> None:
    index, _ = recording_index()
    index.insert([1, 2, 3, 4, 5, 6], "long", 10, trimmable=True)
    # The prompt is a prefix of the key: all but its last token are reused.
    assert reuse_and_trim(index.lookup([1, 2, 3, 4])) == ((1, 2, 3, 4, 5, 6), 3, 3)


def test_diverging_trimmable_entry_is_trimmed_to_where_they_diverge() -> None:
    index, _ = recording_index()
    index.insert([1, 2, 3, 4, 5, 6], "other", 10, trimmable=True)
    assert reuse_and_trim(index.lookup([1, 2, 3, 9, 9, 9])) == ((1, 2, 3, 4, 5, 6), 3, 3)
    # Diverging at a branch point rather than inside an edge gives the same.
    index.insert([1, 2, 3, 7], "sibling", 10, trimmable=False)
    assert reuse_and_trim(index.lookup([1, 2, 3, 9, 9, 9])) == ((1, 2, 3, 4, 5, 6), 3, 3)


def test_non_trimmable_entry_is_used_only_as_a_prefix_of_the_prompt() -> None:
    index, _ = recording_index()
    index.insert([1, 2, 3, 4], "ssm", 10, trimmable=False)
    assert index.lookup([1, 2, 3, 9, 9]) is None  # diverges
    assert index.lookup([1, 2]) is None  # the key extends the prompt
    assert index.lookup([1, 2, 3, 4]) is None  # the whole prompt: no token left to compute
    assert reuse_and_trim(index.lookup([1, 2, 3, 4, 5])) == ((1, 2, 3, 4), 4, 0)


def test_one_prompt_token_is_always_left_to_compute() -> None:
    index, _ = recording_index()
    index.insert([1, 2, 3], "kv", 10, trimmable=True)
    assert reuse_and_trim(index.lookup([1, 2, 3])) == ((1, 2, 3), 2, 1)
    assert reuse_and_trim(index.lookup([1, 2])) == ((1, 2, 3), 1, 2)
    assert index.lookup([1]) is None  # a single token has nothing to reuse
    assert index.lookup([]) is None


def test_ties_prefer_an_entry_needing_no_trim() -> None:
    index, _ = recording_index()
    index.insert([1, 2, 3, 4], "longer", 10, trimmable=True)
    index.insert([1, 2], "exact", 10, trimmable=False)
    assert index.lookup([1, 2, 3, 4, 5]) is not None  # "longer" is now the most recent
    # Both give reuse 2 for [1, 2, 3]; "longer" needs a trim.
    assert reuse_and_trim(index.lookup([1, 2, 3])) == ((1, 2), 2, 0)


def test_ties_between_trimmed_entries_go_to_the_most_recently_used() -> None:
    index, _ = recording_index()
    index.insert([1, 2, 3, 4], "a", 10, trimmable=True)
    index.insert([1, 2, 3, 5], "b", 10, trimmable=True)
    assert reuse_and_trim(index.lookup([1, 2, 3, 9])) == ((1, 2, 3, 5), 3, 1)
    assert reuse_and_trim(index.lookup([1, 2, 3, 4, 9])) == ((1, 2, 3, 4), 4, 0)
    assert reuse_and_trim(index.lookup([1, 2, 3, 9])) == ((1, 2, 3, 4), 3, 1)


def test_longest_reuse_wins_over_recency_and_over_no_trim() -> None:
    index, _ = recording_index()
    index.insert([1, 2, 3, 4, 5, 6], "deep", 10, trimmable=True)
    index.insert([1, 2], "shallow", 10, trimmable=False)
    assert reuse_and_trim(index.lookup([1, 2, 3, 4, 9])) == ((1, 2, 3, 4, 5, 6), 4, 2)


# -- recency and eviction ------------------------------------------------------


def test_a_hit_makes_its_entry_most_recent_so_an_older_one_is_evicted_first() -> None:
    index, dropped = recording_index(max_entries=2)
    index.insert([1, 1], "a", 10, trimmable=True)
    index.insert([2, 2], "b", 10, trimmable=True)
    assert index.lookup([1, 1, 5]) is not None
    assert index.keys() == [(2, 2), (1, 1)]
    index.insert([3, 3], "c", 10, trimmable=True)
    assert dropped == [((2, 2), "b")]
    assert index.keys() == [(1, 1), (3, 3)]


def test_a_miss_or_a_peek_does_not_change_recency() -> None:
    index, _ = recording_index()
    index.insert([1, 1], "a", 10, trimmable=True)
    index.insert([2, 2], "b", 10, trimmable=True)
    assert index.peek([1, 1, 5]) is not None
    assert index.lookup([3, 3]) is None
    assert index.keys() == [(1, 1), (2, 2)]


def test_trimmable_extension_supersedes_its_strict_prefixes() -> None:
    index, dropped = recording_index()
    index.insert([1, 2], "short", 10, trimmable=False)
    index.insert([1, 2, 3], "middle", 10, trimmable=True)
    index.insert([1, 9], "unrelated", 10, trimmable=True)
    assert [key for key, _ in dropped] == [(1, 2)]  # superseded by [1, 2, 3]
    index.insert([1, 2, 3, 4, 5], "long", 10, trimmable=True)
    assert sorted(index.keys()) == [(1, 2, 3, 4, 5), (1, 9)]
    assert sorted(dropped) == [((1, 2), "short"), ((1, 2, 3), "middle")]
    assert index.bytes == 20
    stats = index.stats
    assert (stats.superseded, stats.evictions) == (2, 0)


def test_non_trimmable_extension_keeps_its_prefixes() -> None:
    index, dropped = recording_index()
    index.insert([1, 2], "short", 10, trimmable=True)
    index.insert([1, 2, 3, 4], "ssm", 10, trimmable=False)
    assert sorted(index.keys()) == [(1, 2), (1, 2, 3, 4)]
    assert dropped == []


def test_same_key_replaces_the_old_value() -> None:
    index, dropped = recording_index()
    index.insert([1, 2, 3], "old", 10, trimmable=True)
    index.insert([4], "other", 5, trimmable=True)
    assert index.insert([1, 2, 3], "new", 30, trimmable=False) is True
    assert dropped == [((1, 2, 3), "old")]
    assert index.keys() == [(4,), (1, 2, 3)]
    assert index.bytes == 35
    assert index.lookup([1, 2, 3, 4]) == Match(key=(1, 2, 3), value="new", reuse=3, trim=0)
    assert index.lookup([1, 2]) is None  # no longer trimmable
    stats = index.stats
    assert (stats.replaced, stats.evictions, stats.entries) == (1, 0, 2)


def test_reinserting_the_same_value_does_not_hand_it_to_on_evict() -> None:
    index, dropped = recording_index()
    cache = "cache"
    index.insert([1, 2, 3], cache, 10, trimmable=True)
    index.insert([1, 2, 3], cache, 12, trimmable=True)
    assert dropped == []
    assert index.bytes == 12


def test_empty_or_oversize_entry_is_not_stored() -> None:
    index, dropped = recording_index(budget_bytes=100)
    assert index.insert([], "empty", 1, trimmable=True) is False
    assert index.insert([1, 2], "big", 101, trimmable=True) is False
    assert len(index) == 0 and index.bytes == 0
    index.insert([1, 2], "fits", 100, trimmable=True)
    assert index.insert([1, 2], "big", 101, trimmable=True) is False
    assert index.keys() == [(1, 2)]
    match = index.lookup([1, 2, 3])
    assert match is not None and match.value == "fits"
    assert dropped == []


def test_entry_cap_evicts_the_least_recent() -> None:
    index, dropped = recording_index(max_entries=3)
    for token in range(5):
        index.insert([token, token], f"v{token}", 1, trimmable=True)
    assert index.keys() == [(2, 2), (3, 3), (4, 4)]
    assert dropped == [((0, 0), "v0"), ((1, 1), "v1")]
    assert index.stats.evictions == 2


def test_budget_evicts_the_least_recent_but_never_the_new_entry() -> None:
    index, dropped = recording_index(budget_bytes=100)
    index.insert([1], "a", 40, trimmable=True)
    index.insert([2], "b", 40, trimmable=True)
    index.insert([3], "c", 40, trimmable=True)
    assert index.keys() == [(2,), (3,)] and index.bytes == 80
    index.insert([4], "d", 100, trimmable=True)
    assert index.keys() == [(4,)] and index.bytes == 100
    assert [value for _, value in dropped] == ["a", "b", "c"]


def test_evict_lru_evicts_up_to_count() -> None:
    index, dropped = recording_index()
    for token in range(4):
        index.insert([token], str(token), 10, trimmable=True)
    assert index.evict_lru() == 1
    assert index.evict_lru(2) == 2
    assert index.evict_lru(5) == 1
    assert index.evict_lru(0) == 0
    assert [value for _, value in dropped] == ["0", "1", "2", "3"]
    assert index.stats.evictions == 4


def test_evict_bytes_frees_at_least_what_was_asked() -> None:
    index, dropped = recording_index()
    for token, nbytes in enumerate((10, 20, 30, 40)):
        index.insert([token], str(token), nbytes, trimmable=True)
    assert index.evict_bytes(0) == 0
    assert index.evict_bytes(25) == 30  # 10 then 20
    assert index.keys() == [(2,), (3,)]
    assert index.evict_bytes(1000) == 70  # everything left
    assert len(index) == 0 and index.bytes == 0
    assert len(dropped) == 4


def test_clear_evicts_everything() -> None:
    index, dropped = recording_index()
    for token in range(3):
        index.insert([token, 1, 2], str(token), 10, trimmable=token % 2 == 0)
    assert index.clear() == 3
    assert len(index) == 0 and index.bytes == 0 and index.keys() == []
    assert sorted(value for _, value in dropped) == ["0", "1", "2"]
    assert index.stats.evictions == 3
    assert index.clear() == 0


def test_set_budget_evicts_least_recent_until_within_it() -> None:
    index, dropped = recording_index(budget_bytes=100)
    for token in range(4):
        index.insert([token], str(token), 25, trimmable=True)
    index.set_budget(60)
    assert index.budget_bytes == 60 and index.bytes == 50
    assert index.keys() == [(2,), (3,)]
    assert [value for _, value in dropped] == ["0", "1"]
    index.set_budget(1000)
    assert len(index) == 2
    assert index.insert([9], "big", 900, trimmable=True) is True


def test_pop_hands_the_value_back_without_on_evict() -> None:
    index, dropped = recording_index()
    index.insert([1, 2, 3], "kv", 10, trimmable=True)
    index.insert([1, 2], "ssm", 10, trimmable=False)
    assert index.pop([1, 2, 3, 4]) is None
    assert index.pop([1, 2, 3]) == "kv"
    assert index.keys() == [(1, 2)] and index.bytes == 10
    assert index.lookup([1, 2]) is None  # the trimmable one is gone
    assert dropped == []
    assert index.stats.evictions == 0


def test_contains_and_len_see_exact_keys_only() -> None:
    index, _ = recording_index()
    index.insert([1, 2, 3], "a", 10, trimmable=True)
    index.insert([1, 2, 4], "b", 10, trimmable=True)
    assert [1, 2, 3] in index and (1, 2, 4) in index
    assert [1, 2] not in index and [1, 2, 3, 4] not in index and [] not in index
    assert len(index) == 2


def test_on_evict_is_called_exactly_once_per_dropped_value() -> None:
    index, dropped = recording_index(budget_bytes=100, max_entries=3)
    index.insert([1], "a", 10, trimmable=False)
    index.insert([1, 2], "b", 10, trimmable=True)  # supersedes a
    index.insert([1, 2], "c", 10, trimmable=True)  # replaces b
    index.insert([5], "d", 50, trimmable=True)
    index.insert([6], "e", 50, trimmable=True)  # evicts c
    index.insert([7], "f", 10, trimmable=True)  # evicts d
    assert index.pop([7]) == "f"  # handed back, not dropped
    index.set_budget(10)  # evicts e
    index.insert([8], "g", 10, trimmable=True)
    index.clear()  # evicts g
    assert [value for _, value in dropped] == ["a", "b", "c", "d", "e", "g"]
    stats = index.stats
    assert (stats.superseded, stats.replaced, stats.evictions) == (1, 1, 4)


def test_stats_count_hits_misses_and_tokens_reused() -> None:
    index = PrefixIndex[str](budget_bytes=500, max_entries=7)
    index.insert([1, 2, 3, 4], "a", 100, trimmable=True)
    index.insert([5, 6], "b", 50, trimmable=False)
    index.lookup([1, 2, 3, 4, 5])  # reuse 4
    index.lookup([1, 2, 9])  # reuse 2
    index.lookup([5, 6])  # miss: no token left
    index.lookup([])  # miss
    index.peek([1, 2, 3])  # not counted
    assert index.stats == IndexStats(
        entries=2,
        bytes=150,
        budget_bytes=500,
        max_entries=7,
        hits=2,
        misses=2,
        evictions=0,
        tokens_reused=6,
        superseded=0,
        replaced=0,
    )


def test_invalid_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        PrefixIndex[str](budget_bytes=-1)
    with pytest.raises(ValueError):
        PrefixIndex[str](budget_bytes=10, max_entries=0)
    index = PrefixIndex[str](budget_bytes=10)
    with pytest.raises(ValueError):
        index.insert([1], "a", -1, trimmable=True)
    with pytest.raises(ValueError):
        index.set_budget(-1)


def test_removing_entries_prunes_the_tree() -> None:
    index = PrefixIndex[int](budget_bytes=10**9, max_entries=10_000)
    assert index._node_count() == 1
    # Keys sharing prefixes at many depths, so inserts split edges everywhere.
    keys = [tuple((seed * 7 + i * i) % 3 for i in range(seed % 17 + 1)) for seed in range(300)]
    for seed, key in enumerate(keys):
        index.insert(key, seed, 1, trimmable=seed % 3 != 0)
    assert index._node_count() > 20
    assert_tree_is_well_formed(index)
    for key in keys[::2]:
        index.pop(key)
    assert_tree_is_well_formed(index)
    index.clear()
    assert index._node_count() == 1
    # Churn: with at most two entries alive the tree stays small.
    churn = PrefixIndex[int](budget_bytes=10**9, max_entries=2)
    for seed, key in enumerate(keys * 3):
        churn.insert(key, seed, 1, trimmable=seed % 2 == 0)
        churn.lookup((*key[:-1], 9))
        assert churn._node_count() <= 4  # the root, one branch point, two entry ends
    assert_tree_is_well_formed(churn)


# -- the tree's invariants ------------------------------------------------------


def assert_tree_is_well_formed(index: PrefixIndex[Any]) -> None:
    """Check the radix tree against its entries: edges, depths, keys, the
    trimmable sets in recency order, no node that pruning should have removed."""
    recency = list(index._recency)  # serials, least recent first
    position = {serial: at for at, serial in enumerate(recency)}
    seen: list[int] = []

    def visit(node: Any, prefix: Key) -> set[int]:
        """Check ``node``'s subtree; return the serials of its trimmable entries."""
        assert node.depth == len(prefix)
        trimmable: set[int] = set()
        if node.entry is not None:
            assert node.entry.node is node and node.entry.key == prefix
            seen.append(node.entry.serial)
            if node.entry.trimmable:
                trimmable.add(node.entry.serial)
        elif node.parent is not None:
            assert len(node.children) >= 2, "an entry-less node must be a branch point"
        for first, child in node.children.items():
            assert child.parent is node and child.edge and child.edge[0] == first
            trimmable |= visit(child, prefix + child.edge)
        below = list(node.trimmable_below)
        assert set(below) == trimmable
        assert below == sorted(below, key=position.__getitem__), "not in recency order"
        return trimmable

    visit(index._root, ())
    assert sorted(seen) == sorted(recency)
    assert index.bytes == sum(entry.nbytes for entry in index._recency.values())


# -- a brute-force reference ---------------------------------------------------


def common_prefix(a: Key, b: Key) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


@dataclass
class ReferenceEntry:
    key: Key
    value: int
    nbytes: int
    trimmable: bool


@dataclass
class ReferenceIndex:
    """The index's rules by brute force over a list, least recent first."""

    budget_bytes: int
    max_entries: int
    entries: list[ReferenceEntry] = field(default_factory=list)

    def reuse_by(self, entry: ReferenceEntry, tokens: Key) -> int:
        limit = len(tokens) - 1
        reuse = 0
        if len(entry.key) <= limit and tokens[: len(entry.key)] == entry.key:
            reuse = len(entry.key)
        if entry.trimmable:
            reuse = max(reuse, min(common_prefix(entry.key, tokens), limit))
        return reuse

    def best(self, tokens: Key) -> tuple[ReferenceEntry, int] | None:
        """Largest reuse; ties: no trim, then most recent (latest in the list)."""
        scored = [(self.reuse_by(entry, tokens), entry) for entry in self.entries]
        reuse = max((score for score, _ in scored), default=0)
        if reuse < 1:
            return None
        tied = [entry for score, entry in scored if score == reuse]
        untrimmed = [entry for entry in tied if len(entry.key) == reuse]
        return (untrimmed or tied)[-1], reuse

    def lookup(self, tokens: Key) -> tuple[ReferenceEntry, int] | None:
        found = self.best(tokens)
        if found is not None:
            self.entries.remove(found[0])
            self.entries.append(found[0])
        return found

    def insert(self, tokens: Key, value: int, nbytes: int, trimmable: bool) -> bool:
        if not tokens or nbytes > self.budget_bytes:
            return False
        self.entries = [entry for entry in self.entries if entry.key != tokens]
        if trimmable:
            self.entries = [
                entry
                for entry in self.entries
                if not (len(entry.key) < len(tokens) and tokens[: len(entry.key)] == entry.key)
            ]
        self.entries.append(ReferenceEntry(tokens, value, nbytes, trimmable))
        while self.bytes() > self.budget_bytes or len(self.entries) > self.max_entries:
            self.entries.pop(0)
        return True

    def bytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries)

    def set_budget(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        while self.bytes() > budget_bytes:
            self.entries.pop(0)

    def keys(self) -> list[Key]:
        return [entry.key for entry in self.entries]


# -- random operation sequences ------------------------------------------------


@dataclass(frozen=True)
class Operation:
    """One step of a random sequence; each kind reads the fields it needs.

    Its tokens are the first ``cut`` tokens of an earlier inserted key (picked
    by ``source``), then ``tail``; with nothing inserted yet, just ``tail``.
    Small alphabets and lengths make prefixes collide often.
    """

    kind: str
    source: int
    cut: int
    tail: Key
    amount: int
    """nbytes for insert, bytes for evict_bytes; evict_lru and set_budget scale it."""
    trimmable: bool


tails = st.lists(st.integers(0, 3), max_size=6).map(tuple)
# Repeated kinds weigh the draw towards inserts and lookups.
kinds = (
    ["insert"] * 5
    + ["lookup"] * 5
    + [
        "peek",
        "pop",
        "evict_lru",
        "evict_bytes",
        "set_budget",
        "clear",
    ]
)
operations = st.builds(
    Operation,
    kind=st.sampled_from(kinds),
    source=st.integers(0, 50),
    cut=st.integers(0, 10),
    tail=tails,
    amount=st.integers(0, 60),
    trimmable=st.booleans(),
)
scenarios = st.tuples(
    st.integers(40, 300), st.integers(1, 6), st.lists(operations, min_size=8, max_size=30)
)
# The explain phase traces every line it runs: minutes on a failure here.
PROPERTY_SETTINGS = settings(
    deadline=None,
    max_examples=200,
    phases=[p for p in Phase if p is not Phase.explain],
    report_multiple_bugs=False,
)


class Harness:
    """Runs operations on an index and on the reference, checking after each one.

    Live values are tracked through on_evict (and pop), apart from the index.
    """

    def __init__(self, budget_bytes: int, max_entries: int) -> None:
        self.live: dict[int, tuple[Key, int]] = {}  # value -> (key, nbytes)
        self.index = PrefixIndex[int](budget_bytes, max_entries, on_evict=self.dropped)
        self.reference = ReferenceIndex(budget_bytes, max_entries)
        self.inserted: list[Key] = []
        self.next_value = 0
        self.lookups = 0

    def dropped(self, key: Key, value: int) -> None:
        assert value in self.live, "on_evict twice, or for a value never stored"
        assert self.live.pop(value)[0] == key, "on_evict with the wrong key"

    def tokens(self, source: int, cut: int, tail: Key) -> Key:
        if not self.inserted:
            return tail
        return self.inserted[source % len(self.inserted)][:cut] + tail

    def apply(self, operation: Operation) -> None:
        """Apply one operation to both, then check every property."""
        index, reference = self.index, self.reference
        tokens = self.tokens(operation.source, operation.cut, operation.tail)
        amount = operation.amount
        if operation.kind == "insert":
            value = self.next_value
            self.next_value += 1
            trimmable = operation.trimmable
            stored = index.insert(list(tokens), value, amount, trimmable=trimmable)
            assert stored == reference.insert(tokens, value, amount, trimmable)
            if stored:
                self.live[value] = (tokens, amount)
                self.inserted.append(tokens)
            assert index.bytes <= index.budget_bytes, "over budget after an insert"
            assert len(index) <= index.max_entries, "over the entry cap after an insert"
        elif operation.kind == "lookup":
            self.lookups += 1
            assert_match_agrees(tokens, index.lookup(tokens), reference.lookup(tokens))
        elif operation.kind == "peek":
            stats, keys = index.stats, index.keys()
            assert_match_agrees(tokens, index.peek(tokens), reference.best(tokens))
            assert (index.stats, index.keys()) == (stats, keys), "peek changed stats or recency"
        elif operation.kind == "pop":
            popped = index.pop(tokens)
            assert (popped is None) == all(entry.key != tokens for entry in reference.entries)
            if popped is not None:
                assert self.live.pop(popped)[0] == tokens
                reference.entries = [e for e in reference.entries if e.key != tokens]
        elif operation.kind == "evict_lru":
            count = amount % 4
            evicted = index.evict_lru(count)
            assert evicted == min(count, len(reference.entries))
            del reference.entries[:evicted]
        elif operation.kind == "evict_bytes":
            freed = index.evict_bytes(amount)
            expected_freed = 0
            while expected_freed < amount and reference.entries:
                expected_freed += reference.entries.pop(0).nbytes
            assert freed == expected_freed
        elif operation.kind == "set_budget":
            index.set_budget(amount * 5)
            reference.set_budget(amount * 5)
            assert index.bytes <= index.budget_bytes
        elif operation.kind == "clear":
            assert index.clear() == len(reference.entries)
            reference.entries.clear()
        assert index.keys() == reference.keys(), "entries or recency differ from the reference"
        assert index.bytes == sum(nbytes for _, nbytes in self.live.values())
        assert sorted(index.keys()) == sorted(key for key, _ in self.live.values())
        stats = index.stats
        assert stats.hits + stats.misses == self.lookups
        assert_tree_is_well_formed(index)


def assert_match_agrees(
    tokens: Key, match: Match[int] | None, expected: tuple[ReferenceEntry, int] | None
) -> None:
    """The index's match is the reference's, and is self-consistent."""
    if expected is None:
        assert match is None
        return
    assert match is not None
    entry, reuse = expected
    assert (match.key, match.value, match.reuse) == (entry.key, entry.value, reuse)
    assert 1 <= match.reuse <= len(tokens) - 1
    assert match.key[: match.reuse] == tokens[: match.reuse]
    assert match.trim == len(match.key) - match.reuse
    if not entry.trimmable:
        assert match.trim == 0


@PROPERTY_SETTINGS
@given(scenarios)
def test_random_operations_agree_with_the_brute_force_reference(
    scenario: tuple[int, int, list[Operation]],
) -> None:
    """After every operation of a random sequence (Harness.apply checks):

    1. lookup and peek return the reference's match (largest reuse, then no
       trim, then most recent), with key, reuse and trim consistent;
    2. ``bytes`` is the sum of the live values' nbytes, live values being
       tracked through on_evict, and the keys are theirs;
    3. every insert leaves the index within its budget and entry cap;
    4. peek changes no stats and no recency;

    and the entries, their recency order and the tree match the reference.
    """
    budget_bytes, max_entries, operations = scenario
    harness = Harness(budget_bytes, max_entries)
    for operation in operations:
        harness.apply(operation)


# -- cost ----------------------------------------------------------------------


def best_time_of_lookups(entries: int) -> float:
    """Best of 3: 200 lookups of a 2,000-token prompt among `entries` entries of
    1,000 tokens that share their first 900."""
    shared = list(range(1000, 1900))
    index = PrefixIndex[int](budget_bytes=10**12, max_entries=10_000)
    for i in range(entries):
        index.insert([*shared, 5000 + i, *range(99)], i, 1, trimmable=True)
    # One prompt extends an entry (reuse 1000, no trim); one leaves it mid-edge.
    extends = [*shared, 5000 + entries // 2, *range(99), *range(1000)]
    diverges = [*shared, 5000 + entries // 2, *range(50), *range(7000, 8049)]
    assert reuse_and_trim(index.peek(extends)) == (tuple(extends[:1000]), 1000, 0)
    assert reuse_and_trim(index.peek(diverges)) == (tuple(extends[:1000]), 951, 49)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(100):
            index.lookup(extends)
            index.lookup(diverges)
        best = min(best, time.perf_counter() - start)
    return best


def test_lookup_time_does_not_grow_with_the_number_of_entries() -> None:
    few, many = best_time_of_lookups(10), best_time_of_lookups(1000)
    assert many < 5 * few, f"1000 entries: {many:.4f}s, 10 entries: {few:.4f}s"

"""The prefix cache's disk tier (runner.disk_cache, runner.disk_index): blocks
written and read back exactly, keys that miss when anything they depend on
changes, every kind of damaged block rejected and recomputed, a full disk,
a writer killed mid-write, two writers of one model, clearing, and LRU
shared with the RAM tier. The daemon-level tests (a chat warm after its
runner's death) are in test_disk_cache_daemon.py."""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from runner import disk_cache
from runner.disk_cache import DiskTier, model_identity, probe_layout
from runner.disk_index import BLOCK_TOKENS, BlockStore, BlockTree, block_key, plan_blocks
from runner.kv_quant import make_cache
from runner.loading import LoadedModel, load_model
from runner.prefix_cache import PrefixCache
from test_kv_quant import tiny_kv  # noqa: F401  (a fixture: builtin:tiny with 64-wide heads)

IDENTITY = "test-identity"


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("builtin:tiny", lambda phase, done, total: None)


def tokens_of(n: int, seed: int = 0) -> list[int]:
    """``n`` token ids (below builtin:tiny's vocabulary size)."""
    return [(seed * 7919 + i * 31 + i * i) % 250 + 3 for i in range(n)]


def prefill(model: LoadedModel, tokens: list[int], kv_bits: int | None = None) -> list[Any]:
    cache = make_cache(model.model, kv_bits)
    mx.eval(model.model(mx.array([tokens]), cache=cache))
    return cache


def greedy(model: LoadedModel, prompt: list[int], cache: list[Any], n: int = 12) -> list[int]:
    """``n`` greedy tokens after ``prompt``, from ``cache`` (which holds a
    prefix of ``prompt``)."""
    out: list[int] = []
    todo = prompt[cache[0].size():]
    for _ in range(n):
        logits = model.model(mx.array([todo]), cache=cache)
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        todo = [token]
    return out


class Tier:
    """A disk tier of builtin:tiny in ``root``, closed after the test."""

    def __init__(self, model: LoadedModel, root: Path, budget: int = 1 << 30,
                 kv_bits: int | None = None, **kwargs: Any) -> None:  # fmt: skip
        self.model = model
        self.new_cache = lambda: make_cache(model.model, kv_bits)
        layout = probe_layout(model.model, self.new_cache)
        assert not isinstance(layout, str)
        identity = model_identity(model.path, model.tokenizer, layout, kv_bits, 64)
        self.tier = DiskTier(root, budget, identity, layout, self.new_cache,
                             min_free_bytes=kwargs.pop("min_free_bytes", 0), **kwargs)  # fmt: skip

    def save(self, tokens: list[int], kv_bits: int | None = None) -> None:
        self.tier.save(tokens, prefill(self.model, tokens, kv_bits))
        assert self.tier.flush(30)


@pytest.fixture
def tiers(tiny: LoadedModel, tmp_path: Path) -> Iterator[list[Tier]]:
    made: list[Tier] = []
    yield made
    for tier in made:
        tier.tier.close()


def open_tier(tiers: list[Tier], model: LoadedModel, root: Path, **kwargs: Any) -> Tier:
    tier = Tier(model, root, **kwargs)
    tiers.append(tier)
    return tier


# --- the index ------------------------------------------------------------------------------


def test_blocks_end_at_multiples_of_the_block_size_and_a_next_turn_adds_only_its_tokens() -> None:
    tree = BlockTree()
    first = tokens_of(600)
    planned = plan_blocks(tree, IDENTITY, first)
    assert [(b.start, b.end) for b in planned] == [(0, 256), (256, 512), (512, 600)]
    assert [b.parent for b in planned] == [None, planned[0].key, planned[1].key]
    for block in planned:
        assert tree.add(block)
    longer = first + tokens_of(100, seed=1)
    assert [(b.start, b.end) for b in plan_blocks(tree, IDENTITY, longer)] == [(600, 700)]
    # Another chat leaving the first inside block 2 shares block 1, and its key says so.
    other = first[:300] + tokens_of(20, seed=2)
    again = plan_blocks(tree, IDENTITY, other)
    assert [(b.start, b.end) for b in again] == [(256, 320)]
    assert again[0].parent == planned[0].key
    assert tree.match(other, written_only=False) == ([planned[0], planned[1]], 300)
    assert tree.match(other, written_only=True) == ([], 0)  # none written yet


def test_a_key_names_the_model_and_the_whole_prefix() -> None:
    span = tuple(tokens_of(10))
    key = block_key(IDENTITY, None, span)
    assert key == block_key(IDENTITY, None, list(span))
    assert key != block_key("another model", None, span)
    assert key != block_key(IDENTITY, "a parent", span)
    assert key != block_key(IDENTITY, None, (*span[:-1], span[-1] + 1))


def test_removing_a_block_removes_the_blocks_after_it() -> None:
    tree = BlockTree()
    for block in plan_blocks(tree, IDENTITY, tokens_of(700)):
        tree.add(block)
    second = next(b for b in tree.blocks.values() if b.start == 256)
    assert [b.start for b in tree.remove(second.key)] == [256, 512]
    assert sorted(b.start for b in tree.blocks.values()) == [0]


# --- blocks on disk -------------------------------------------------------------------------


def test_blocks_are_read_back_exactly_and_answer_as_no_cache_does(
    tiny: LoadedModel, tmp_path: Path, tiers: list[Tier]
) -> None:
    tier = open_tier(tiers, tiny, tmp_path)
    history = tokens_of(600)
    computed = prefill(tiny, history)
    tier.tier.save(history, computed)
    assert tier.tier.flush(30)
    stats = tier.tier.stats()
    assert (stats.entries, stats.written, stats.pending) == (3, 3, 0)
    assert stats.save_s > 0 and stats.writer_cpu_s > 0
    assert stats.bytes == sum(p.stat().st_size for p in tier.tier.blocks_dir.glob("*/*"))

    # A new runner (a new tier on the same directory) finds them.
    fresh = open_tier(tiers, tiny, tmp_path)
    prompt = history + tokens_of(9, seed=3)
    restored = fresh.tier.restore(prompt, better_than=0)
    assert restored is not None
    kept, cache = restored
    assert kept == history and cache[0].size() == 600
    for stored, read in zip(computed, cache, strict=True):
        assert mx.array_equal(stored.keys[..., :600, :], read.keys).item()
        assert mx.array_equal(stored.values[..., :600, :], read.values).item()
    assert greedy(tiny, prompt, cache) == greedy(tiny, prompt, make_cache(tiny.model, None))
    stats = fresh.tier.stats()
    assert (stats.hits, stats.tokens_restored, stats.rejected) == (1, 600, 0)
    # Nothing more than RAM already holds: no read.
    assert fresh.tier.restore(prompt, better_than=600) is None


def test_a_prompt_leaving_a_block_midway_takes_its_start(
    tiny: LoadedModel, tmp_path: Path, tiers: list[Tier]
) -> None:
    tier = open_tier(tiers, tiny, tmp_path)
    tier.save(tokens_of(600))
    prompt = tokens_of(400) + tokens_of(30, seed=4)
    assert tier.tier.reuse(prompt) == 400
    prefix = PrefixCache(1 << 30, 16, disk=tier.tier)
    cache, reused = prefix.fetch(prompt)
    assert reused == 400 and cache is not None and cache[0].size() == 400
    assert greedy(tiny, prompt, cache) == greedy(tiny, prompt, make_cache(tiny.model, None))
    assert prefix.index.stats.entries == 1  # promoted: the blocks read, 512 tokens, in RAM
    assert prefix.index.keys()[0] == tuple(tokens_of(512))


def test_a_quantized_cache_round_trips_and_is_another_identity(
    tiny_kv: LoadedModel, tmp_path: Path, tiers: list[Tier]  # noqa: F811
) -> None:
    plain = open_tier(tiers, tiny_kv, tmp_path)
    quantized = open_tier(tiers, tiny_kv, tmp_path, kv_bits=8)
    assert quantized.tier.directory != plain.tier.directory
    history = tokens_of(300)
    computed = prefill(tiny_kv, history, kv_bits=8)
    quantized.tier.save(history, computed)
    assert quantized.tier.flush(30)
    assert plain.tier.reuse([*history, 5]) == 0
    restored = quantized.tier.restore([*history, 5], better_than=0)
    assert restored is not None
    _, cache = restored
    assert type(cache[0]).__name__ == "QuantizedKV" and cache[0].kv_bits == 8
    for stored, read in zip(computed, cache, strict=True):
        for a, b in zip(stored.keys, read.keys, strict=True):
            assert mx.array_equal(a[..., :300, :], b).item()


def test_every_part_of_the_identity_changes_it(tiny: LoadedModel, tmp_path: Path) -> None:
    layout = probe_layout(tiny.model, lambda: make_cache(tiny.model, None))
    assert not isinstance(layout, str)
    copy = tmp_path / "copy"
    shutil.copytree(tiny.path, copy, copy_function=shutil.copy2)  # same times

    def digest(path: Path = copy, tokenizer: Any = tiny.tokenizer, layout: Any = layout,
               kv_bits: int | None = None) -> str:  # fmt: skip
        return model_identity(path, tokenizer, layout, kv_bits, 64)[0]

    base = digest()
    assert base == digest(tiny.path)  # where the files are is not part of it
    assert digest(kv_bits=8) != base
    assert digest(layout=[{**layer, "k": (layer["k"][0], "float32")} for layer in layout]) != base

    class Templated:
        chat_template = "{{ messages }}"

    assert digest(tokenizer=Templated()) != base
    config = copy / "tokenizer_config.json"
    config.write_text(config.read_text().replace("}", ', "x": 1}', 1))
    assert digest() != base
    shutil.copy2(tiny.path / "tokenizer_config.json", config)
    assert digest() == base
    weights = next(copy.glob("*.safetensors"))
    weights.touch()  # rewritten in place (same shapes): another model
    assert digest() != base


# --- damaged blocks -------------------------------------------------------------------------


def damage_case(name: str, tier: DiskTier) -> str:
    """Damage the second block of the directory as ``name`` says; return the
    reason the tier should give."""
    store = BlockStore(tier.directory / "index.sqlite")
    key = next(b.key for _, b in store.rows() if b.start == BLOCK_TOKENS)
    path = tier.blocks_dir / key[:2] / f"{key}.safetensors"
    data = bytearray(path.read_bytes())
    reason = name
    if name == "checksum":
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif name == "truncated":
        path.write_bytes(bytes(data[: len(data) // 3]))
    elif name == "missing":
        path.unlink()
    elif name == "stale index":  # the row is of an older file than the one there
        other = next(b.key for _, b in store.rows() if b.start == 0)
        shutil.copy(tier.blocks_dir / other[:2] / f"{other}.safetensors", path)
        with sqlite3.connect(tier.directory / "index.sqlite") as db:
            db.execute("UPDATE blocks SET nbytes = ? WHERE key = ?", (path.stat().st_size, key))
        reason = "checksum"
    elif name == "lying index":  # the checksum fits the bytes, but they are another block's
        other = next(b.key for _, b in store.rows() if b.start == 0)
        shutil.copy(tier.blocks_dir / other[:2] / f"{other}.safetensors", path)
        checksum = hashlib.sha256(path.read_bytes()).hexdigest()
        with sqlite3.connect(tier.directory / "index.sqlite") as db:
            db.execute("UPDATE blocks SET nbytes = ?, checksum = ? WHERE key = ?",
                       (path.stat().st_size, checksum, key))  # fmt: skip
        reason = "key"
    store.close()
    return reason


@pytest.mark.parametrize("case", ["checksum", "truncated", "missing", "stale index", "lying index"])
def test_a_damaged_block_is_rejected_with_those_after_it_and_its_tokens_recomputed(
    case: str, tiny: LoadedModel, tmp_path: Path, tiers: list[Tier]
) -> None:
    first = open_tier(tiers, tiny, tmp_path)
    first.save(tokens_of(700))
    reason = damage_case(case, first.tier)
    fresh = open_tier(tiers, tiny, tmp_path)  # a new runner
    prompt = [*tokens_of(700), 7]
    prefix = PrefixCache(1 << 30, 16, disk=fresh.tier)
    cache, reused = prefix.fetch(prompt)
    assert reused == BLOCK_TOKENS and cache is not None  # the first block, and no more
    assert greedy(tiny, prompt, cache) == greedy(tiny, prompt, make_cache(tiny.model, None))
    stats = fresh.tier.stats()
    assert (stats.rejected, stats.rejected_by) == (1, {reason: 1})
    assert stats.entries == 1  # the damaged block and the one after it are gone, files too
    assert len(list(fresh.tier.blocks_dir.glob("*/*.safetensors"))) == 1
    assert fresh.tier.restore(prompt, better_than=BLOCK_TOKENS) is None


# --- limits ---------------------------------------------------------------------------------


def test_a_nearly_full_disk_stops_writes_without_failing(
    tiny: LoadedModel, tmp_path: Path, tiers: list[Tier]
) -> None:
    tier = open_tier(tiers, tiny, tmp_path, min_free_bytes=1 << 62)
    tier.save(tokens_of(300))
    stats = tier.tier.stats()
    # The first block is skipped; the one after it, with no parent on disk, goes with it.
    assert (stats.skipped, stats.written, stats.write_errors, stats.entries) == (1, 0, 0, 0)
    assert tier.tier.tree.blocks == {}  # nothing pending is left to build on


def test_a_failed_write_is_counted_and_the_writer_goes_on(
    tiny: LoadedModel, tmp_path: Path, tiers: list[Tier], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier(tiers, tiny, tmp_path)
    real = mx.save_safetensors
    calls = []

    def full_once(path: str, *args: Any, **kwargs: Any) -> None:
        calls.append(path)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, *args, **kwargs)

    monkeypatch.setattr(disk_cache.mx, "save_safetensors", full_once)
    tier.save(tokens_of(300))  # the first block fails: the second has no parent on disk
    stats = tier.tier.stats()
    assert (stats.write_errors, stats.written, stats.entries) == (1, 0, 0)
    assert not list(tier.tier.blocks_dir.glob("*/.*"))  # no temporary file left
    tier.save(tokens_of(300))
    assert tier.tier.stats().entries == 2


def test_the_budget_evicts_the_least_recently_used_chat_as_ram_hits_say(
    tiny: LoadedModel, tmp_path: Path, tiers: list[Tier]
) -> None:
    tier = open_tier(tiers, tiny, tmp_path)
    chats = {name: tokens_of(200, seed=seed) for seed, name in enumerate("abc", start=10)}
    for tokens in chats.values():
        tier.save(tokens)
    one_chat = tier.tier.stats().bytes // 3
    prefix = PrefixCache(1 << 30, 16, disk=tier.tier)
    for tokens in chats.values():
        prefix.store(tokens, prefill(tiny, tokens))  # in RAM too (already on disk)
    prefix.fetch(chats["a"] + [5])  # a RAM hit: chat a is now the most recent on disk too
    tier.tier.budget_bytes = 3 * one_chat + one_chat // 2
    tier.save(tokens_of(200, seed=99))  # a fourth chat: one must go, and it is b
    assert tier.tier.reuse(chats["a"]) == 200 and tier.tier.reuse(chats["c"]) == 200
    assert tier.tier.reuse(chats["b"]) == 0
    assert tier.tier.stats().evictions == 1


def test_clearing_drops_every_block_and_its_files(
    tiny: LoadedModel, tmp_path: Path, tiers: list[Tier]
) -> None:
    tier = open_tier(tiers, tiny, tmp_path)
    tier.save(tokens_of(600))
    prefix = PrefixCache(1 << 30, 16, disk=tier.tier)
    prefix.store(tokens_of(20, seed=5), prefill(tiny, tokens_of(20, seed=5)))
    assert tier.tier.flush(30)
    stats = tier.tier.stats()
    assert prefix.clear(ram=False) == (0, 0, stats.entries, stats.bytes)
    assert prefix.index.stats.entries == 1  # disk only: RAM keeps its entry
    assert tier.tier.stats().entries == 0 and not list(tier.tier.blocks_dir.glob("*/*"))
    assert open_tier(tiers, tiny, tmp_path).tier.restore(tokens_of(601), 0) is None


# --- writers: killed, and two at once -------------------------------------------------------

KILLED_WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    sys.path[:0] = [sys.argv[3]]
    from test_disk_cache import Tier, tokens_of
    from runner.faults import Faults
    from runner.loading import load_model
    model = load_model(sys.argv[4], lambda *a: None)
    faults = Faults(f"kill_in_disk_write={sys.argv[2]}")
    Tier(model, Path(sys.argv[1]), fault=faults.disk_write).save(tokens_of(300))
    sys.exit(3)  # not reached: the writer kills the process
""")


@pytest.mark.parametrize("stage", ["tmp_written", "renamed", "recorded"])
def test_a_writer_killed_at_any_stage_leaves_no_block_that_can_be_read_wrong(
    stage: str, tiny: LoadedModel, tmp_path: Path, tiers: list[Tier],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, str(tmp_path), stage, str(Path(__file__).parent),
         str(tiny.path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == -9, done.stderr
    monkeypatch.setattr(disk_cache, "ORPHAN_AGE_S", 0.0)  # the sweep takes any orphan
    fresh = open_tier(tiers, tiny, tmp_path)
    fresh.tier.flush(30)
    (directory,) = tmp_path.iterdir()
    files = {p.name for p in (directory / "blocks").glob("*/*")}
    recorded = {b.key for _, b in BlockStore(directory / "index.sqlite").rows()}
    # Only whole, recorded blocks are left; the sweep took the killed write's file.
    assert {name.split(".")[0] for name in files} == recorded
    assert len(recorded) == (1 if stage == "recorded" else 0)
    prompt = [*tokens_of(300), 9]
    prefix = PrefixCache(1 << 30, 16, disk=fresh.tier)
    cache, reused = prefix.fetch(prompt)
    assert reused == (BLOCK_TOKENS if stage == "recorded" else 0)
    assert fresh.tier.stats().rejected == 0
    start = cache if cache is not None else make_cache(tiny.model, None)
    assert greedy(tiny, prompt, start) == greedy(tiny, prompt, make_cache(tiny.model, None))


def test_two_runners_of_one_model_write_and_read_the_same_blocks(
    tiny: LoadedModel, tmp_path: Path, tiers: list[Tier]
) -> None:
    one, two = open_tier(tiers, tiny, tmp_path), open_tier(tiers, tiny, tmp_path)
    shared = tokens_of(600)
    one.tier.save(shared, prefill(tiny, shared))  # both writer threads write at once
    two.tier.save(shared, prefill(tiny, shared))
    assert one.tier.flush(30) and two.tier.flush(30)
    assert one.tier.stats().write_errors == two.tier.stats().write_errors == 0
    assert len(list(one.tier.blocks_dir.glob("*/*.safetensors"))) == 3  # one file per block
    # Each finds what the other wrote after it opened the directory.
    own = one.tier.stats().written
    extra = tokens_of(300, seed=8)
    two.tier.save(shared + extra, prefill(tiny, shared + extra))
    assert two.tier.flush(30)
    restored = one.tier.restore(shared + extra + [1], better_than=0)
    assert restored is not None and len(restored[0]) == 900
    assert one.tier.stats().written == own and one.tier.stats().rejected == 0


def test_a_model_whose_cache_cannot_be_cut_has_no_disk_tier() -> None:
    from mlx_lm.models.cache import RotatingKVCache

    class Windowed:
        def make_cache(self) -> list[Any]:
            return [KVCache(), RotatingKVCache(max_size=8)]

    why = probe_layout(Windowed(), Windowed().make_cache)
    assert isinstance(why, str) and "RotatingKVCache" in why


def test_the_index_file_names_what_it_holds(tiny: LoadedModel, tmp_path: Path,
                                           tiers: list[Tier]) -> None:  # fmt: skip
    tier = open_tier(tiers, tiny, tmp_path)
    described = json.loads((tier.tier.directory / "identity.json").read_text())
    assert described["model"] == str(tiny.path) and described["kv_bits"] is None
    assert len(described["layout"]) == len(tiny.model.layers)


# --- what a review found (each failed before its fix) ---------------------------------------


def test_an_unreadable_index_or_undeletable_file_costs_a_recompute_not_the_request(
    tiny: LoadedModel, tmp_path: Path, tiers: list[Tier], monkeypatch: pytest.MonkeyPatch
) -> None:
    first = open_tier(tiers, tiny, tmp_path)
    first.save(tokens_of(700))
    damage_case("checksum", first.tier)
    fresh = open_tier(tiers, tiny, tmp_path)
    prompt = [*tokens_of(700), 7]

    def denied(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(Path, "unlink", denied)
    prefix = PrefixCache(1 << 30, 16, disk=fresh.tier)
    _, reused = prefix.fetch(prompt)  # the damaged block cannot be deleted: no matter
    assert reused == BLOCK_TOKENS
    assert fresh.tier.clear()[0] >= 1  # nor can a clear's files: it clears the index
    monkeypatch.undo()

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise sqlite3.OperationalError("disk I/O error")

    other = open_tier(tiers, tiny, tmp_path)
    other.save(tokens_of(300, seed=3))
    monkeypatch.setattr(BlockStore, "generation", broken)
    assert PrefixCache(1 << 30, 16, disk=other.tier).fetch([*tokens_of(300, seed=3), 1])[1] == 300


def test_a_runner_sees_another_runners_clear_and_new_blocks(
    tiny: LoadedModel, tmp_path: Path, tiers: list[Tier]
) -> None:
    one, two = open_tier(tiers, tiny, tmp_path), open_tier(tiers, tiny, tmp_path)
    old, new = tokens_of(300), tokens_of(300, seed=4)
    one.save(old)
    assert two.tier.restore([*old, 1], 0) is not None  # two learns old
    one.tier.clear()
    one.save(new)  # its rows come after the deleted ones (they were reused before)
    assert two.tier.restore([*new, 1], 0) is not None
    assert two.tier.reuse(old) == 0  # and the cleared blocks are forgotten, not "missing"
    assert two.tier.stats().rejected == 0


def test_a_block_written_twice_keeps_the_first_file_and_its_checksum(
    tiny: LoadedModel, tmp_path: Path, tiers: list[Tier]
) -> None:
    one, two = open_tier(tiers, tiny, tmp_path), open_tier(tiers, tiny, tmp_path)
    tokens = tokens_of(200)
    one.save(tokens)
    other = prefill(tiny, tokens)  # the same tokens, bytes that differ in the last bits
    other[0].keys = other[0].keys * (1 + 1e-6)
    two.tier.save(tokens, other)  # two planned before it read the index: it writes too
    assert two.tier.flush(30) and two.tier.stats().write_errors == 0
    third = open_tier(tiers, tiny, tmp_path)
    restored = third.tier.restore([*tokens, 1], 0)
    assert restored is not None and third.tier.stats().rejected == 0
    assert mx.array_equal(restored[1][0].keys, prefill(tiny, tokens)[0].keys[..., :200, :]).item()


def test_eviction_keeps_the_prefix_chats_share(
    tiny: LoadedModel, tmp_path: Path, tiers: list[Tier]
) -> None:
    tier = open_tier(tiers, tiny, tmp_path)
    shared = tokens_of(BLOCK_TOKENS)
    chats = [[*shared, *tokens_of(40, seed=seed)] for seed in range(3)]
    for chat in chats:
        tier.save(chat)
    stats = tier.tier.stats()
    tail = (stats.bytes - tier.tier.tree.match(shared, written_only=True)[0][0].nbytes) // 3
    tier.tier.budget_bytes = stats.bytes - tail // 2  # one chat's own block must go
    tier.save([*shared, *tokens_of(40, seed=9)])
    assert tier.tier.reuse(shared) == BLOCK_TOKENS  # the shared block stays
    assert sum(tier.tier.reuse(chat) == len(chat) for chat in chats) == 1  # the oldest two went
    assert tier.tier.stats().evictions == 2


def test_ram_hits_reach_the_index_for_the_next_runner(
    tiny: LoadedModel, tmp_path: Path, tiers: list[Tier]
) -> None:
    tier = open_tier(tiers, tiny, tmp_path)
    tier.save(tokens_of(100))
    with sqlite3.connect(tier.tier.directory / "index.sqlite") as db:
        (before,) = db.execute("SELECT last_used FROM blocks").fetchone()
    tier.tier.touch_prefix(tokens_of(100))
    tier.tier.close()
    with sqlite3.connect(tier.tier.directory / "index.sqlite") as db:
        (after,) = db.execute("SELECT last_used FROM blocks").fetchone()
    assert after > before


def test_a_writer_that_cannot_start_stops_the_tier_without_holding_saves(
    tiny: LoadedModel, tmp_path: Path, tiers: list[Tier], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = disk_cache.BlockStore
    opened: list[int] = []

    def second_fails(path: Path) -> BlockStore:
        opened.append(1)
        if len(opened) == 2:  # the writer thread's own connection
            raise sqlite3.OperationalError("unable to open database file")
        return real(path)

    monkeypatch.setattr(disk_cache, "BlockStore", second_fails)
    tier = open_tier(tiers, tiny, tmp_path)
    tier.tier._thread.join(10)
    assert tier.tier.broken is not None and "index" in tier.tier.broken
    assert tier.tier.save(tokens_of(300), prefill(tiny, tokens_of(300))) == 0
    assert tier.tier.flush(1) and tier.tier.stats().reason == tier.tier.broken


# --- what a second review found (each failed before its fix) --------------------------------


def test_queued_blocks_survive_another_runners_clear_once_each(
    tiny: LoadedModel, tmp_path: Path, tiers: list[Tier]
) -> None:
    one, two = open_tier(tiers, tiny, tmp_path), open_tier(tiers, tiny, tmp_path)
    with one.tier._io:  # the writer waits: the three blocks stay queued
        one.tier.save(tokens_of(600), prefill(tiny, tokens_of(600)))
        two.tier.clear()  # the index's generation moves
        one.tier._refresh()  # rebuilt, with its queued blocks on it again
        children = [child for block in one.tier.tree.blocks.values()
                    for group in block.children.values() for child in group]  # fmt: skip
        assert len(children) == len({id(child) for child in children}) == 2
    assert one.tier.flush(30) and one.tier.broken is None
    assert one.tier.stats().entries == 3


def test_a_writer_that_fails_holding_a_block_leaves_nothing_pending(
    tiny: LoadedModel, tmp_path: Path, tiers: list[Tier], monkeypatch: pytest.MonkeyPatch
) -> None:
    def bug(self: DiskTier, store: BlockStore, write: Any) -> bool:
        raise RuntimeError("a bug in the writer")

    monkeypatch.setattr(DiskTier, "_write_guarded", bug)
    tier = open_tier(tiers, tiny, tmp_path)
    tier.tier.save(tokens_of(300), prefill(tiny, tokens_of(300)))
    assert tier.tier.flush(10)  # not waiting forever on the block the writer held
    assert tier.tier.broken is not None and "a bug in the writer" in tier.tier.broken
    assert tier.tier.stats().pending == 0


def test_another_identity_without_an_index_does_not_turn_this_one_off(
    tiny: LoadedModel, tmp_path: Path, tiers: list[Tier]
) -> None:
    other = tmp_path / ("0" * 32)
    other.mkdir()
    (other / "identity.json").write_text("{}")
    tier = open_tier(tiers, tiny, tmp_path)
    tier.save(tokens_of(100))
    assert tier.tier.stats().entries == 1 and other.exists()  # new enough: kept


def test_a_block_whose_parent_was_evicted_meanwhile_is_not_recorded(
    tiny: LoadedModel, tmp_path: Path, tiers: list[Tier]
) -> None:
    stages: list[str] = []

    def evict_parent(stage: str) -> None:  # another runner evicts the first block
        stages.append(stage)
        if stage == "renamed" and stages.count("renamed") == 2:
            store = BlockStore(tier.tier.directory / "index.sqlite")
            (first,) = [b.key for _, b in store.rows() if b.start == 0]
            store.delete_subtrees([first])
            store.close()

    tier = open_tier(tiers, tiny, tmp_path, fault=evict_parent)
    tier.save(tokens_of(300))
    store = BlockStore(tier.tier.directory / "index.sqlite")
    assert store.totals()[0] == 0  # no row a runner could never use
    store.close()
    assert len(list(tier.tier.blocks_dir.glob("*/*.safetensors"))) == 1  # the parent's, only

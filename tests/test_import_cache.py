"""transformers' import table kept on disk: the same table, read back, or the
original scan whenever the file cannot be trusted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from runner import import_cache
from runner.import_cache import ImportStructure, cached, decode, encode

STRUCTURE: ImportStructure = {
    frozenset(): {"models.a.configuration_a": {"AConfig", "ATextConfig"}},
    frozenset({"tokenizers"}): {"models.a.tokenization_a_fast": {"ATokenizer"}},
}


def test_a_table_reads_back_as_it_was_written_and_only_for_its_key() -> None:
    data = encode(STRUCTURE, "key-1")
    assert decode(data, "key-1") == STRUCTURE
    assert decode(data, "key-2") is None
    assert decode(b"not json", "key-1") is None
    assert decode(b'{"format": 99, "key": "key-1", "entries": []}', "key-1") is None


class Scans:
    """A stand-in for transformers' ``define_import_structure`` that counts its scans."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module_path: Any, prefix: str | None = None) -> ImportStructure:
        self.calls += 1
        return {k: {m: set(n) for m, n in v.items()} for k, v in STRUCTURE.items()}


def package(path: Path, files: int) -> Path:
    path.mkdir()
    for i in range(files):
        (path / f"module_{i}.py").write_text("")
    return path


def test_a_big_directory_is_scanned_once_then_read_from_the_cache(tmp_path: Path) -> None:
    scans, store = Scans(), tmp_path / "cache"
    define = cached(scans, "1.0", store)
    models = package(tmp_path / "models", 40)

    assert define(models, prefix="models") == STRUCTURE
    assert define(models, prefix="models") == STRUCTURE
    assert define(models / "__init__.py", prefix="models") == STRUCTURE  # a file: its directory
    assert scans.calls == 1
    assert len(list(store.iterdir())) == 1

    (models / "module_new.py").write_text("")  # the directory changed: scanned again
    assert define(models, prefix="models") == STRUCTURE
    assert scans.calls == 2
    assert cached(scans, "2.0", store)(models, prefix="models") == STRUCTURE  # another version
    assert scans.calls == 3


def test_an_edit_deep_inside_the_tree_is_scanned_again(tmp_path: Path) -> None:
    """An editable or git transformers changes files in a model's directory at
    the same version, which leaves ``models/`` itself as it was."""
    scans, store = Scans(), tmp_path / "cache"
    define = cached(scans, "1.0", store)
    models = package(tmp_path / "models", 40)
    llama = package(models / "llama", 3)
    define(models)
    source = llama / "module_1.py"
    source.write_text("EXPORTED = 1\n")
    later = source.stat().st_mtime_ns + 10**9  # whatever the file system's clock grain
    os.utime(source, ns=(later, later))
    define(models)
    assert scans.calls == 2
    define(models)
    assert scans.calls == 2


def test_compiled_files_do_not_count_but_a_renamed_module_does(tmp_path: Path) -> None:
    """A venv installed without bytecode writes ``__pycache__`` on the first
    imports: that is no change to the sources, and must not cost another scan.
    A module renamed keeps its mtime and the count: its name still counts."""
    scans, store = Scans(), tmp_path / "cache"
    define = cached(scans, "1.0", store)
    models = package(tmp_path / "models", 40)
    llama = package(models / "llama", 3)
    define(models)
    for directory in (models, llama):
        compiled = directory / "__pycache__"
        compiled.mkdir()
        (compiled / "module_1.cpython-312.pyc").write_bytes(b"compiled")
    (llama / "stray.pyc").write_bytes(b"compiled")
    later = time.time() + 5
    os.utime(llama, (later, later))  # as the new entries left it, whatever the clock grain
    define(models)
    assert scans.calls == 1
    (llama / "module_1.py").rename(llama / "module_9.py")
    define(models)
    assert scans.calls == 2


def test_a_file_replaced_with_an_old_mtime_or_two_modules_swapped_are_changes(
    tmp_path: Path,
) -> None:
    """``cp -p``, tar, rsync and hard-linking installers keep a file's old
    mtime, and a swap keeps every name: the sources changed all the same,
    and only their change times (ctime) say so."""
    scans, store = Scans(), tmp_path / "cache"
    define = cached(scans, "1.0", store)
    models = package(tmp_path / "models", 40)
    one, two = models / "module_1.py", models / "module_2.py"
    one.write_text("A = 1\n")
    two.write_text("B = 2\n")
    mtime = one.stat().st_mtime_ns - 10**12
    for source in (one, two):
        os.utime(source, ns=(mtime, mtime))
    define(models)
    changed = max(one.stat().st_ctime_ns, two.stat().st_ctime_ns)
    probe = tmp_path / "probe"
    probe.write_text("")
    while probe.stat().st_ctime_ns <= changed:  # a coarse file-system clock ticks on
        os.utime(probe)
    replacement = tmp_path / "module_1.py"
    replacement.write_text("C = 3\n")  # the same size
    os.utime(replacement, ns=(mtime, mtime))
    replacement.replace(one)
    define(models)
    assert scans.calls == 2
    two.rename(models / "swap.py")
    one.rename(two)
    (models / "swap.py").rename(one)
    define(models)
    assert scans.calls == 3
    define(models)
    assert scans.calls == 3


def test_files_of_another_transformers_are_pruned_after_a_month(tmp_path: Path) -> None:
    scans, store = Scans(), tmp_path / "cache"
    models = package(tmp_path / "models", 40)
    cached(scans, "1.0", store)(models)
    (old,) = store.iterdir()
    month_ago = time.time() - 31 * 86400
    os.utime(old, (month_ago, month_ago))
    cached(scans, "1.1", store)(models)  # writes its own, prunes the stale one
    assert [f.name for f in store.iterdir()] != [old.name]
    assert len(list(store.iterdir())) == 1


def test_install_never_raises(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A runner without a home directory (no HOME, no passwd entry) starts
    the slow way rather than not at all."""
    monkeypatch.delenv(import_cache.ENV, raising=False)
    monkeypatch.delitem(sys.modules, import_cache.MODULE, raising=False)

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(import_cache, "cache_root", no_home)
    before = list(sys.meta_path)
    assert not import_cache.install()
    assert sys.meta_path == before


def test_a_damaged_cache_file_is_scanned_again_and_rewritten(tmp_path: Path) -> None:
    scans, store = Scans(), tmp_path / "cache"
    define = cached(scans, "1.0", store)
    models = package(tmp_path / "models", 40)
    define(models)
    (file,) = store.iterdir()
    file.write_bytes(b'{"format": 1, "key": "truncat')
    assert define(models) == STRUCTURE
    assert scans.calls == 2
    assert json.loads(file.read_bytes())["entries"]  # whole again
    assert define(models) == STRUCTURE
    assert scans.calls == 2


def test_a_call_with_arguments_it_does_not_know_goes_to_the_original(tmp_path: Path) -> None:
    seen: list[tuple[Any, ...]] = []

    def original(*args: Any, **kwargs: Any) -> ImportStructure:
        seen.append((args, kwargs))
        return STRUCTURE

    define = cached(original, "1.0", tmp_path / "cache")
    models = package(tmp_path / "models", 40)
    assert define(models, "models", backend="x") == STRUCTURE
    assert seen == [((models, "models"), {"backend": "x"})]
    assert not (tmp_path / "cache").exists()


def test_a_small_package_is_scanned_as_before_and_never_stored(tmp_path: Path) -> None:
    scans, store = Scans(), tmp_path / "cache"
    define = cached(scans, "1.0", store)
    small = package(tmp_path / "llama", 4)
    define(small / "__init__.py")
    define(small / "__init__.py")
    assert scans.calls == 2
    assert not store.exists()


CHECK_REAL = """
import sys
from pathlib import Path
from runner import import_cache
assert import_cache.install(Path(sys.argv[1]))
import transformers
from transformers.utils import import_utils
scanned = import_utils.create_import_structure_from_path.cache_info().misses
models = Path(transformers.__file__).parent / "models"
ours = import_utils.define_import_structure(models, prefix="models")
assert ours == import_utils.define_import_structure.__wrapped__(models, prefix="models")
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])
assert tokenizer.encode("hello world")
print(scanned)
"""


def test_transformers_imports_with_the_same_table_from_the_cache(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A first process scans and stores; a second reads the table back and
    scans (nearly) nothing; in both, the table equals transformers' own."""
    store = tmp_path / "import-cache"
    scanned = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", CHECK_REAL, str(store), str(tiny_model_dir)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        scanned.append(int(done.stdout.split()[-1]))
    assert list(store.iterdir())
    assert scanned[0] > 400  # models/ and each model's directory
    assert scanned[1] < 20  # only the packages imported for real


def test_the_switch_turns_it_off(tmp_path: Path) -> None:
    """In a fresh process, where transformers is not imported yet (in this one
    it may be, and install() would say no for that reason alone)."""
    check = (
        "import sys; from pathlib import Path; from runner import import_cache; "
        "on = import_cache.install(Path(sys.argv[1])); "
        "print(on, any(isinstance(f, import_cache._Patcher) for f in sys.meta_path))"
    )
    for switch, expected in (("1", "True True"), ("0", "False False")):
        done = subprocess.run(
            [sys.executable, "-c", check, str(tmp_path)],
            capture_output=True, text=True, timeout=60, check=False,
            env={**os.environ, import_cache.ENV: switch},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == expected.split()


@pytest.fixture
def tiny_model_dir() -> Path:
    from runner.builtin import ensure_builtin_model

    return ensure_builtin_model("builtin:tiny")

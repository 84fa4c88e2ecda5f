"""transformers' import table kept on disk: the same table, read back, or the
original scan whenever the file cannot be trusted."""

from __future__ import annotations

import json
import subprocess
import sys
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


def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(import_cache.ENV, "0")
    assert not import_cache.install(tmp_path)
    assert not any(isinstance(f, import_cache._Patcher) for f in sys.meta_path)


@pytest.fixture
def tiny_model_dir() -> Path:
    from runner.builtin import ensure_builtin_model

    return ensure_builtin_model("builtin:tiny")

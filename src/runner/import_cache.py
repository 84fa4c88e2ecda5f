"""Keep transformers' lazy-import table on disk, so a runner starts in half the time.

``import mlx_lm`` costs a runner about 2 s of CPU, and most of that is not
mlx: ``import transformers`` builds the table of what each of its ~1,100
model modules exports (``define_import_structure``) by reading some 3,300
source files, in every process, every time. The table depends only on the
installed transformers, so the first runner writes it to the user's cache
(``$XDG_CACHE_HOME/mlx-supervisor/import-cache/``) and later runners read it:
a restart, a hot spare or a rank then starts in about 0.8 s instead of 2 s.

It is an optimisation and nothing else: a file keyed by the transformers
version, the directory and the number, names, sizes and change times of the
sources in its tree; written atomically; read as JSON (never pickle); and on
any surprise (another transformers layout, an unreadable or foreign file)
the original function runs as if this module did not exist.
``MLX_SUPERVISOR_IMPORT_CACHE=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import structlog

from modelfiles.cache import cache_root

log = structlog.get_logger("runner.import_cache")

ENV = "MLX_SUPERVISOR_IMPORT_CACHE"
MODULE = "transformers.utils.import_utils"
FORMAT = 1
MIN_ENTRIES = 32  # a directory with fewer entries is scanned as before (models/: ~450)
PRUNE_AFTER_S = 30 * 86400

# What ``define_import_structure`` returns: backends -> module -> exported names.
ImportStructure = dict[frozenset[str], dict[str, set[str]]]


class _Entry(msgspec.Struct):
    backends: list[str]
    modules: dict[str, list[str]]


class _CacheFile(msgspec.Struct):
    format: int
    key: str
    entries: list[_Entry]


def encode(structure: ImportStructure, key: str) -> bytes:
    entries = [
        _Entry(sorted(backends), {module: sorted(names) for module, names in modules.items()})
        for backends, modules in structure.items()
    ]
    return msgspec.json.encode(_CacheFile(FORMAT, key, entries))


def decode(data: bytes, key: str) -> ImportStructure | None:
    """The table in ``data`` if it is one, written for ``key``; else None."""
    try:
        cached = msgspec.json.decode(data, type=_CacheFile)
    except msgspec.DecodeError:
        return None
    if cached.format != FORMAT or cached.key != key:
        return None
    return {
        frozenset(entry.backends): {module: set(names) for module, names in entry.modules.items()}
        for entry in cached.entries
    }


def cache_key(version: str, directory: Path, prefix: str | None) -> str | None:
    """Changes when transformers or anything in the scanned tree does (an
    editable or git transformers edits files at the same version); None for a
    directory too small to be worth a file."""
    if sum(1 for _ in os.scandir(directory)) < MIN_ENTRIES:
        return None
    return f"{version}|{directory}|{prefix}|{tree_fingerprint(directory)}"


def tree_fingerprint(directory: Path) -> str:
    """The number of sources under ``directory`` and a checksum of each one's
    relative name, size and change time: ~16 ms for transformers' ``models/``
    (~2,600 sources), against ~1.2 s to scan it.

    A file's change time is the later of its mtime and ctime: ``cp -p``, tar,
    rsync and hard-linking installers keep an old mtime, but the replace, like
    a rename, sets the ctime, which cannot be set back. Compiled files
    (``__pycache__``, ``.pyc``) do not count, nor directories' own times,
    which the first imports change by writing them. A symlinked file counts
    by its target; a symlinked directory as an entry, not followed (nor does
    it hold transformers' sources in any install we know)."""
    count, checksum = 0, 0
    pending = [(str(directory), "")]
    while pending:
        path, relative = pending.pop()
        with os.scandir(path) as entries:
            for entry in entries:
                name = f"{relative}/{entry.name}"
                if entry.is_dir(follow_symlinks=False):
                    if entry.name != "__pycache__":
                        pending.append((entry.path, name))
                    continue
                if entry.name.endswith(".pyc"):
                    continue
                try:
                    stat = entry.stat()
                except OSError:  # a dangling symlink
                    stat = entry.stat(follow_symlinks=False)
                changed = max(stat.st_mtime_ns, stat.st_ctime_ns)
                count += 1
                checksum += zlib.crc32(f"{name}\0{stat.st_size}\0{changed}".encode())
    return f"{count}|{checksum & 0xFFFFFFFFFFFF:012x}"


def cached(
    original: Callable[..., ImportStructure], version: str, directory: Path
) -> Callable[..., ImportStructure]:
    """``original`` (transformers' ``define_import_structure``), answering from
    ``directory`` for a directory it has seen."""

    def define_import_structure(
        module_path: Any, prefix: str | None = None, *args: Any, **kwargs: Any
    ) -> ImportStructure:
        if args or kwargs:  # a newer transformers with more to say: not ours to cache
            return original(module_path, prefix, *args, **kwargs)
        try:
            path = Path(module_path)
            if not path.is_dir():  # a package's __init__.py: its directory is scanned
                path = path.parent
            key = cache_key(version, path.resolve(), prefix)
        except (OSError, TypeError, ValueError):
            return original(module_path, prefix)
        if key is None:  # a small package: not worth a file
            return original(module_path, prefix)
        file = directory / f"transformers-{_digest(key)}.json"
        with contextlib.suppress(OSError):
            structure = decode(file.read_bytes(), key)
            if structure is not None:
                return structure
        structure = original(module_path, prefix)
        with contextlib.suppress(OSError, TypeError, ValueError):
            _write_atomic(file, encode(structure, key))
            _prune(directory, keep=file)
        return structure

    define_import_structure.__wrapped__ = original  # type: ignore[attr-defined]
    return define_import_structure


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def _prune(directory: Path, keep: Path) -> None:
    """Drop the files nobody has written for a month: tables of transformers
    versions or trees that are gone (a file in use is read, not rewritten,
    so one still in use is at worst scanned and written again)."""
    stale = time.time() - PRUNE_AFTER_S
    for file in directory.glob("transformers-*.json"):
        with contextlib.suppress(OSError):
            if file != keep and file.stat().st_mtime < stale:
                file.unlink()


def _write_atomic(file: Path, data: bytes) -> None:
    file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, file)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class _Patcher(importlib.abc.MetaPathFinder):
    """Finds ``transformers.utils.import_utils`` with the other finders and,
    once it has run, swaps its ``define_import_structure`` for the cached one
    (before ``transformers/__init__`` imports the name)."""

    def __init__(self, version: str, directory: Path) -> None:
        self.version = version
        self.directory = directory

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != MODULE:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)  # once
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = spec.loader if spec is not None else None
        exec_module = getattr(loader, "exec_module", None)
        if spec is None or loader is None or exec_module is None:
            return spec
        version, directory = self.version, self.directory

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            original = getattr(module, "define_import_structure", None)
            if callable(original):
                vars(module)["define_import_structure"] = cached(original, version, directory)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def install(directory: Path | None = None) -> bool:
    """Serve transformers' import table from the cache in this process, if
    transformers is installed and not imported yet. Returns whether it did."""
    if os.environ.get(ENV, "1") == "0" or MODULE in sys.modules:
        return False
    try:
        version = importlib.metadata.version("transformers")
        if directory is None:
            directory = cache_root() / "import-cache"
    except Exception as exc:  # no transformers, no home directory: start the slow way
        log.debug("import_cache_off", reason=repr(exc))
        return False
    sys.meta_path.insert(0, _Patcher(version, directory))
    return True

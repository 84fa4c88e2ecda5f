"""Which BLAS a runner's mlx computes with on a Linux CPU.

mlx's Linux CPU wheel (``mlx-cpu``) ships netlib's reference BLAS, bundled by
auditwheel beside it (``mlx_cpu.libs/libblas-<hash>.so.3``). That library is
plain Fortran loops: a 64x576 by 576x1536 float32 matmul takes 44 ms with it
and 2.5 ms with OpenBLAS on the same two cores, and a model's prefill and
decode are such matmuls. Where the machine has OpenBLAS (Debian's
``libopenblas0-pthread``, Fedora's ``openblas``), a runner started with it
in ``LD_PRELOAD`` resolves mlx's ``cblas_*`` and LAPACK calls to it instead:
same results up to float rounding, ~10x the prefill speed of a small model.

``cpu_blas`` in the config: ``"auto"`` (the default: OpenBLAS when mlx bundles
the reference BLAS and OpenBLAS is found), ``"bundled"`` (what mlx ships), or
the path of a BLAS library to preload. macOS (Accelerate) and wheels without
the bundled reference library are left alone.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = [
    "AUTO",
    "BUNDLED",
    "CPU_BLAS_ENV",
    "bundled_reference_blas",
    "find_openblas",
    "preload_for",
    "runner_blas_env",
]

AUTO = "auto"
BUNDLED = "bundled"
CPU_BLAS_ENV = "MLX_SUPERVISOR_CPU_BLAS"
"""Overrides the config's ``cpu_blas`` (the tests pin ``bundled``: their
greedy tokens are compared with mlx-lm run in the test's own process)."""

OPENBLAS = "libopenblas.so.0"


def _lib_dirs() -> list[Path]:
    """Where distributions put OpenBLAS, the threaded build first."""
    arch = f"{platform.machine()}-linux-gnu"
    dirs: list[Path] = []
    for base in ("/usr/lib", "/usr/local/lib", "/lib"):
        dirs += [Path(base, arch, "openblas-pthread"), Path(base, arch), Path(base)]
    dirs += [Path("/usr/lib64"), Path("/usr/local/lib64")]
    return dirs


def find_openblas(dirs: Sequence[Path] | None = None) -> Path | None:
    """The first ``libopenblas.so.0`` in the usual library directories."""
    for folder in _lib_dirs() if dirs is None else dirs:
        candidate = folder / OPENBLAS
        if candidate.is_file():
            return candidate
    return None


def bundled_reference_blas(site: Path | None = None) -> Path | None:
    """The reference BLAS bundled with mlx's Linux CPU wheel, if that is the
    mlx installed (found without importing mlx: the daemon never does)."""
    if site is None:
        spec = importlib.util.find_spec("mlx")
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        if not locations:
            return None
        site = Path(locations[0]).parent
    libs = site / "mlx_cpu.libs"
    try:
        return next(iter(sorted(libs.glob("libblas-*.so*"))), None)
    except OSError:
        return None


def preload_for(
    setting: str,
    *,
    system: str = sys.platform,
    bundled: Path | None = None,
    openblas: Path | None = None,
) -> Path | None:
    """The library to preload into runners for the ``cpu_blas`` ``setting``,
    or None to leave mlx's own. ``bundled``/``openblas`` are looked up when
    not given (tests pass them)."""
    if setting == BUNDLED or not system.startswith("linux"):
        return None
    if setting != AUTO:
        return Path(setting)
    if (bundled if bundled is not None else bundled_reference_blas()) is None:
        return None
    return openblas if openblas is not None else find_openblas()


def runner_blas_env(setting: str, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What a local runner's environment gains for ``setting`` (the
    environment's ``MLX_SUPERVISOR_CPU_BLAS`` first): ``LD_PRELOAD`` with
    the library added in front of any the daemon already has, or nothing.

    Raises:
        ValueError: the setting names a library that is not a file (the
            load fails with this message, naming the key).
    """
    setting = environ.get(CPU_BLAS_ENV) or setting
    library = preload_for(setting)
    if library is None:
        return {}
    if setting != AUTO and not library.is_file():
        raise ValueError(f"cpu_blas: {library} is not a file (set a BLAS library, auto or bundled)")
    already = environ.get("LD_PRELOAD", "")
    return {"LD_PRELOAD": f"{library} {already}".strip()}

"""Offline "builtin" LoRA adapters, written: ``builtin:tiny-adapter`` and its sibling ``-b``.

Their recipes are in ``modelfiles.builtin_adapters``; this module writes them on first use into
the builtin cache directory, with weights from a fixed-seed numpy generator, so every machine
with the same library versions writes byte-identical files (built and renamed into place as the
builtin models are, see ``modelfiles.cache``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from modelfiles.builtin import builtin_cache_dir
from modelfiles.builtin_adapters import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    AdapterRecipe,
    adapter_recipe,
)
from modelfiles.cache import build_once, write_json
from modelfiles.safetensors import write_safetensors

__all__ = ["ensure_builtin_adapter"]


def ensure_builtin_adapter(reference: str, cache_dir: Path | None = None) -> Path:
    """The directory of builtin adapter ``reference`` (``builtin:NAME``), written on first use.

    Safe to call from several processes at once. Raises ValueError for an unknown name."""
    recipe = adapter_recipe(reference)
    root = Path(cache_dir) if cache_dir is not None else builtin_cache_dir()

    def write(out: Path) -> None:
        write_json(out / ADAPTER_CONFIG_NAME, recipe.config())
        _write_weights(recipe, out / ADAPTER_WEIGHTS_NAME)

    return build_once(root, recipe.dir_name, recipe.identity(), write,
                      required=ADAPTER_WEIGHTS_NAME)  # fmt: skip


def _write_weights(recipe: AdapterRecipe, path: Path) -> None:
    shapes = recipe.weight_shapes()
    data = (_init_tensor(recipe, name, shape).tobytes() for name, shape in shapes)
    write_safetensors(path, [(name, shape, "F32") for name, shape in shapes], data)


def _init_tensor(recipe: AdapterRecipe, name: str, shape: tuple[int, ...]) -> Any:
    """float32 values of one tensor, a pure function of the recipe's seed and the name."""
    import numpy as np

    digest = hashlib.sha256(f"{recipe.seed}:{name}".encode()).digest()
    rng = np.random.Generator(np.random.PCG64(int.from_bytes(digest[:16], "little")))
    std = recipe.b_std if name.endswith("lora_b") else 1.0 / float(np.sqrt(shape[0]))
    values = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    return np.ascontiguousarray(values, dtype="<f4")

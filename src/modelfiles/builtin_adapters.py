"""Offline "builtin" LoRA adapters, the recipes: random-weight adapters for the builtin models.

``builtin:tiny-adapter`` and ``builtin:tiny-adapter-b`` are LoRA adapters for ``builtin:tiny``,
laid out as ``mlx_lm.load(path, adapter_path=...)`` and mlx-lm's ``lora`` trainer write them: an
``adapter_config.json`` (``fine_tune_type``, ``num_layers``, ``lora_parameters`` with rank,
scale, dropout and the module keys) and an ``adapters.safetensors`` of ``lora_a`` and ``lora_b``
matrices. Their weights come from a fixed-seed numpy generator (``runner.builtin_adapters``
writes them), and ``lora_b`` is not zero (a freshly initialised adapter's is, and changes
nothing): each adapter changes a greedy answer, and the two change it differently, so tests can
tell which one served a request.

An adapter is not a model: these names are for a model's ``adapters`` config key, never for
``model``. Nothing here imports mlx or numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelfiles.builtin import BUILTIN_PREFIX, _resolve, builtin_cache_dir
from modelfiles.cache import is_complete

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "BUILTIN_ADAPTERS",
    "AdapterRecipe",
    "adapter_recipe",
    "built_builtin_adapter_dir",
    "is_builtin_adapter",
]

# Bump when anything that changes the written files changes; part of the directory name.
ADAPTER_RECIPE_VERSION = 1

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapters.safetensors"


@dataclass(frozen=True)
class AdapterRecipe:
    """One builtin LoRA adapter: the builtin model it is for, its shape and its seed."""

    name: str
    base: str  # the builtin model it adapts (a key of modelfiles.builtin's recipes)
    rank: int
    scale: float
    num_layers: int  # the last this many transformer layers get LoRA modules
    keys: tuple[str, ...]  # the modules of each layer that do
    seed: int
    # lora_a ~ N(0, 1/in) (as mlx-lm initialises it); lora_b ~ N(0, b_std^2): large enough
    # that the adapter changes greedy tokens of a random-weight model.
    b_std: float = 0.05

    @property
    def reference(self) -> str:
        return BUILTIN_PREFIX + self.name

    @property
    def dir_name(self) -> str:
        return f"adapter-{self.name}-v{ADAPTER_RECIPE_VERSION}"

    def identity(self) -> dict[str, Any]:
        """What the manifest of a build of this adapter must say."""
        return {"builtin_adapter": self.reference, "recipe_version": ADAPTER_RECIPE_VERSION}

    def config(self) -> dict[str, Any]:
        """``adapter_config.json``, as mlx-lm's trainer writes it (the keys load_adapters reads)."""
        return {
            "fine_tune_type": "lora",
            "num_layers": self.num_layers,
            "lora_parameters": {
                "rank": self.rank,
                "scale": self.scale,
                "dropout": 0.0,
                "keys": list(self.keys),
            },
            "model": BUILTIN_PREFIX + self.base,
            "mlx_supervisor_builtin_adapter": {
                "name": self.name,
                "recipe_version": ADAPTER_RECIPE_VERSION,
            },
        }

    def weight_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor of ``adapters.safetensors``: per adapted module, ``lora_a``
        (in, rank) and ``lora_b`` (rank, out), as mlx-lm's ``LoRALinear`` holds them."""
        spec = _resolve(self.base)
        d, hd = spec.hidden_size, spec.head_dim
        q_out, kv_out = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
        dims = {
            "self_attn.q_proj": (d, q_out),
            "self_attn.k_proj": (d, kv_out),
            "self_attn.v_proj": (d, kv_out),
            "self_attn.o_proj": (q_out, d),
            "mlp.gate_proj": (d, spec.intermediate_size),
            "mlp.up_proj": (d, spec.intermediate_size),
            "mlp.down_proj": (spec.intermediate_size, d),
        }
        shapes: list[tuple[str, tuple[int, ...]]] = []
        first = spec.num_hidden_layers - self.num_layers
        for layer in range(first, spec.num_hidden_layers):
            for key in self.keys:
                in_dims, out_dims = dims[key]
                prefix = f"model.layers.{layer}.{key}."
                shapes += [(prefix + "lora_a", (in_dims, self.rank)),
                           (prefix + "lora_b", (self.rank, out_dims))]  # fmt: skip
        return shapes


_ATTENTION_AND_MLP = (
    "self_attn.q_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.down_proj",
)

BUILTIN_ADAPTERS: dict[str, AdapterRecipe] = {
    "tiny-adapter": AdapterRecipe(
        name="tiny-adapter", base="tiny", rank=8, scale=4.0, num_layers=2,
        keys=_ATTENTION_AND_MLP, seed=0xADA1,
    ),
    # A second one with other weights, for tests of switching between adapters.
    "tiny-adapter-b": AdapterRecipe(
        name="tiny-adapter-b", base="tiny", rank=4, scale=4.0, num_layers=1,
        keys=_ATTENTION_AND_MLP, seed=0xADA2,
    ),
}  # fmt: skip


def is_builtin_adapter(reference: str) -> bool:
    """True if ``reference`` names a builtin adapter (``builtin:<name>`` of BUILTIN_ADAPTERS)."""
    return reference.startswith(BUILTIN_PREFIX) and (
        reference[len(BUILTIN_PREFIX) :] in BUILTIN_ADAPTERS
    )


def adapter_recipe(reference: str) -> AdapterRecipe:
    """The recipe of builtin adapter ``reference`` (``builtin:NAME``).

    Raises:
        ValueError: no builtin adapter of that name (the message names the known ones).
    """
    recipe = BUILTIN_ADAPTERS.get(reference.removeprefix(BUILTIN_PREFIX))
    if recipe is None or not reference.startswith(BUILTIN_PREFIX):
        known = ", ".join(BUILTIN_PREFIX + name for name in BUILTIN_ADAPTERS)
        raise ValueError(f"unknown builtin adapter {reference!r}; known builtin adapters: {known}")
    return recipe


def built_builtin_adapter_dir(reference: str, cache_dir: Path | None = None) -> Path | None:
    """The directory of builtin adapter ``reference`` if it is built and complete, else None.

    Raises ValueError for an unknown name."""
    recipe = adapter_recipe(reference)
    root = Path(cache_dir) if cache_dir is not None else builtin_cache_dir()
    target = root / recipe.dir_name
    complete = is_complete(target, recipe.identity(), required=ADAPTER_WEIGHTS_NAME)
    return target if complete else None

"""LoRA adapters on a loaded model, switched between requests without reloading it.

A model's config lists its adapters (``adapters``: directories as
``mlx_lm.load(adapter_path=...)`` takes them, or builtin adapters). At load each one is applied
once with mlx-lm's own ``load_adapters`` (its ``linear_to_lora_layers`` wraps the base layers in
``LoRALinear`` and friends, then its weights are loaded and checked against the model), the
wrapping modules it made are kept, and the base layers put back. Switching to an adapter is
then a swap of those modules into the model (``Module.update_modules``): the base weights are
shared by every adapter and never copied, and each adapter's weights are read once.

The engine switches before each step to the adapter of what runs (a lone request, a batch, a
next-turn prefill): requests of different adapters never share a batch, and the prefix cache keys
each adapter's KV apart (``space``, see :func:`runner.prefix_cache.keyed`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import structlog
from mlx.utils import tree_flatten, tree_unflatten

from modelfiles.builtin_adapters import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME
from modelfiles.builtin_adapters import is_builtin_adapter as is_builtin_adapter_ref
from runner.builtin_adapters import ensure_builtin_adapter

__all__ = ["Adapters", "LoadedAdapter", "adapter_dir"]

log = structlog.get_logger("runner.adapters")

# The parameter names of mlx-lm's adapter layers (LoRA's a and b, DoRA's magnitude).
_ADAPTER_LEAVES = ("lora_a", "lora_b", "m")


def adapter_dir(reference: str) -> Path:
    """The directory of adapter ``reference`` (a path, or ``builtin:NAME``, written on first
    use), checked to hold an adapter mlx-lm can apply to a base model.

    Raises:
        ValueError: no such directory, a file missing, a config that is not JSON, or a full
            fine-tune (a whole model, not an adapter); the message names the adapter.
    """
    if is_builtin_adapter_ref(reference):
        return ensure_builtin_adapter(reference)
    path = Path(reference).expanduser()
    if not path.is_dir():
        raise ValueError(f"adapter {reference}: no adapter directory there")
    for name in (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME):
        if not (path / name).is_file():
            raise ValueError(f"adapter {reference}: {name} is missing (an adapter "
                             f"directory holds {ADAPTER_CONFIG_NAME} and "
                             f"{ADAPTER_WEIGHTS_NAME})")  # fmt: skip
    try:
        config = json.loads((path / ADAPTER_CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"adapter {reference}: {ADAPTER_CONFIG_NAME} unreadable: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"adapter {reference}: {ADAPTER_CONFIG_NAME} is not a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise ValueError(f"adapter {reference}: fine_tune_type {kind!r} is not an adapter "
                         "(lora or dora); a full fine-tune is a model of its own")  # fmt: skip
    return path


@dataclass(eq=False)
class LoadedAdapter:
    """One adapter applied once: the modules that wrap the base layers, by their path."""

    reference: str
    path: Path
    modules: dict[str, Any]
    nbytes: int  # its own weights (the base layers it wraps are shared)


class Adapters:
    """The adapters of a loaded model, and which one the model runs with now.

    Args:
        model: the model (its base layers in place).
        loaded: the adapters, in the config's order.
        base: the base layers each adapter wraps, by path.
    """

    def __init__(self, model: Any, loaded: list[LoadedAdapter], base: dict[str, Any]) -> None:
        self.model = model
        self.loaded = {adapter.reference: adapter for adapter in loaded}
        self.references = tuple(adapter.reference for adapter in loaded)
        self._base = base
        self.active: str | None = None  # None: the base model
        self.switches = 0

    @classmethod
    def none(cls, model: Any) -> Adapters:
        """A model without adapters."""
        return cls(model, [], {})

    @classmethod
    def load(cls, model: Any, references: list[str] | tuple[str, ...]) -> Adapters:
        """Apply each adapter of ``references`` to ``model`` once (with mlx-lm's
        ``load_adapters``, as ``mlx_lm.load(adapter_path=...)`` does), keep its
        modules, and leave the model with its base layers.

        Raises:
            ValueError: an adapter that is not there, not an adapter, or does not fit the
                model (mlx-lm's message, which names each tensor that does not fit); the
                message names the adapter.
        """
        from mlx_lm.tuner.utils import load_adapters

        before = dict(cast(list[tuple[str, Any]], model.named_modules()))
        base: dict[str, Any] = {}
        loaded: list[LoadedAdapter] = []
        for reference in references:
            path = adapter_dir(reference)
            try:
                load_adapters(model, str(path))
                modules = _replaced(model, before)
                mx.eval([module.parameters() for module in modules.values()])
            except Exception as exc:
                _put_back(model, {p: before[p] for p in _replaced(model, before)})
                raise ValueError(f"adapter {reference} does not fit the model: {exc}") from exc
            _put_back(model, {p: before[p] for p in modules})
            base.update({p: before[p] for p in modules})
            nbytes = sum(_adapter_bytes(module) for module in modules.values())
            loaded.append(LoadedAdapter(reference, path, modules, nbytes))
            log.info("adapter_loaded", adapter=reference, path=str(path), modules=len(modules),
                     nbytes=nbytes)  # fmt: skip
        model.eval()
        return cls(model, loaded, base)

    def __bool__(self) -> bool:
        return bool(self.loaded)

    @property
    def nbytes(self) -> int:
        return sum(adapter.nbytes for adapter in self.loaded.values())

    def check(self, reference: str | None) -> None:
        """Raises ValueError unless ``reference`` is None (the base model) or loaded here."""
        if reference is not None and reference not in self.loaded:
            loaded = ", ".join(self.references) or "none"
            raise ValueError(f"adapter {reference!r} is not loaded on this runner "
                             f"(loaded: {loaded})")  # fmt: skip

    def space(self, reference: str | None) -> int:
        """The prefix cache's key space of ``reference``'s KV: 0 for the base model,
        1.. for the adapters in order."""
        return 0 if reference is None else self.references.index(reference) + 1

    def use(self, reference: str | None) -> None:
        """Run the model with adapter ``reference`` (None: the base model) from now on."""
        if reference == self.active:
            return
        self.check(reference)
        modules = self.loaded[reference].modules if reference is not None else {}
        _put_back(self.model, {path: modules.get(path, base) for path, base in self._base.items()})
        self.active = reference
        self.switches += 1


def _adapter_bytes(module: Any) -> int:
    """The bytes of ``module``'s own adapter weights (not the base layer it wraps)."""
    leaves = cast(list[tuple[str, Any]], tree_flatten(module.parameters()))
    return sum(int(array.nbytes) for name, array in leaves
               if name.rsplit(".", 1)[-1] in _ADAPTER_LEAVES)  # fmt: skip


def _replaced(model: Any, before: dict[str, Any]) -> dict[str, Any]:
    """The modules of ``model`` that are not the ones ``before`` had at their paths."""
    now = cast(list[tuple[str, Any]], model.named_modules())
    return {path: module for path, module in now if path in before and module is not before[path]}


def _put_back(model: Any, modules: dict[str, Any]) -> None:
    """Set each module of ``modules`` at its path in ``model``."""
    if modules:
        model.update_modules(tree_unflatten(list(modules.items())))

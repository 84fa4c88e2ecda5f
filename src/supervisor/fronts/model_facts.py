"""What the fronts say about a model beyond its name: its architecture, its
context length, its size and quantization, read from its files (config.json,
a GGUF header, a builtin's recipe) when they are on this machine."""

from __future__ import annotations

from typing import Any

import msgspec

from supervisor.memory.estimate import config_int, estimate_reference, model_config


class ModelFacts(msgspec.Struct, frozen=True):
    """What is known of a model; None where its files do not say (or are
    not on this machine)."""

    architecture: str | None = None  # config.json's model_type
    context_length: int | None = None  # max_position_embeddings
    size_bytes: int | None = None  # of its weights
    quantization: str | None = None  # "4bit", "8bit", or the weights' dtype
    path: str | None = None


_known: dict[str, ModelFacts] = {}


def model_facts(model: str) -> ModelFacts:
    """The facts of ``model`` (a reference as a config names it). Never
    raises: files that cannot be read give no facts. Kept once its files
    are on this machine (not before: a hub model is fetched at its first
    load, and its facts are known from then on)."""
    facts = _known.get(model)
    if facts is None:
        facts = _read_facts(model)
        if facts.path is not None:
            _known[model] = facts
    return facts


def _read_facts(model: str) -> ModelFacts:
    try:
        config = model_config(model)
        estimate = estimate_reference(model)
    except (OSError, ValueError):
        return ModelFacts()
    if config is None:
        return ModelFacts()
    return ModelFacts(
        architecture=_str(config.get("model_type")),
        context_length=config_int(config, "max_position_embeddings"),
        size_bytes=estimate.weights_bytes if estimate is not None else None,
        quantization=_quantization(config),
        path=estimate.path if estimate is not None else None,
    )


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _quantization(config: dict[str, Any]) -> str | None:
    quantization = config.get("quantization")
    if isinstance(quantization, dict) and isinstance(quantization.get("bits"), int):
        return f"{quantization['bits']}bit"
    return _str(config.get("torch_dtype")) or _str(config.get("dtype"))

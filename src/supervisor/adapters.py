"""A model's LoRA adapters, as its config lists them, and the one a request asks for.

A model's ``adapters`` key names adapter directories (as ``mlx_lm.load(adapter_path=...)``
takes them) or builtin adapters (``builtin:tiny-adapter``). The first applies to every request
that names none, as mlx_lm.server's ``--adapter-path`` does; a request may name another of them
(``adapters`` in an OpenAI body, as mlx_lm.server takes it) by its reference as the config
writes it or by its name (the directory's last part, a builtin's name), or ask for the base
model with an empty string. Clients never reach a path the config does not list. Pure: no
files are read here (the runner checks the directories when it loads them).
"""

from __future__ import annotations

from pathlib import PurePath

from modelfiles.builtin import BUILTIN_PREFIX
from modelfiles.builtin_adapters import BUILTIN_ADAPTERS

__all__ = ["MAX_ADAPTERS", "adapter_for", "adapter_list", "adapter_name", "adapters_problem"]

MAX_ADAPTERS = 16
"""The most adapters a model may list (each is held in memory beside it)."""


def adapter_list(adapters: str | list[str]) -> list[str]:
    """A model's ``adapters`` value (one reference or a list) as a list."""
    return [adapters] if isinstance(adapters, str) else list(adapters)


def adapter_name(reference: str) -> str:
    """The short name of adapter ``reference``: a builtin's name, or the
    directory's last part (``~/adapters/sql/`` -> ``sql``)."""
    if reference.startswith(BUILTIN_PREFIX):
        return reference.removeprefix(BUILTIN_PREFIX)
    return PurePath(reference.rstrip("/")).name or reference


def adapters_problem(adapters: str | list[str]) -> str | None:
    """Why a model's ``adapters`` value is refused, or None: an unknown
    builtin adapter, a reference with control characters, too many, or two
    that share a reference or a name (a request could not tell them apart)."""
    references = adapter_list(adapters)
    if len(references) > MAX_ADAPTERS:
        return f"adapters: at most {MAX_ADAPTERS}, not {len(references)}"
    names: set[str] = set()
    for reference in references:
        if not reference or not reference.isprintable():
            return f"adapters: {reference!r} is not a printable, non-empty reference"
        bare = reference.removeprefix(BUILTIN_PREFIX)
        if reference.startswith(BUILTIN_PREFIX) and bare not in BUILTIN_ADAPTERS:
            known = ", ".join(BUILTIN_PREFIX + name for name in BUILTIN_ADAPTERS)
            return f"adapters: no builtin adapter {reference!r} (builtin adapters: {known})"
        for key in {reference, adapter_name(reference)}:
            if key in names:
                return f"adapters: {key!r} names two adapters"
            names.add(key)
    return None


def adapter_for(adapters: str | list[str], model: str, asked: str | None) -> str | None:
    """The adapter (its reference as the config writes it) a request that asks
    for ``asked`` runs with on model ``model``; None: the base model.

    ``asked`` None: the model's default, its first adapter (none without
    adapters). ``""``: the base model. Otherwise a reference or a name the
    config lists.

    Raises:
        ValueError: ``asked`` is not one of the model's adapters (the message
            names the field, the model and the adapters it has).
    """
    references = adapter_list(adapters)
    if asked is None:
        return references[0] if references else None
    if asked == "":
        return None
    for reference in references:
        if asked in (reference, adapter_name(reference)):
            return reference
    if not references:
        raise ValueError(f"adapters: model {model!r} has no adapters (its config lists none), "
                         f"so it cannot serve {asked!r}")  # fmt: skip
    allowed = ", ".join(f"{adapter_name(r)!r} ({r})" if adapter_name(r) != r else repr(r)
                        for r in references)  # fmt: skip
    raise ValueError(f"adapters: {asked!r} is not an adapter of model {model!r} "
                     f"(its adapters: {allowed}; \"\" for none)")  # fmt: skip

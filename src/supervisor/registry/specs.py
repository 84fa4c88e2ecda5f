"""A model's spec from what a client asks for: a load request merged with the
config's settings for that name, the model a reference loads on demand, and
the engine settings its runner gets. Pure: no runners, no event loop."""

from __future__ import annotations

from pathlib import PurePath
from typing import Any

import msgspec

from ipc.messages import EngineSettings, LoadRequest
from supervisor.adapters import adapter_list
from supervisor.config import ModelConfig, SupervisorConfig, kv_cache_dir
from supervisor.registry.entries import RequestError
from supervisor.runners.placement import is_group


def derive_name(model: str) -> str:
    """Default model name: ``builtin:tiny`` -> ``tiny``; a path or repo id -> its
    last part (``.../qwen.Q4_K.gguf`` -> ``qwen.Q4_K``)."""
    if model.startswith("builtin:"):
        return model.removeprefix("builtin:")
    last = PurePath(model.rstrip("/"))
    if last.suffix.lower() == ".gguf" and last.stem:
        return last.stem
    return last.name or model


def merge_spec(config: SupervisorConfig, request: LoadRequest) -> ModelConfig:
    """Merge a load request with ``config``'s settings for that name (or alias).

    Raises:
        RequestError: a value out of the config's ranges (bad_request); the
            spec is decoded as a config file's would be, so that nothing a
            request stores can make the state file unreadable (the rest of
            the check is ``spec_problem``'s, when the model is registered).
    """
    name = request.name or derive_name(request.model)
    configured = config.model_config(name)
    if configured is not None:
        name = configured.name  # a configured alias loads the model under its own name
    env = {**(configured.env if configured else {}), **request.env}
    fields: dict[str, Any] = msgspec.to_builtins(configured) if configured else {}
    fields.pop("preload", None)
    fields.update(name=name, model=request.model, env=env)
    keys = ("max_tokens", "restart", "keep_alive_s", "pinned", "context_tokens",
            "max_concurrent", "prefix_cache", "ranks", "hostfile", "kv_bits",
            "kv_group_size", "draft_model", "num_draft_tokens")  # fmt: skip
    for key in keys:
        value = getattr(request, key)
        if value is not None:
            fields[key] = value
    try:
        return msgspec.convert(fields, ModelConfig)
    except msgspec.ValidationError as exc:
        raise RequestError("bad_request", f"bad load request: {exc}") from None


def on_demand_spec(config: SupervisorConfig, ref: str, loaded: list[str]) -> ModelConfig:
    """The spec to load when a client names ``ref`` and no model ``ref`` is
    loaded: a configured model of that name or reference (``load_on_demand``
    on), else any reference (``load_on_demand = "any"``).

    Args:
        config: the daemon config.
        ref: what the client named: a model name or reference.
        loaded: the names of the models loaded now (for the error).

    Raises:
        RequestError: unknown_model when ``load_on_demand`` allows no load of
            ``ref``; bad_request as :func:`merge_spec`.
    """
    mode = config.load_on_demand
    configured = config.model_config(ref) or next(
        (m for m in config.models if m.model == ref), None
    )
    if configured is not None and mode:
        return merge_spec(config, LoadRequest(model=configured.model, name=configured.name))
    if configured is None and mode == "any":
        return merge_spec(config, LoadRequest(model=ref))
    loaded_names = ", ".join(sorted(loaded)) or "none"
    names = ", ".join(m.name for m in config.models) or "none"
    why = (
        "load_on_demand is off"
        if not mode
        else 'only configured models load on demand (load_on_demand = "any": any model)'
    )
    raise RequestError(
        "unknown_model",
        f"no model {ref!r} is loaded (loaded: {loaded_names}; configured: {names}); {why}",
    )


def engine_settings(config: SupervisorConfig, spec: ModelConfig) -> EngineSettings:
    """The runner's engine settings for ``spec``: its own, else the daemon's.
    A distributed group gets no disk tier for now (each rank holds only its
    part of the KV cache)."""
    disk_bytes = (
        spec.prefix_cache_disk_bytes if spec.prefix_cache_disk_bytes is not None
        else config.prefix_cache_disk_bytes
    )  # fmt: skip
    return EngineSettings(
        max_concurrent=spec.max_concurrent or config.max_concurrent,
        prefix_cache=spec.prefix_cache if spec.prefix_cache is not None
        else config.prefix_cache,
        prefix_cache_bytes=spec.prefix_cache_bytes,
        prefix_cache_entries=config.prefix_cache_entries,
        stream_interval_s=config.stream_interval_ms / 1000,
        batch_wait_share=config.batch_wait_share,
        next_turn_prefill=spec.next_turn_prefill if spec.next_turn_prefill is not None
        else config.next_turn_prefill,
        prefill_chunk_s=config.prefill_chunk_s,
        kv_bits=spec.kv_bits,
        kv_group_size=spec.kv_group_size,
        prefix_cache_disk_bytes=0 if is_group(spec) else disk_bytes,
        prefix_cache_dir=str(kv_cache_dir(config)),
        adapters=tuple(adapter_list(spec.adapters)),
        draft_model=spec.draft_model,
        num_draft_tokens=spec.num_draft_tokens,
    )  # fmt: skip

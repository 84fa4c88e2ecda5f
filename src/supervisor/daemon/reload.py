"""Reloading the config file while the daemon runs: ``mlx-supervisor
reload``, SIGHUP and ``POST /admin/reload`` all call :meth:`Reloader.reload`.

The file the daemon started with is read again and checked whole; a file
that does not parse or validate is refused, naming the key, and nothing
changes. Otherwise, in one step (no other task runs in between):

- new ``[[models]]`` become available (those with ``preload`` start loading);
- removed ones take no new request and are unloaded once none is in flight
  or in line (keep-alive expiry does it, at once for an idle one);
- a changed model takes at once what applies per request (sampling defaults,
  system prompt, aliases, keep-alive, pin, restart strategy), and at its
  next load what shapes its runner (:data:`MODEL_KEYS_NOW` says which);
- daemon-level keys apply at once, at each model's next load, or (the
  socket, the HTTP front, limits read at start) only after a restart, and
  the reply says which.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
import msgspec
import structlog

from ipc.messages import ModelChange, ReloadReply
from supervisor.config import (
    ConfigError,
    ModelConfig,
    SupervisorConfig,
    load_config,
    with_http_override,
)
from supervisor.registry.registry import Registry

log = structlog.get_logger("supervisor.daemon.reload")

MODEL_KEYS_NOW = frozenset({
    "aliases", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "seed", "default_max_tokens", "system_prompt",
    "keep_alive_s", "pinned", "restart", "preload",
})  # fmt: skip
"""A loaded model's keys that apply to its next request. Every other key
(the reference, env, kv_bits, context_tokens, draft_model, num_draft_tokens,
max_tokens: the runner's own hard cap, max_concurrent: the runner's batch,
prefix cache settings, ranks)
shapes its runner or its memory estimate, and waits for its next load."""
DAEMON_KEYS_NOW = frozenset({"keep_alive_s", "queue_timeout_s", "max_queue", "load_on_demand",
                             "allow_remote_images", "allow_private_image_hosts",
                             "max_image_bytes", "max_images_per_request"})  # fmt: skip
"""Daemon-level keys read at each use."""
DAEMON_KEYS_NEXT_LOAD = frozenset({
    "max_tokens", "max_concurrent", "prefix_cache", "prefix_cache_entries",
    "prefix_cache_disk_bytes", "next_turn_prefill", "prefill_chunk_s", "batch_wait_share",
    "stream_interval_ms",
})  # fmt: skip
"""Daemon-level keys a runner is given when it loads its model. Every other
daemon-level key is read when the daemon starts (the socket, the HTTP front,
its key, the memory monitor, the restart intensity, ...): it needs a restart."""

Preload = Callable[[ModelConfig], Coroutine[Any, Any, None]]
"""Loads one configured model, logging a failure; never raises."""


class Reloader:
    """Applies the daemon's config file again, on request.

    Args:
        config: the daemon's config, shared with the registry and the fronts:
            a reload changes it in place.
        path: the file the daemon started with (None: it started without one,
            and a reload is refused).
        registry: the models.
        preload: starts loading a model that ``preload`` asks for (in the
            daemon's task group).
        http_flag: ``serve --http``, which a reload keeps over the file's
            http_listen, as at start.
    """

    def __init__(
        self,
        config: SupervisorConfig,
        path: Path | None,
        registry: Registry,
        preload: Preload,
        http_flag: str | None = None,
    ) -> None:
        self.config = config
        self.path = path
        self.registry = registry
        self.preload = preload
        self.http_flag = http_flag
        self._lock = anyio.Lock()  # one reload at a time (SIGHUP and a command together)

    async def reload(self) -> ReloadReply:
        """Read the config file again and apply it; never raises.

        Returns the reply: refused (``ok`` false, with the error and the key)
        and nothing changed, or what was added, removed and changed. Waits
        for removed models that are idle to be unloaded (each unload is
        bounded by the escalation ladder), not for preloads."""
        async with self._lock:
            shown = str(self.path) if self.path is not None else None
            try:
                new = await anyio.to_thread.run_sync(self._read)
            except ConfigError as exc:
                log.error("config_reload_refused", path=shown, error=str(exc), key=exc.key)
                return ReloadReply(ok=False, path=shown, error=str(exc), key=exc.key)
            except Exception as exc:  # a fault boundary: a file no check foresaw changes nothing
                log.exception("config_reload_refused", path=shown, error=repr(exc))
                return ReloadReply(ok=False, path=shown,
                                   error=f"cannot read config {shown}: {exc!r}")  # fmt: skip
            reply = self._apply(new)
            reply.path = shown
            await self._wait_unloaded(reply)
            log.info("config_reloaded", **_summary(reply))
            return reply

    def _read(self) -> SupervisorConfig:
        """The file's config as the daemon would run it. Raises ConfigError."""
        if self.path is None:
            raise ConfigError("the daemon was started without a config file (serve --config "
                              "FILE): there is nothing to reload")  # fmt: skip
        return with_http_override(load_config(self.path), self.http_flag)

    def _apply(self, new: SupervisorConfig) -> ReloadReply:
        """Apply ``new`` to the running daemon, without yielding; the reply
        lists the removed models that are idle in ``unloaded`` for now (those
        busy in ``unloading``)."""
        reply = ReloadReply(ok=True)
        self._apply_daemon_keys(new, reply)
        old_models = {m.name: m for m in self.config.models}
        new_models = {m.name: m for m in new.models}
        self.config.models = list(new.models)  # the fronts and load on demand see it from now
        entries = self.registry.entries
        for name, spec in new_models.items():
            entry = entries.get(name)
            before = old_models.get(name)
            if before is None:
                reply.added.append(name)
            if entry is not None and entry.state != "stopping":
                if entry.removed:  # removed by an earlier reload, put back before it unloaded
                    entry.removed = False
                    before = None
                change = self._apply_to_entry(name, before or entry.spec, spec)
            elif before is not None:
                keys = changed_keys(before, spec)
                change = ModelChange(name, loaded=False, now=keys) if keys else None
            else:
                change = None
            if change is not None:
                reply.changed.append(change)
            wants_preload = spec.preload and (before is None or not before.preload)
            if wants_preload and entry is None:
                reply.preloading.append(name)
                self.registry.task_group.start_soon(self.preload, spec, name=f"preload {name}")
        for name in old_models:
            if name in new_models:
                continue
            reply.removed.append(name)
            entry = entries.get(name)
            if entry is None or entry.state == "stopping":
                continue
            entry.removed = True
            in_use = entry.slots.borrowed_tokens > 0 or entry.waiters
            (reply.unloading if in_use else reply.unloaded).append(name)
        self.registry.idle_changed()  # keep-alive expiry takes the removed ones
        self.registry.on_change()  # the state file keeps the models' new settings
        return reply

    def _apply_daemon_keys(self, new: SupervisorConfig, reply: ReloadReply) -> None:
        """Daemon-level keys: those read at each use or at each load are set
        on the shared config; the others are listed as needing a restart."""
        for key in SupervisorConfig.__struct_fields__:
            if key == "models" or getattr(new, key) == getattr(self.config, key):
                continue
            if key in DAEMON_KEYS_NOW:
                reply.daemon_now.append(key)
            elif key in DAEMON_KEYS_NEXT_LOAD:
                reply.daemon_next_load.append(key)
            else:
                reply.needs_restart.append(key)
                continue
            setattr(self.config, key, getattr(new, key))
        if "keep_alive_s" in reply.daemon_now:  # the models that have none of their own
            for entry in list(self.registry.entries.values()):
                if entry.spec.keep_alive_s is None:
                    entry.keep_alive_s = self.config.keep_alive_s

    def _apply_to_entry(
        self, name: str, before: ModelConfig, spec: ModelConfig
    ) -> ModelChange | None:
        """Apply the keys that changed from ``before`` to ``spec`` to the
        loaded model ``name``: at once those of :data:`MODEL_KEYS_NOW`, the
        others at its next load (:attr:`ModelEntry.next_spec`)."""
        entry = self.registry.entries[name]
        keys = changed_keys(before, spec)
        if not keys:
            return None
        now = {key: getattr(spec, key) for key in keys if key in MODEL_KEYS_NOW}
        later = {key: getattr(spec, key) for key in keys if key not in MODEL_KEYS_NOW}
        if now:
            entry.spec = msgspec.structs.replace(entry.spec, **now)
        if later or entry.next_spec is not None:
            base = entry.next_spec or entry.spec
            entry.next_spec = msgspec.structs.replace(base, **now, **later)
        if "keep_alive_s" in now:
            configured = spec.keep_alive_s
            entry.keep_alive_s = self.config.keep_alive_s if configured is None else configured
        if "restart" in now:
            entry.tracker.strategy = spec.restart or self.config.restart
        return ModelChange(name, loaded=True, now=sorted(now), next_load=sorted(later))

    async def _wait_unloaded(self, reply: ReloadReply) -> None:
        """Wait for the idle removed models to be unloaded (keep-alive expiry
        does it) up to the escalation ladder's length; one still there then
        moves to ``unloading``."""
        entries = [e for name in reply.unloaded if (e := self.registry.entries.get(name))]
        config = self.config
        ladder_s = config.shutdown_grace_s + config.term_grace_s + config.sigkill_wait_s + 5.0
        with anyio.move_on_after(ladder_s):
            for entry in entries:
                await entry.forgotten.wait()
        late = [entry.name for entry in entries if not entry.forgotten.is_set()]
        reply.unloaded = [name for name in reply.unloaded if name not in late]
        reply.unloading += late


def changed_keys(before: ModelConfig, after: ModelConfig) -> list[str]:
    """The keys whose values differ between two settings of one model."""
    return [key for key in ModelConfig.__struct_fields__
            if key != "name" and getattr(before, key) != getattr(after, key)]  # fmt: skip


def _summary(reply: ReloadReply) -> dict[str, Any]:
    """The reply as log fields: per model, the keys that apply now and at its next load."""
    fields = msgspec.structs.asdict(reply)
    fields.pop("ok")
    fields.pop("error")
    fields.pop("key")
    fields["changed"] = {c.name: {"loaded": c.loaded, "now": c.now, "next_load": c.next_load}
                         for c in reply.changed}  # fmt: skip
    return fields

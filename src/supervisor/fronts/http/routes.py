"""The HTTP front's routes besides completions: ``GET /v1/models`` and
``/v1/models/{model}`` (loaded models, then configured ones, each with its
context length when its files say it, and each alias of a model as a model
of its own), ``GET /health``
(a one-line summary, 503 while shutting down) and ``GET /metrics``
(Prometheus)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from ipc.messages import StatusReply
from supervisor import __version__
from supervisor.config import SupervisorConfig
from supervisor.fronts.http.errors import ENCODER, ApiError
from supervisor.fronts.http.openai_replies import OWNER
from supervisor.fronts.model_facts import model_facts
from supervisor.registry.registry import Registry


class InfoRoutes:
    """What the front says about the daemon and its models.

    Args:
        registry: the models.
        config: the daemon config (the configured models).
        status: the daemon's status.
    """

    def __init__(
        self, registry: Registry, config: SupervisorConfig, status: Callable[[], StatusReply]
    ) -> None:
        self.registry = registry
        self.config = config
        self.status = status
        self.metrics = registry.metrics

    async def health(self, request: Request) -> Response:
        """200 and a one-line summary while serving; 503 while shutting down."""
        if self.registry.closing:
            return PlainTextResponse("shutting down\n", status_code=503)
        states = Counter(entry.state for entry in list(self.registry.entries.values()))
        count = sum(states.values())
        models = f"{count} model{'' if count == 1 else 's'}"
        if states:
            models += f" ({', '.join(f'{n} {state}' for state, n in sorted(states.items()))})"
        return PlainTextResponse(f"ok: {OWNER} {__version__}, {models}\n")

    async def prometheus(self, request: Request) -> Response:
        """The metrics, in Prometheus' text format."""
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def _model_objects(self) -> list[dict[str, Any]]:
        """Loaded models, then configured ones that are not loaded."""
        objects = self._listed()
        for obj in objects:
            facts = await anyio.to_thread.run_sync(model_facts, obj["model"])
            # vLLM's name for it too, which several clients read
            obj["context_length"] = obj["max_model_len"] = facts.context_length
        return objects

    def _listed(self) -> list[dict[str, Any]]:
        objects = []
        status = self.status()
        started = int(time.time() - status.supervisor.uptime_s)
        for info in status.runners:
            objects.append({
                "id": info.name, "object": "model",
                "created": int(info.started_at) if info.started_at else started,
                "owned_by": OWNER, "model": info.model, "state": info.state,
                "configured": self.config.model_config(info.name) is not None,
                "pid": info.pid, "restarts": info.restarts,
            })  # fmt: skip
        loaded = {obj["id"] for obj in objects}
        for model in self.config.models:
            if model.name not in loaded:
                objects.append({
                    "id": model.name, "object": "model", "created": started, "owned_by": OWNER,
                    "model": model.model, "state": "not_loaded", "configured": True,
                    "pid": None, "restarts": 0,
                })  # fmt: skip
        return [alias for obj in objects for alias in self._with_aliases(obj)]

    def _with_aliases(self, obj: dict[str, Any]) -> list[dict[str, Any]]:
        """``obj``, then one object per alias of its model: clients know a
        model only by an ``id`` from this list (a picker, a check of the
        name), so each alias is listed as one, with ``alias_of`` its model."""
        configured = self.config.model_config(obj["id"])  # a model's aliases are its config's
        aliases = configured.aliases if configured and configured.name == obj["id"] else []
        obj["aliases"] = list(aliases)
        return [obj, *({**obj, "id": alias, "alias_of": obj["id"], "aliases": []}
                       for alias in aliases)]  # fmt: skip

    async def list_models(self, request: Request) -> Response:
        body = {"object": "list", "data": await self._model_objects()}
        return Response(ENCODER.encode(body), media_type="application/json")

    async def get_model(self, request: Request) -> Response:
        wanted = request.path_params["model"]
        for obj in await self._model_objects():
            if wanted in (obj["id"], obj["model"]):
                return Response(ENCODER.encode(obj), media_type="application/json")
        raise ApiError(404, f"no model {wanted!r}", type="not_found_error", code="unknown_model",
                       param="model")  # fmt: skip

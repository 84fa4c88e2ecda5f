"""A stand-in registry whose one model answers with scripted runner frames,
and the real HTTP front's routes over it, for tests of the fronts' shapes
with real, unmodified clients over ASGI (no daemon, no runner)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any, cast

import anyio
import httpx
import httpx2
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Route

from ipc.messages import (
    ChatMessage,
    ChatOptions,
    GenerateRequest,
    GenerationDone,
    RunnerInfo,
    StatusReply,
    SupervisorInfo,
    SystemInfo,
    TextChunk,
)
from supervisor.config import SupervisorConfig
from supervisor.fronts.http.completions import Completions
from supervisor.fronts.http.errors import routing_error
from supervisor.fronts.http.requests import ApiKey
from supervisor.fronts.http.routes import InfoRoutes
from supervisor.metrics import Metrics
from supervisor.registry.registry import Registry

Frames = Sequence[TextChunk | GenerationDone]
RoutesOf = Callable[[Completions, InfoRoutes, ApiKey], list[Route]]


def done(finish: str = "stop", **fields: Any) -> GenerationDone:
    """A generation's last frame: 5 prompt tokens, 9 generated."""
    return GenerationDone(
        request_id=1,
        prompt_tokens=5,
        generation_tokens=9,
        prompt_tps=1.0,
        generation_tps=1.0,
        ttft_s=0.1,
        peak_memory_bytes=0,
        finish_reason=finish,
        **fields,
    )


class ScriptedEntry:
    """The scripted registry's one model, ``tiny``: ready, and idle between
    requests (``touched`` counts the uses that restart its idle timer)."""

    name = "tiny"
    state = "ready"
    active_requests = 0
    max_tokens_cap = None  # the daemon's max_tokens, as for a runner loaded with none of its own
    estimate = None  # no memory estimate: whether it takes images is the runner's to say

    def __init__(self) -> None:
        self.spec = SimpleNamespace(max_tokens=None, keep_alive_s=None, pinned=False)
        self.keep_alive_s = 0.0
        self.touched = 0

    @property
    def evictable(self) -> bool:
        return self.state == "ready" and not self.spec.pinned

    def touch(self) -> None:
        self.touched += 1


class ScriptedRegistry:
    """A registry whose one model, ``tiny``, answers every generate with
    ``frames`` and every token count with ``token_count``; it keeps each
    request (``requests``, ``counted``), and whether the front had cancelled
    it after each frame (``cancelled``)."""

    closing = False

    def __init__(self, frames: Frames = (), token_count: int = 7) -> None:
        self.frames = frames
        self.token_count = token_count
        self.metrics = Metrics()
        self.requests: list[GenerateRequest] = []
        self.counted: list[tuple[list[ChatMessage] | None, str | None, ChatOptions]] = []
        self.cancelled: list[bool] = []
        self.unloaded: list[str] = []
        self.entry = ScriptedEntry()
        self.entries: dict[str, Any] = {"tiny": self.entry}

    async def ensure_loaded(self, ref: str, on_progress: Any) -> Any:
        return self.entry

    async def generate(
        self,
        request: GenerateRequest,
        emit: Any,
        cancel: anyio.Event,
        on_queued: Any = None,
        *,
        front: str = "socket",
    ) -> None:
        self.requests.append(request)
        for frame in self.frames:
            await emit(frame, None)
            self.cancelled.append(cancel.is_set())

    async def count_tokens(
        self,
        entry: Any,
        messages: list[ChatMessage] | None,
        prompt: str | None = None,
        chat: ChatOptions = ChatOptions(),  # noqa: B008 - frozen
    ) -> int:
        self.counted.append((messages, prompt, chat))
        return self.token_count

    def find(self, ref: str) -> Any:
        """The model named ``ref`` (by name or reference), as Registry.find."""
        return self.entry if ref in ("tiny", "builtin:tiny") else None

    def idle_changed(self) -> None:
        pass

    async def unload(self, name: str, reason: str = "unload") -> Any:
        self.unloaded.append(name)
        return None

    def status(self) -> StatusReply:
        """The daemon's status with ``tiny`` loaded and ready."""
        runner = RunnerInfo(name="tiny", model="builtin:tiny", pid=4242, state="ready",
                            rss_bytes=1 << 28, started_at=time.time() - 5, restarts=0,
                            last_exit=None, keep_alive_s=self.entry.keep_alive_s)  # fmt: skip
        return StatusReply(
            supervisor=SupervisorInfo(pid=1, version="0", uptime_s=10.0, socket="/tmp/x.sock"),
            system=SystemInfo(1 << 34, 1 << 33, pressure_pct=50.0),
            runners=[runner],
        )


def scripted_app(
    registry: ScriptedRegistry,
    routes_of: RoutesOf,
    config: SupervisorConfig | None = None,
    key: str | None = None,
) -> Starlette:
    """The routes ``routes_of`` makes, on the real request path, before
    ``registry`` (Starlette's 404s and 405s as the daemon gives them)."""
    config = config or SupervisorConfig()
    completions = Completions(cast(Registry, registry), config, ApiKey(key))
    info = InfoRoutes(cast(Registry, registry), config, registry.status)
    routes = routes_of(completions, info, ApiKey(key))
    return Starlette(routes=routes, exception_handlers={HTTPException: routing_error})


def asgi_http(app: Starlette) -> httpx.AsyncClient:
    """An httpx client that talks to ``app`` in-process, for a client
    library's ``http_client`` (or its httpx keyword arguments)."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://front")


def asgi_http2(app: Starlette) -> httpx2.AsyncClient:
    """As :func:`asgi_http`, in httpx2, the HTTP library the anthropic
    client (2.x) takes."""
    return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://front")

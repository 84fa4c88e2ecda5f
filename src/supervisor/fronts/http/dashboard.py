"""The dashboard: one page the daemon serves at ``GET /``, and the two routes
only it needs.

The page (``static/``: ``index.html``, ``app.js``, ``app.css``, an icon; no
third-party code, no build step) reads everything live, by server-sent
events: ``GET /admin/events`` (the management API's event stream) for the
event list, and ``GET /admin/status/stream`` (here) for the rest. Its
actions are the management API's routes (:mod:`~supervisor.fronts.http.admin`)
and its chat box is ``POST /v1/chat/completions``, all same-origin.

``GET /admin/status/stream`` writes, first, ``history`` (the memory
timeline of the last 15 minutes, :mod:`supervisor.memory.history`) and
``status`` (``status --json``'s document); then, whenever something changes
(an event of the hub, a runner's log line, memory points of MEMORY_PUSH_S)
and at most once per ``interval_s``: ``status`` after an event of the hub,
else every STATUS_REFRESH_S (each time only when it differs from the last
sent), ``memory`` (the new points, each runner's footprint in them) and
``logs`` (the runners' new lines, every model's), in one write. Each wakeup
costs the daemon a little CPU per open page: events come at once, the rest
in batches.
``GET /admin/models/{name}/logs`` gives the lines kept of a model's runners
(:class:`~supervisor.runners.handle.RunnerLogs`: the last 200, across its
restarts).

The page and its files are served without a key (they hold no data); it
learns from a ``<meta>`` whether the data routes want one, asks for it once
and keeps it in ``sessionStorage``. The data routes take the admin key, as
the management API does. Each file is sent with a Content-Security-Policy
that lets the page load and connect to this origin only.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from importlib import resources

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectSendStream
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ipc.messages import StatusReply
from supervisor.config import SupervisorConfig
from supervisor.events import EventHub
from supervisor.fronts.http.admin import EventStream, admin_guarded, json_response
from supervisor.fronts.http.errors import ENCODER
from supervisor.fronts.http.requests import ApiKey, guarded
from supervisor.fronts.http.streaming import named_sse
from supervisor.memory.history import MemoryHistory, MemoryPoint
from supervisor.registry.entries import find_entry
from supervisor.registry.registry import Registry, RequestError
from supervisor.runners.handle import RunnerLogs

STATUS_INTERVAL_S = 1.0  # a page is sent at most this often
STATUS_REFRESH_S = 10.0  # the status again this often when no event came (memory figures, uptime)
GATHER_S = 0.05  # what one change sets off comes together: a death, its restart, the state moves
MEMORY_PUSH_S = 2.0  # new memory points wait this long for company (a chart of 15 minutes)
HEARTBEAT_S = 15.0  # a comment when nothing changed this long, so proxies keep the stream
RECONNECT_MS = 2000

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
"""The page may load its own script, styles and icon and fetch from its own
origin; nothing inline, nothing from elsewhere, never in a frame."""
PAGE_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}
ASSETS = {  # path -> (file in static/, content type)
    "/dashboard/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/dashboard/app.css": ("app.css", "text/css; charset=utf-8"),
    "/dashboard/icon.svg": ("icon.svg", "image/svg+xml"),
}
KEYS_PLACEHOLDER = b'<meta name="mlx-supervisor-keys" content="">'


def static_file(name: str) -> bytes:
    """A file of the page, from the package."""
    return (resources.files("supervisor.fronts.http") / "static" / name).read_bytes()


def runner_footprints(registry: Registry) -> dict[str, int]:
    """What each model's runner processes hold, in bytes, by model name (the
    hot spare as ``(spare)``), as the memory monitor last measured them."""
    footprints: dict[str, int] = {}
    for handle in list(registry.live_handles):
        name = handle.spec.name
        footprints[name] = footprints.get(name, 0) + handle.footprint_bytes
    return footprints


def comparable(status: StatusReply) -> StatusReply:
    """``status`` without what changes on every call (the uptime, the clock
    arithmetic of last use), to tell whether anything else changed."""
    replace = msgspec.structs.replace
    return replace(
        status,
        supervisor=replace(status.supervisor, uptime_s=0.0),
        runners=[replace(runner, last_used_at=None) for runner in status.runners],
    )


class Wakeup:
    """A flag that one task waits on and others set (``set``,
    ``status_changed`` for an event of the hub, ``point_added`` for a memory
    point: set once the points not yet sent span ``points_every_s``); none
    ever blocks."""

    def __init__(self, points_every_s: float) -> None:
        self._event = anyio.Event()
        self.status_due = True
        self.points_sent_ts = 0.0  # the newest point sent (unix time)
        self._points_every_s = points_every_s

    def point_added(self, point: MemoryPoint) -> None:
        if point.ts - self.points_sent_ts >= self._points_every_s:
            self._event.set()

    def set(self, *_: object) -> None:
        self._event.set()

    def status_changed(self) -> None:
        self.status_due = True
        self._event.set()

    def clear(self) -> None:
        if self._event.is_set():
            self._event = anyio.Event()

    async def wait(self, timeout_s: float) -> bool:
        """Whether it was set within ``timeout_s``."""
        with anyio.move_on_after(timeout_s):
            await self._event.wait()
        return self._event.is_set()


class Dashboard:
    """The page and its routes.

    Args:
        registry: the models (its events hub, memory monitor and runners).
        config: the daemon config (which keys are set).
        status: the daemon's status (``status --json``'s document).
        key: the key the data routes take (the management API's).
        logs: the runners' lines (the daemon's; a fresh one records nothing).
        interval_s: a page is sent at most this often.
    """

    def __init__(
        self,
        registry: Registry,
        config: SupervisorConfig,
        status: Callable[[], StatusReply],
        key: ApiKey,
        logs: RunnerLogs | None = None,
        *,
        interval_s: float = STATUS_INTERVAL_S,
    ) -> None:
        self.registry = registry
        self.status = status
        self.key = key
        self.logs = logs if logs is not None else RunnerLogs()
        self.interval_s = interval_s
        self.history = MemoryHistory(registry.monitor, functools.partial(runner_footprints,
                                                                         registry))  # fmt: skip
        keys = []  # which keys the page must ask for: never the keys themselves
        if config.admin_api_key is not None or config.api_key is not None:
            keys.append("admin")
        if config.api_key is not None:
            keys.append("api")
            if config.admin_api_key is None:
                keys.append("same")  # /admin takes api_key: one key opens everything
        self._page = static_file("index.html").replace(
            KEYS_PLACEHOLDER, b'<meta name="mlx-supervisor-keys" content="%s">'
            % " ".join(keys).encode()
        )  # fmt: skip
        self._assets = {path: (static_file(name), kind) for path, (name, kind) in ASSETS.items()}

    @property
    def hub(self) -> EventHub:
        return self.registry.events

    def routes(self) -> list[Route]:
        """The page, its files, and its two data routes (behind the key)."""
        return [
            Route("/", guarded(self.page, None), methods=["GET"]),
            *(Route(path, guarded(self.asset, None), methods=["GET"]) for path in self._assets),
            Route(
                "/admin/status/stream", admin_guarded(self.status_stream, self.key), methods=["GET"]
            ),
            Route(
                "/admin/models/{name}/logs",
                admin_guarded(self.model_logs, self.key),
                methods=["GET"],
            ),
        ]

    async def page(self, request: Request) -> Response:
        """The dashboard's page."""
        return Response(self._page, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    async def asset(self, request: Request) -> Response:
        """The page's script, styles or icon."""
        body, kind = self._assets[request.url.path]
        return Response(body, media_type=kind, headers=PAGE_HEADERS)

    async def model_logs(self, request: Request) -> Response:
        """The lines kept of a model's runners (a model's name or alias; one
        unloaded since keeps its lines). Raises RequestError (unknown_model)."""
        name = request.path_params["name"]
        entry = find_entry(self.registry.entries, name)
        model = entry.name if entry is not None else name
        lines = self.logs.tail(model)
        if entry is None and not lines:
            raise RequestError("unknown_model", f"no model {name!r}: none is loaded under "
                               "that name and no runner of that name wrote a line")  # fmt: skip
        return json_response({"model": model, "lines": lines, "last_seq": self.logs.last_seq})

    async def status_stream(self, request: Request) -> Response:
        """The status, the memory timeline and the runners' lines, live."""
        return EventStream(self._stream, self.registry.config.client_write_timeout_s)

    async def _stream(self, frames: MemoryObjectSendStream[bytes]) -> None:
        """Write the stream until the hub closes (the daemon stops): each
        event, log line and batch of memory points wakes it, and it writes
        what changed, at most once per ``interval_s``."""
        await frames.send(f"retry: {RECONNECT_MS}\n: status of mlx-supervisor\n\n".encode())
        points = self.history.points()
        history = {"span_s": self.history.span_s, "interval_s": self.history.interval_s,
                   "points": points}  # fmt: skip
        await frames.send(named_sse("history", ENCODER.encode(history)))
        wake = Wakeup(MEMORY_PUSH_S)
        wake.points_sent_ts = points[-1].ts if points else 0.0
        stop_points = self.history.listen(wake.point_added)
        stop_lines = self.logs.listen(wake.set)
        try:
            async with self.hub.subscribe() as events, anyio.create_task_group() as tg:
                tg.start_soon(self._write_changes, frames, wake)
                async for _ in events:
                    wake.status_changed()
                tg.cancel_scope.cancel()
        finally:
            stop_points()
            stop_lines()

    async def _write_changes(self, frames: MemoryObjectSendStream[bytes], wake: Wakeup) -> None:
        sent: StatusReply | None = None
        log_seq = self.logs.last_seq  # the page reads a model's earlier lines itself
        written = status_at = -math.inf
        wake.set()  # the status at once
        while True:
            if not await wake.wait(HEARTBEAT_S):
                await frames.send(b": keep-alive\n\n")
                continue
            await anyio.sleep(max(GATHER_S, written + self.interval_s - time.monotonic()))
            wake.clear()  # what came meanwhile goes out now
            written = time.monotonic()
            out: list[bytes] = []
            if wake.status_due or written - status_at >= STATUS_REFRESH_S:
                wake.status_due = False
                status_at = written
                status = self.status()
                now = comparable(status)
                if now != sent:
                    sent = now
                    out.append(named_sse("status", ENCODER.encode(status)))
            points = self.history.points(wake.points_sent_ts)  # any: they go along
            if points:
                wake.points_sent_ts = points[-1].ts
                out.append(named_sse("memory", ENCODER.encode(points)))
            lines, skipped = self.logs.after(log_seq)
            if lines or skipped:
                log_seq = self.logs.last_seq
                out.append(named_sse("logs", ENCODER.encode({"lines": lines, "skipped": skipped})))
            if out:
                await frames.send(b"".join(out))

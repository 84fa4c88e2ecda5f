"""The management API: the control socket's operations over HTTP, under ``/admin``.

``GET /admin/status`` is ``status --json``'s document; ``POST /admin/models``
loads (with ``Accept: text/event-stream`` or ``?stream=true``, its progress
as server-sent events ending with the result); ``DELETE
/admin/models/{name}`` unloads (the reply lists the escalation's steps);
``POST`` and ``DELETE /admin/models/{name}/pin`` pin and unpin;
``POST /admin/models/{name}/cache/clear`` drops a prefix cache;
``POST /admin/reload`` reloads the config; ``GET /admin/events`` streams the
daemon's events (:mod:`supervisor.events`), replaying those after
``Last-Event-ID`` or ``?since=ID`` first.

Each route is a translation onto the registry calls the socket makes, with
the front's error objects and statuses (404 unknown model, 409 a name taken,
503 not ready, 507 no memory). The key is ``admin_api_key`` when set (then
the plain ``api_key`` does not open these routes), else ``api_key``. Without
any key (loopback, where every local user reaches the port), a load takes
``model`` alone and loads what a load on demand would (a configured model
as configured; any reference with ``load_on_demand = "any"``; nothing with
``load_on_demand = false``); with a key, what the socket's load takes.
Fault injection is never taken over HTTP.

A web page reaches these routes only from the front's own origin, whatever
``http_cors_origins`` lets other pages do with the model APIs: a request
with another ``Origin``, or one ``Sec-Fetch-Site`` says another site's page
sent (a link followed too), is refused (403 ``origin_not_allowed``).

Streams are Starlette's StreamingResponse, each write within
``client_write_timeout_s`` (a client that reads nothing that long is gone),
with a keep-alive comment every ``heartbeat_s`` so proxies keep an idle one
open; an events stream ends when its client leaves, when it falls a whole
buffer behind (it reconnects with ``Last-Event-ID`` and catches up from the
ring), or when the daemon stops.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import msgspec
import structlog
from anyio.streams.memory import MemoryObjectSendStream
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from ipc.messages import FAULTS_ENV, LoadProgress, LoadRequest, ReloadReply, StatusReply
from supervisor.config import ModelConfig, SupervisorConfig, spec_problem
from supervisor.events import Event, EventHub
from supervisor.fronts.http.errors import ENCODER, ApiError, internal_error
from supervisor.fronts.http.guard import FOREIGN_FETCH_SITES, is_same_origin
from supervisor.fronts.http.requests import ApiKey, Handler, guarded, read_json
from supervisor.fronts.http.streaming import named_sse
from supervisor.fronts.mailbox import Mailbox
from supervisor.registry.registry import Registry, RequestError
from supervisor.registry.specs import on_demand_spec
from supervisor.waiting import beside

log = structlog.get_logger("supervisor.http")

T = TypeVar("T")

HEARTBEAT_S = 15.0  # a comment this often keeps an idle stream open through proxies
RECONNECT_MS = 2000  # an EventSource that lost its stream reconnects after this long
EVENT_STREAM = "text/event-stream; charset=utf-8"
STREAM_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
MAX_EVENT_ID_DIGITS = 18

Reload = Callable[[], Awaitable[ReloadReply]]
"""Reads the config file again and applies it (the daemon's reload)."""
Produce = Callable[[MemoryObjectSendStream[bytes]], Awaitable[None]]
"""Writes a stream's framed events, then returns (the stream ends)."""


class LoadBody(LoadRequest, forbid_unknown_fields=True):
    """``POST /admin/models``: the socket's load request as JSON (``model``, and
    ``name``, ``keep_alive_s``, ``pinned``, ... as ``mlx-supervisor load``
    takes them); a field it does not know is refused."""


class CacheClearBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /admin/models/{name}/cache/clear``: ``disk_only`` keeps the RAM tier."""

    disk_only: bool = False


class NoBody(msgspec.Struct, forbid_unknown_fields=True):
    """A route that takes no parameters: no body, or ``{}``."""


class EventStream(StreamingResponse):
    """Server-sent events that ``produce`` writes as it goes, sent by
    Starlette's StreamingResponse (which stops them when the client leaves),
    each write within ``write_timeout_s``. ``produce`` is a fault boundary:
    an unexpected error ends the stream with an ``error`` event."""

    def __init__(self, produce: Produce, write_timeout_s: float) -> None:
        self._frames, self._chunks = anyio.create_memory_object_stream[bytes]()
        super().__init__(self._chunks, media_type=EVENT_STREAM, headers=STREAM_HEADERS)
        self._produce = produce
        self._write_timeout_s = write_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_within(message: Message) -> None:
            with anyio.fail_after(self._write_timeout_s):
                await send(message)

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._produce_contained, scope["path"])
                await super().__call__(scope, receive, send_within)
                tg.cancel_scope.cancel()  # the stream is done, or its client left
        except* TimeoutError:
            log.info("http_stream_client_stalled", path=scope["path"],
                     write_timeout_s=self._write_timeout_s)  # fmt: skip
        finally:
            self._chunks.close()
            self._frames.close()

    async def _produce_contained(self, path: str) -> None:
        async with self._frames:
            try:
                await self._produce(self._frames)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the response ended first: no one to tell
            except Exception as exc:  # a fault boundary: the daemon outlives any stream
                log.exception("http_stream_failed", path=path)
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await self._frames.send(error_event(internal_error(exc)))


def event_frame(event: Event) -> bytes:
    """``event`` as a server-sent event whose id is the event's."""
    return b"id: %d\ndata: %s\n\n" % (event.id, ENCODER.encode(event))


def error_event(error: ApiError) -> bytes:
    """``error`` as a stream's last event (its body: the front's error object)."""
    return named_sse("error", ENCODER.encode(error.body()))


def json_response(body: Any, status: int = 200) -> Response:
    return Response(ENCODER.encode(body), status, media_type="application/json")


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, code="bad_request", param=param)


def wants_stream(request: Request) -> bool:
    """Whether a load's answer is a stream: ``?stream=true`` (or 1), or an
    ``Accept`` that names ``text/event-stream``. Raises ApiError (400)."""
    flag = request.query_params.get("stream")
    if flag is not None:
        if flag.lower() not in ("true", "1", "false", "0"):
            raise bad("stream", f"stream must be true or false, not {flag!r}")
        return flag.lower() in ("true", "1")
    return "text/event-stream" in request.headers.get("accept", "")


def replay_from(request: Request) -> int | None:
    """The id after which an events stream starts: ``Last-Event-ID`` (an
    EventSource reconnecting), else ``?since=ID``; None: live events only.
    Raises ApiError (400)."""
    given = request.headers.get("last-event-id")
    param = "Last-Event-ID"
    if given is None:
        given, param = request.query_params.get("since"), "since"
    if given is None:
        return None
    given = given.strip()
    if not (given.isascii() and given.isdigit()) or len(given) > MAX_EVENT_ID_DIGITS:
        raise bad(param, f"{param} must be an event id (a whole number), not {given[:40]!r}")
    return int(given)


def foreign_page(request: Request) -> ApiError | None:
    """Why a page of another origin may not call ``request``'s admin route,
    or None. Only the front's own pages may (an ``Origin`` that is its own
    base URL): ``http_cors_origins`` opens the model APIs, never these. A
    request another site's page sent says so in ``Sec-Fetch-Site`` (one
    without an Origin: an ``<img>``, a form, a link followed)."""
    origin = request.headers.get("origin")
    if origin is not None and not is_same_origin(origin, request.headers.get("host", "")):
        return ApiError(
            403, f"pages of origin {origin!r} may not call the management API: only the "
            "front's own pages may (http_cors_origins does not open /admin)",
            type="permission_error", code="origin_not_allowed",
        )  # fmt: skip
    if request.headers.get("sec-fetch-site") in FOREIGN_FETCH_SITES:
        return ApiError(
            403, "another site's page may not call the management API (Sec-Fetch-Site says "
            "where the request came from)", type="permission_error", code="origin_not_allowed",
        )  # fmt: skip
    return None


def admin_guarded(handler: Handler, key: ApiKey) -> Handler:
    """``handler`` as an admin route: refused to another origin's pages
    (:func:`foreign_page`), then behind ``key`` and a fault boundary
    (:func:`~supervisor.fronts.http.requests.guarded`)."""
    checked = guarded(handler, key)

    async def endpoint(request: Request) -> Response:
        refusal = foreign_page(request)
        if refusal is not None:
            log.warning("http_request_refused", code=refusal.code, method=request.method,
                        path=request.url.path, origin=request.headers.get("origin"),
                        fetch_site=request.headers.get("sec-fetch-site"))  # fmt: skip
            return refusal.response()
        return await checked(request)

    return endpoint


async def optional_json(
    request: Request, decoder: msgspec.json.Decoder[T], config: SupervisorConfig, default: T
) -> T:
    """The body decoded (as :func:`read_json`), or ``default`` when there is none.
    Raises ApiError, ClientDisconnect."""
    length = request.headers.get("content-length")
    if "transfer-encoding" not in request.headers and length in (None, "0"):
        return default
    return await read_json(request, decoder, config)


class AdminRoutes:
    """The management API's routes.

    Args:
        registry: the models (its ``events`` hub feeds ``/admin/events``).
        config: the daemon config (keys, limits, the configured models).
        status: the daemon's status (``status --json``'s document).
        reload: the daemon's config reload; None where it has none (501).
        heartbeat_s: how often a stream says it is alive when it has nothing to say.
    """

    def __init__(
        self,
        registry: Registry,
        config: SupervisorConfig,
        status: Callable[[], StatusReply],
        reload: Reload | None = None,
        *,
        heartbeat_s: float = HEARTBEAT_S,
    ) -> None:
        self.registry = registry
        self.config = config
        self.status = status
        self._reload = reload
        self.heartbeat_s = heartbeat_s
        admin_key = config.admin_api_key if config.admin_api_key is not None else config.api_key
        self.key = ApiKey(admin_key)
        self.keyed = admin_key is not None  # the caller proved to be the operator
        self._load_decoder = msgspec.json.Decoder(LoadBody)
        self._clear_decoder = msgspec.json.Decoder(CacheClearBody)
        self._no_body_decoder = msgspec.json.Decoder(NoBody)

    @property
    def hub(self) -> EventHub:
        return self.registry.events

    def routes(self) -> list[Route]:
        """Every route of the management API, behind the admin key."""

        def route(path: str, handler: Handler, method: str) -> Route:
            return Route(path, admin_guarded(handler, self.key), methods=[method])

        return [
            route("/admin/status", self.status_document, "GET"),
            route("/admin/models", self.load, "POST"),
            route("/admin/models/{name}", self.unload, "DELETE"),
            route("/admin/models/{name}/pin", self.pin, "POST"),
            route("/admin/models/{name}/pin", self.unpin, "DELETE"),
            route("/admin/models/{name}/cache/clear", self.clear_cache, "POST"),
            route("/admin/reload", self.reload, "POST"),
            route("/admin/events", self.events, "GET"),
        ]

    # --- the socket's operations ---------------------------------------------------

    async def status_document(self, request: Request) -> Response:
        """``status --json``'s document."""
        return json_response(self.status())

    async def load(self, request: Request) -> Response:
        """Load a model and answer with what the socket's load answers
        (``Loaded``), or stream its progress. A load refused before it starts
        (a bad field, a name taken, a reference not allowed here) is a plain
        error response; one that fails later ends the stream with an
        ``error`` event. Raises ApiError, RequestError."""
        body = await read_json(request, self._load_decoder, self.config)
        stream = wants_stream(request)
        spec = self._spec(body)
        problem = await anyio.to_thread.run_sync(spec_problem, spec)  # reads a hostfile
        if problem:
            raise RequestError("bad_request", problem)
        old = self.registry.entries.get(spec.name)
        if old is not None and old.state not in ("crashed", "failed"):  # those it replaces
            raise RequestError("already_loaded", f"{spec.name} is already loaded ({old.state})")
        log.info("load_requested", model=spec.name, source=spec.model, front="http")
        if not stream:
            return json_response(await self.registry.load(spec))

        async def produce(frames: MemoryObjectSendStream[bytes]) -> None:
            progress: Mailbox[LoadProgress] = Mailbox()

            async def tell(update: LoadProgress) -> None:
                await frames.send(named_sse("progress", ENCODER.encode(update)))

            await frames.send(f"retry: {RECONNECT_MS}\n: loading {spec.name}\n\n".encode())
            try:
                loaded = await beside(
                    functools.partial(progress.forward, tell),
                    functools.partial(self.registry.load, spec, progress.put),
                )
            except RequestError as exc:
                await frames.send(error_event(ApiError.from_request_error(exc)))
                return
            await frames.send(named_sse("loaded", ENCODER.encode(loaded)))

        return EventStream(produce, self.config.client_write_timeout_s)

    def _spec(self, body: LoadBody) -> ModelConfig:
        """The spec the load ``body`` asks for, if this caller may ask it.
        The operator (a key): the socket's load, a configured model named by
        its name or an alias turned into its reference. Anyone else (no key):
        ``model`` alone, loaded as a load on demand would load it. Raises
        ApiError (forbidden), RequestError."""
        if FAULTS_ENV in body.env:
            raise RequestError("forbidden", f"{FAULTS_ENV} (fault injection) is not taken over "
                               "HTTP: load through the socket")  # fmt: skip
        config = self.registry.config
        configured = config.model_config(body.model) or next(
            (m for m in config.models if m.model == body.model), None
        )
        if self.keyed:
            if configured is not None and body.model != configured.model:
                body = msgspec.structs.replace(body, model=configured.model,
                                               name=body.name or configured.name)  # fmt: skip
            return self.registry.spec_for(body)
        anyone = ("without an api_key or admin_api_key any local user reaches this port, so a "
                  "load over HTTP")  # fmt: skip
        bare = LoadBody(model=body.model)
        for field in LoadBody.__struct_fields__:
            if getattr(body, field) != getattr(bare, field):
                raise ApiError(
                    403, f"{anyone} takes only model, loaded as a load on demand would load it "
                    f"(its configured settings): set admin_api_key to load with {field}",
                    type="permission_error", code="forbidden", param=field,
                )  # fmt: skip
        if not config.load_on_demand:
            raise ApiError(403, f"{anyone} loads only what load_on_demand allows, and "
                           "load_on_demand = false: load through the socket, or set "
                           "admin_api_key", type="permission_error", code="forbidden")  # fmt: skip
        if configured is None and config.load_on_demand != "any":
            raise ApiError(
                403, f"{body.model!r} is no configured model: {anyone} loads only configured "
                'models (any reference with load_on_demand = "any")',
                type="permission_error", code="forbidden", param="model",
            )  # fmt: skip
        return on_demand_spec(config, body.model, list(self.registry.entries))

    async def unload(self, request: Request) -> Response:
        """Unload a model (a pinned one too): the reply lists the escalation's steps."""
        return json_response(await self.registry.unload(request.path_params["name"]))

    async def pin(self, request: Request) -> Response:
        """Pin a model: never evicted to make room, never expired."""
        await optional_json(request, self._no_body_decoder, self.config, NoBody())
        entry = self.registry.set_pinned(request.path_params["name"], True)
        return json_response(entry.info())

    async def unpin(self, request: Request) -> Response:
        """Unpin a model: eviction and keep-alive may take it again."""
        entry = self.registry.set_pinned(request.path_params["name"], False)
        return json_response(entry.info())

    async def clear_cache(self, request: Request) -> Response:
        """Drop a model's prefix cache (``disk_only``: only its disk tier)."""
        body = await optional_json(request, self._clear_decoder, self.config, CacheClearBody())
        name = request.path_params["name"]
        return json_response(await self.registry.clear_cache(name, body.disk_only))

    async def reload(self, request: Request) -> Response:
        """Read the config file again and apply it: 200 with what changed, or
        422 with why it was refused (nothing changed then)."""
        await optional_json(request, self._no_body_decoder, self.config, NoBody())
        if self._reload is None:
            raise ApiError(501, "this daemon cannot reload its config (no reload in this build)",
                           type="not_implemented", code="not_implemented")  # fmt: skip
        reply = await self._reload()
        return json_response(reply, 200 if reply.ok else 422)

    # --- events ------------------------------------------------------------------

    async def events(self, request: Request) -> Response:
        """The daemon's events as server-sent events: those after
        ``Last-Event-ID`` or ``?since=ID`` first, then each as it happens."""
        since = replay_from(request)
        return EventStream(functools.partial(self._event_frames, since),
                           self.config.client_write_timeout_s)  # fmt: skip

    async def _event_frames(self, since: int | None, frames: MemoryObjectSendStream[bytes]) -> None:
        """Write the hub's events until it closes or this reader lags (a
        comment says so: an EventSource reconnects from its last id), with a
        heartbeat comment beside them. The first comment goes out once the
        subscription holds: whatever happens after a client has read it, it sees."""
        async with self.hub.subscribe(since) as subscription, anyio.create_task_group() as tg:
            await frames.send(f"retry: {RECONNECT_MS}\n: events of mlx-supervisor\n\n".encode())
            tg.start_soon(self._heartbeats, frames)
            if subscription.missed is not None:
                first, last = subscription.missed
                gone = {"first_id": first, "last_id": last}
                await frames.send(named_sse("missed", ENCODER.encode(gone)))
            async for event in subscription:
                await frames.send(event_frame(event))
            if subscription.lagged:
                await frames.send(b": fell behind: reconnect with Last-Event-ID\n\n")
            tg.cancel_scope.cancel()

    async def _heartbeats(self, frames: MemoryObjectSendStream[bytes]) -> None:
        while True:
            await anyio.sleep(self.heartbeat_s)
            await frames.send(b": keep-alive\n\n")


def route_label(path: str) -> str:
    """The route of a ``/admin/models/NAME[/...]`` path, the name left out (a
    metrics label may not hold what a client chose)."""
    _, slash, tail = path.removeprefix("/admin/models/").partition("/")
    return "/admin/models/{name}" + (slash + tail if tail in ("pin", "cache/clear", "logs") else "")

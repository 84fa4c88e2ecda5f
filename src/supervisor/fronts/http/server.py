"""The HTTP front: uvicorn, run as a task of the daemon's task group.

Starlette routes on uvicorn, beside the control socket, over the same
registry: OpenAI's ``GET /v1/models``, ``POST /v1/chat/completions`` and
``POST /v1/completions`` (one JSON body, or server-sent events with
``stream``); Anthropic's ``POST /v1/messages``
(:mod:`~supervisor.fronts.http.messages_api`); OpenAI's ``POST
/v1/responses`` (:mod:`~supervisor.fronts.http.responses_api`); Ollama's
``/api/*`` (:mod:`~supervisor.fronts.http.ollama_api`); OpenAI's ``POST
/v1/embeddings`` and Ollama's ``/api/embed``
(:mod:`~supervisor.fronts.http.embeddings`); ``GET /health`` and
``GET /metrics``; the management API under ``/admin``
(:mod:`~supervisor.fronts.http.admin`); the dashboard at ``GET /``
(:mod:`~supervisor.fronts.http.dashboard`). Every generating route is one dialect of the one request
path (:mod:`~supervisor.fronts.http.completions`). The server itself runs in the daemon's
task group; each request runs in an asyncio task of uvicorn's own, which
uvicorn cancels when it shuts down: :meth:`HttpFront.stop` gives open
requests STOP_GRACE_S to finish first. Each request is a fault boundary, as a
socket connection is: whatever goes wrong ends that request with an OpenAI
error object, never the daemon. uvicorn's signal handlers are left out (the
daemon owns SIGTERM and SIGINT), the daemon binds the listening socket
itself (a port in use is logged, never a ``sys.exit``), and a connection
must send each request head within ``client_idle_timeout_s`` (idle
connections would otherwise hold ``max_connections`` and shut everyone
out). Before any route, :class:`~supervisor.fronts.http.guard.HttpGuard` refuses
what a web page must not do (a foreign Host or Origin, a body that is not
JSON).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import time
from collections.abc import Callable, Iterator

import anyio
import structlog
import uvicorn
from anyio.abc import TaskStatus
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from ipc.messages import StatusReply
from supervisor.config import SupervisorConfig
from supervisor.fronts.http import embeddings, messages_api, ollama_api, responses_api
from supervisor.fronts.http.admin import AdminRoutes, Reload, route_label
from supervisor.fronts.http.completions import Completions
from supervisor.fronts.http.dashboard import Dashboard
from supervisor.fronts.http.errors import routing_error
from supervisor.fronts.http.guard import HttpGuard
from supervisor.fronts.http.requests import ApiKey, guarded
from supervisor.fronts.http.routes import InfoRoutes
from supervisor.netaddr import is_loopback
from supervisor.registry.registry import Registry
from supervisor.runners.handle import RunnerLogs

log = structlog.get_logger("supervisor.http")

STOP_GRACE_S = 2  # open connections get this long to finish when the daemon exits


class HttpFront:
    """The OpenAI-compatible HTTP front over ``registry``.

    Args:
        registry: the models.
        config: the daemon config (api_key, load_on_demand, limits).
        status: the daemon's status, for ``/metrics``, ``/health`` and ``/admin/status``.
        reload: the daemon's config reload, for ``POST /admin/reload``.
        runner_logs: the runners' lines the dashboard shows (the daemon's).
    """

    def __init__(
        self,
        registry: Registry,
        config: SupervisorConfig,
        status: Callable[[], StatusReply],
        reload: Reload | None = None,
        runner_logs: RunnerLogs | None = None,
    ) -> None:
        self.registry = registry
        self.config = config
        self.status = status
        self.metrics = registry.metrics
        self.metrics.watch_status(status)
        self.url: str | None = None
        self._server: uvicorn.Server | None = None
        self._stopped = anyio.Event()
        key = ApiKey(config.api_key)
        info = InfoRoutes(registry, config, status)
        self.completions = Completions(registry, config, key)
        self.admin = AdminRoutes(registry, config, status, reload)
        self.dashboard = Dashboard(registry, config, status, self.admin.key, runner_logs)
        routes = [
            Route("/v1/models", guarded(info.list_models, key), methods=["GET"]),
            Route("/v1/models/{model:path}", guarded(info.get_model, key), methods=["GET"]),
            Route("/v1/chat/completions", self.completions.route(chat=True), methods=["POST"]),
            Route("/v1/completions", self.completions.route(chat=False), methods=["POST"]),
            Route("/health", guarded(info.health, None), methods=["GET"]),
            Route("/metrics", guarded(info.prometheus, key), methods=["GET"]),
            *messages_api.routes(self.completions, info, key),
            *responses_api.routes(self.completions, info, key),
            *ollama_api.routes(self.completions, info, key),
            *embeddings.routes(self.completions, key),
            *self.admin.routes(),
            *self.dashboard.routes(),  # GET /: the page
        ]
        self.paths = frozenset(route.path for route in routes if "{" not in route.path)
        starlette = Starlette(routes=routes, exception_handlers={HTTPException: routing_error})
        # Before any routing: what a web page may not do (Host, Origin, JSON bodies), and CORS.
        self._guard = HttpGuard(starlette, allowed_hosts=config.http_allowed_hosts,
                                cors_origins=config.http_cors_origins)  # fmt: skip
        self.app: ASGIApp = self._observed(self._guard)

    # --- serving -------------------------------------------------------------

    async def serve(self, host: str, port: int, *, task_status: TaskStatus[str | None]) -> None:
        """Listen on ``host:port`` and serve until :meth:`stop`. Reports the
        base URL, or None when the address cannot be had (logged: the daemon
        goes on without HTTP). A fault boundary: never raises."""
        try:
            sock = await bind_tcp(host, port, self.config.max_connections)
        except OSError as exc:
            log.error("http_listen_failed", host=host, port=port,
                      error=exc.strerror or str(exc),
                      hint="another server has the port? set http_listen or "
                      "serve --http HOST:PORT, or off")  # fmt: skip
            task_status.started(None)
            return
        started = False
        try:
            config = uvicorn_config(
                self.app, self.config.max_connections, self.config.client_idle_timeout_s
            )
            self._server = DaemonUvicorn(config)
            forward_uvicorn_logs()
            self.url = base_url(sock)
            self._guard.hosts.listen_on(host, sock.getsockname()[0])
            if self.config.api_key is None and not is_loopback(sock.getsockname()[0]):
                log.warning("http_open_without_api_key", url=self.url)
            log.info("http_listening", url=self.url)
            task_status.started(self.url)
            started = True
            await self._server.serve(sockets=[sock])
        except (Exception, SystemExit):  # uvicorn may sys.exit: that must not end the daemon
            log.exception("http_server_failed", url=self.url)
        finally:
            self.url = None
            sock.close()
            self._stopped.set()
            if not started:
                task_status.started(None)

    async def stop(self) -> None:
        """Stop accepting; open connections get STOP_GRACE_S to finish."""
        if self._server is None:
            return
        self._server.should_exit = True
        with anyio.move_on_after(STOP_GRACE_S + 1):
            await self._stopped.wait()

    def _observed(self, app: ASGIApp) -> ASGIApp:
        """``app``, counting each response by route and status, and logging it."""

        async def observed(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            started = time.perf_counter()
            status = [0]

            async def send_observed(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status[0] = message["status"]
                await send(message)

            try:
                await app(scope, receive, send_observed)
            finally:
                path = scope["path"]
                route = path if path in self.paths else "other"
                if path.startswith("/v1/models/"):
                    route = "/v1/models/{model}"
                elif path.startswith("/admin/models/"):
                    route = route_label(path)
                code = str(status[0]) if status[0] else "none"  # the client left first
                self.metrics.http_requests.labels(route, code).inc()
                level = log.info if path.startswith(("/v1/", "/api/")) else log.debug
                level("http_request", method=scope["method"], path=route, status=status[0],
                      elapsed_s=round(time.perf_counter() - started, 3))  # fmt: skip

        return observed


# --- uvicorn and its socket ------------------------------------------------------


class DaemonUvicorn(uvicorn.Server):
    """uvicorn without its signal handlers: the daemon owns SIGTERM and SIGINT
    (uvicorn's would replace them while it serves)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 connection, closed when it has not sent a whole request
    head within ``head_timeout_s`` of opening or of its last response.

    uvicorn has no such deadline: a connection that sends nothing, or sends a
    head a byte at a time (any byte stops uvicorn's keep-alive timer), stays
    open for good, and ``max_connections`` of them would make every request,
    /health too, a 503 (uvicorn's ``limit_concurrency``). A request in
    progress is never cut: its body has its own deadline (the 408 of
    ``_read_json``), and its response takes as long as it takes.
    """

    head_timeout_s: float = 10.0  # set by head_deadline_protocol

    _head_timer: asyncio.TimerHandle | None = None
    _waiting_cycle: object = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        self._arm_head_deadline()  # first: super() may start a pipelined request
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        """From now, a new request head must be complete within head_timeout_s.
        A new head makes a new cycle: the deadline then does nothing."""
        self._disarm_head_deadline()
        self._waiting_cycle = self.cycle
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_overdue)

    def _disarm_head_deadline(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_overdue(self) -> None:
        self._head_timer = None
        if self.cycle is self._waiting_cycle and not self.transport.is_closing():
            self.transport.close()  # connection_lost follows: uvicorn forgets it


def head_deadline_protocol(head_timeout_s: float) -> type[HeadDeadlineProtocol]:
    """HeadDeadlineProtocol with its deadline (uvicorn makes one per connection
    from the class, passing only its own config)."""
    return type("HeadDeadlineProtocol", (HeadDeadlineProtocol,), {"head_timeout_s": head_timeout_s})


def uvicorn_config(app: ASGIApp, max_connections: int, head_timeout_s: float) -> uvicorn.Config:
    """uvicorn as the daemon wants it: h11 only, with a deadline for each
    request head, no lifespan, no websockets, no logging setup of its own
    (its warnings come to our log), no access log (we log requests
    ourselves), and a bound on connections (idle ones are closed by the head
    deadline, so they cannot hold it for good)."""
    return uvicorn.Config(
        app,
        http=head_deadline_protocol(head_timeout_s),
        ws="none",
        lifespan="off",
        interface="asgi3",
        log_config=None,
        access_log=False,
        server_header=False,
        proxy_headers=False,
        limit_concurrency=max_connections,
        timeout_graceful_shutdown=STOP_GRACE_S,
    )


async def bind_tcp(host: str, port: int, backlog: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one).

    Raises:
        OSError: the name does not resolve, or the address is taken or not ours.
    """
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        if sys.platform.startswith("linux"):
            # On Linux it only lets a port in TIME_WAIT be taken again (a TIME_WAIT
            # is no owner). Not elsewhere: on macOS and the BSDs it would also let
            # us bind 127.0.0.1:P while another socket holds *:P, and a port in
            # use would go unnoticed.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def base_url(sock: socket.socket) -> str:
    """``http://HOST:PORT`` of a bound socket (the real port when 0 was asked)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class UvicornLogForwarder(logging.Handler):
    """uvicorn's own warnings and errors, as our log records."""

    def emit(self, record: logging.LogRecord) -> None:
        log.warning("http_server_said", message=record.getMessage(), exc_info=record.exc_info)


def forward_uvicorn_logs() -> None:
    """Send uvicorn's error logger to ours (once), not to stderr as text."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(h, UvicornLogForwarder) for h in logger.handlers):
        logger.addHandler(UvicornLogForwarder(logging.WARNING))
        logger.propagate = False

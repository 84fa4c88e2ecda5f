"""The OpenAI-compatible HTTP front: uvicorn, run as a task of the daemon's
task group.

Starlette routes on uvicorn, beside the control socket, over the same
registry: ``GET /v1/models``, ``POST /v1/chat/completions`` and ``POST
/v1/completions`` (one JSON body, or server-sent events with ``stream``),
``GET /health`` and ``GET /metrics``. The server itself runs in the daemon's
task group; each request runs in an asyncio task of uvicorn's own, which
uvicorn cancels when it shuts down: :meth:`HttpFront.stop` gives open
requests STOP_GRACE_S to finish first. Each request is a fault boundary, as a
socket connection is: whatever goes wrong ends that request with an OpenAI
error object, never the daemon. uvicorn's signal handlers are left out (the
daemon owns SIGTERM and SIGINT), the daemon binds the listening socket
itself (a port in use is logged, never a ``sys.exit``), and a connection
must send each request head within ``client_idle_timeout_s`` (idle
connections would otherwise hold ``max_connections`` and shut everyone
out). Before any route, :class:`~supervisor.http_guard.HttpGuard` refuses
what a web page must not do (a foreign Host or Origin, a body that is not
JSON).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import secrets
import socket
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Annotated, Any, TypeVar

import anyio
import msgspec
import structlog
import uvicorn
from anyio.abc import TaskStatus
from msgspec import Meta
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from ipc.messages import (
    ChatMessage,
    GenerateRequest,
    GenerationDone,
    LoadProgress,
    SamplingParams,
    StatusReply,
    TextChunk,
)
from supervisor import __version__
from supervisor.config import SupervisorConfig
from supervisor.control import ClientGone, Mailbox
from supervisor.http_errors import ApiError, internal_error, validation_error
from supervisor.http_guard import HttpGuard
from supervisor.registry import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    ModelEntry,
    Registry,
    RequestError,
)
from supervisor.waiting import beside, wait_unless

log = structlog.get_logger("supervisor.http")

T = TypeVar("T")
STOP_GRACE_S = 2  # open connections get this long to finish when the daemon exits
OWNER = "mlx-supervisor"
ROUTES = ("/v1/models", "/v1/chat/completions", "/v1/completions", "/health", "/metrics")

# Our finish reasons as OpenAI's (ours is also sent, in the "supervisor" field).
FINISH_REASONS = {
    "stop": "stop",
    "length": "length",
    "memory_pressure": "length",  # cut short for want of memory, as for want of room
    "cancelled": "stop",
    "error": "stop",
}


# --- request bodies --------------------------------------------------------------
# Unknown fields are ignored: clients send many (tools, logprobs, user, ...).

MaxTokens = Annotated[int, Meta(ge=1, le=1 << 31)]


class TextPart(msgspec.Struct):
    """One part of a message's content; only text parts are understood."""

    type: str
    text: str | None = None


class ChatTurn(msgspec.Struct):
    role: str
    content: str | list[TextPart] | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class CompletionFields(msgspec.Struct, kw_only=True):
    """What chat and text completions share."""

    model: str
    max_tokens: MaxTokens | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None


class ChatCompletionRequest(CompletionFields, kw_only=True):
    messages: list[ChatTurn]
    max_completion_tokens: MaxTokens | None = None


class CompletionRequest(CompletionFields, kw_only=True):
    prompt: str | list[str]


ENCODER = msgspec.json.Encoder()


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """``stop`` as the runner takes it. Raises ApiError."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS or not all(0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise ApiError(
            400, f"stop takes up to {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_CHARS} "
            "characters", param="stop", code="bad_request",
        )  # fmt: skip
    return tuple(stops)


def chat_messages(turns: list[ChatTurn]) -> list[ChatMessage]:
    """The turns as the runner takes them: text content only. Raises ApiError."""
    if not turns:
        raise ApiError(400, "messages is empty", param="messages", code="bad_request")
    messages = []
    for turn in turns:
        content = turn.content
        if isinstance(content, list):
            kinds = {part.type for part in content} - {"text"}
            if kinds:
                raise ApiError(
                    400, f"only text content is supported, not {', '.join(sorted(kinds))}",
                    param="messages", code="bad_request",
                )  # fmt: skip
            content = "".join(part.text or "" for part in content)
        messages.append(ChatMessage(turn.role, content or ""))
    return messages


# --- answers -----------------------------------------------------------------------


class Reply:
    """The OpenAI objects of one completion: its chunks while it streams, or
    the whole of it at the end."""

    def __init__(self, chat: bool, model: str, include_usage: bool) -> None:
        self.chat = chat
        self.model = model
        self.include_usage = include_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def _object(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": f"{OWNER}-{__version__}",
            "choices": choices,
            **extra,
        }

    def _chunk(self, choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        choice = {"index": 0, **choice, "logprobs": None}
        if self.include_usage:
            extra.setdefault("usage", None)
        return self._object(kind, [choice], **extra)

    def role_chunk(self) -> dict[str, Any] | None:
        """The first chunk of a chat stream (None for text completions)."""
        if not self.chat:
            return None
        return self._chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})

    def text_chunk(self, text: str) -> dict[str, Any]:
        part = {"delta": {"content": text}} if self.chat else {"text": text}
        return self._chunk({**part, "finish_reason": None})

    def end_chunk(self, done: GenerationDone) -> dict[str, Any]:
        part: dict[str, Any] = {"delta": {}} if self.chat else {"text": ""}
        return self._chunk(
            {**part, "finish_reason": FINISH_REASONS[done.finish_reason]},
            supervisor=self._ours(done),
        )

    def usage_chunk(self, done: GenerationDone) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._object(kind, [], usage=usage(done))

    def whole(self, text: str, done: GenerationDone) -> dict[str, Any]:
        finish = FINISH_REASONS[done.finish_reason]
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": finish, "logprobs": None}  # fmt: skip
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        kind = "chat.completion" if self.chat else "text_completion"
        return self._object(kind, [choice], usage=usage(done), supervisor=self._ours(done))

    @staticmethod
    def _ours(done: GenerationDone) -> dict[str, Any]:
        """What OpenAI's objects have no field for."""
        return {
            "finish_reason": done.finish_reason,
            "detail": done.detail,
            "ttft_s": round(done.ttft_s, 4),
            "prompt_tps": round(done.prompt_tps, 1),
            "generation_tps": round(done.generation_tps, 1),
            "batched": done.batched,
            "max_tokens_clamped_to": done.max_tokens_clamped_to,
        }


def usage(done: GenerationDone) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.generation_tokens,
        "total_tokens": done.prompt_tokens + done.generation_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


def sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


# What a send raises once the client has gone: OSError (as the ASGI spec asks
# of servers), or anyio's closed-stream errors when a middleware passes the
# messages through a memory stream that the client's leaving closed.
VANISHED = (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError)


class ResponseWriter:
    """Writes one response to an ASGI ``send``. The head goes out only when
    there is something to say, so an error before that still gets its own
    status; each write has a deadline (a client that reads nothing this long
    is gone), and a client that left makes every write raise ClientGone."""

    def __init__(self, send: Send, write_timeout_s: float) -> None:
        self._send = send
        self.write_timeout_s = write_timeout_s
        self.started = False
        self.streaming = False
        self.ended = False
        self.gone = False
        self._lock = anyio.Lock()

    async def _write(self, *messages: Message) -> None:
        async with self._lock:
            if self.gone:
                raise ClientGone("the HTTP client is gone")
            try:
                with anyio.fail_after(self.write_timeout_s):
                    for message in messages:
                        await self._send(message)
            except TimeoutError:
                self.gone = True
                raise ClientGone(f"the client read nothing for {self.write_timeout_s:g}s") from None
            except VANISHED as exc:
                self.gone = True
                raise ClientGone(str(exc) or type(exc).__name__) from None

    def _head(self, status: int, media_type: str, headers: dict[str, str]) -> Message:
        self.started = True
        fields = [(b"content-type", media_type.encode())]
        fields += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        return {"type": "http.response.start", "status": status, "headers": fields}

    async def whole(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        """The whole response at once (JSON)."""
        head = self._head(
            status, "application/json", {**(headers or {}), "content-length": str(len(body))}
        )
        self.ended = True
        await self._write(head, {"type": "http.response.body", "body": body})

    async def event(self, data: bytes) -> None:
        """One server-sent event (``data: ...``), the head first if need be."""
        await self._stream_bytes(sse(data))

    async def comment(self, text: str) -> None:
        """A server-sent comment: a keep-alive that clients skip."""
        await self._stream_bytes(f": {text}\n\n".encode())

    async def _stream_bytes(self, chunk: bytes) -> None:
        messages: list[Message] = []
        if not self.started:
            self.streaming = True
            headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
            messages.append(self._head(200, "text/event-stream; charset=utf-8", headers))
        messages.append({"type": "http.response.body", "body": chunk, "more_body": True})
        await self._write(*messages)

    async def end(self) -> None:
        """Close a stream."""
        if not self.ended:
            self.ended = True
            await self._write({"type": "http.response.body", "body": b""})

    async def fail(self, error: ApiError) -> None:
        """Send ``error``: as the response, or, once a stream has started, as
        its last event. Best effort: the client may be gone."""
        with contextlib.suppress(ClientGone):
            if not self.started:
                await self.whole(error.status, ENCODER.encode(error.body()), error.headers)
            elif self.streaming and not self.ended:
                await self.event(ENCODER.encode(error.body()))
                await self.end()


# --- the application -------------------------------------------------------------


class CompletionCall(msgspec.Struct, kw_only=True):
    """A completion request, checked, waiting for its model."""

    chat: bool
    model: str
    messages: list[ChatMessage] | None
    prompt: str | None
    max_tokens: int | None
    sampling: SamplingParams
    stream: bool
    include_usage: bool


class HttpFront:
    """The OpenAI-compatible HTTP front over ``registry``.

    Args:
        registry: the models.
        config: the daemon config (api_key, load_on_demand, limits).
        status: the daemon's status, for ``/metrics`` and ``/health``.
    """

    def __init__(
        self,
        registry: Registry,
        config: SupervisorConfig,
        status: Callable[[], StatusReply],
    ) -> None:
        self.registry = registry
        self.config = config
        self.status = status
        self.metrics = registry.metrics
        self.metrics.watch_status(status)
        self.url: str | None = None
        self._server: uvicorn.Server | None = None
        self._stopped = anyio.Event()
        self._api_key = config.api_key.encode() if config.api_key is not None else None
        self._chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
        self._completion_decoder = msgspec.json.Decoder(CompletionRequest)
        guard = self._guarded
        routes = [
            Route("/v1/models", guard(self.list_models, auth=True), methods=["GET"]),
            Route("/v1/models/{model:path}", guard(self.get_model, auth=True), methods=["GET"]),
            Route("/v1/chat/completions", CompletionRoute(self, chat=True), methods=["POST"]),
            Route("/v1/completions", CompletionRoute(self, chat=False), methods=["POST"]),
            Route("/health", guard(self.health, auth=False), methods=["GET"]),
            Route("/metrics", guard(self.prometheus, auth=True), methods=["GET"]),
        ]
        starlette = Starlette(routes=routes, exception_handlers={HTTPException: self._http_error})
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
            if self.config.api_key is None and not is_loopback(sock):
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

    # --- plumbing ------------------------------------------------------------

    def _guarded(
        self, handler: Callable[[Request], Awaitable[Response]], *, auth: bool
    ) -> Callable[[Request], Awaitable[Response]]:
        """``handler`` as a fault boundary (and behind the API key)."""

        async def endpoint(request: Request) -> Response:
            try:
                if auth:
                    self._check_key(request)
                return await handler(request)
            except ApiError as err:
                return err.response()
            except RequestError as exc:
                return ApiError.from_request_error(exc).response()
            except ClientDisconnect:
                return Response(status_code=400)  # no one reads it
            except Exception as exc:  # a fault boundary: the daemon outlives any request
                log.exception("http_request_failed", path=request.url.path)
                return internal_error(exc).response()

        return endpoint

    def _check_key(self, request: Request) -> None:
        if self._api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 self._api_key):  # fmt: skip
            raise ApiError(
                401, "missing or wrong API key (Authorization: Bearer KEY)",
                type="authentication_error", code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )  # fmt: skip

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        """Starlette's own 404 and 405, as OpenAI error objects."""
        assert isinstance(exc, HTTPException)
        headers = dict(exc.headers or {})
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return ApiError(exc.status_code, message, type=kind, headers=headers).response()

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
                route = path if path in ROUTES else "other"
                if path.startswith("/v1/models/"):
                    route = "/v1/models/{model}"
                code = str(status[0]) if status[0] else "none"  # the client left first
                self.metrics.http_requests.labels(route, code).inc()
                level = log.info if path.startswith("/v1/") else log.debug
                level("http_request", method=scope["method"], path=route, status=status[0],
                      elapsed_s=round(time.perf_counter() - started, 3))  # fmt: skip

        return observed

    async def _read_json(self, request: Request, decoder: msgspec.json.Decoder[T]) -> T:
        """The body, capped at max_frame_bytes and read within
        client_idle_timeout_s, decoded. Raises ApiError, ClientDisconnect."""
        limit = self.config.max_frame_bytes
        too_large = ApiError(413, f"the body is over {limit} bytes (max_frame_bytes)",
                             code="bad_request")  # fmt: skip
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        body = bytearray()
        try:
            with anyio.fail_after(self.config.client_idle_timeout_s):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > limit:
                        raise too_large
        except TimeoutError:
            raise ApiError(408, f"the body took over {self.config.client_idle_timeout_s:g}s "
                           "(client_idle_timeout_s)", code="bad_request") from None  # fmt: skip
        try:
            return decoder.decode(body)
        except msgspec.MsgspecError as exc:
            raise validation_error(exc) from None

    # --- routes --------------------------------------------------------------

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
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    def _model_objects(self) -> list[dict[str, Any]]:
        """Loaded models, then configured ones that are not loaded."""
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
        return objects

    async def list_models(self, request: Request) -> Response:
        body = {"object": "list", "data": self._model_objects()}
        return Response(ENCODER.encode(body), media_type="application/json")

    async def get_model(self, request: Request) -> Response:
        wanted = request.path_params["model"]
        for obj in self._model_objects():
            if wanted in (obj["id"], obj["model"]):
                return Response(ENCODER.encode(obj), media_type="application/json")
        raise ApiError(404, f"no model {wanted!r}", type="not_found_error", code="unknown_model",
                       param="model")  # fmt: skip

    # --- completions ---------------------------------------------------------

    async def serve_completion(self, scope: Scope, receive: Receive, send: Send, *,
                               chat: bool) -> None:  # fmt: skip
        """One completion request, from its first byte to its last, so that a
        client leaving cancels the work. A fault boundary: never raises."""
        writer = ResponseWriter(send, self.config.client_write_timeout_s)
        request = Request(scope, receive)
        try:
            self._check_key(request)
            call = await self._parse_completion(request, chat=chat)
            await self._complete(call, receive, writer)
        except ApiError as err:
            await writer.fail(err)
        except RequestError as exc:
            await writer.fail(ApiError.from_request_error(exc))
        except (ClientDisconnect, ClientGone):
            pass
        except Exception as exc:  # a fault boundary: the daemon outlives any request
            log.exception("http_request_failed", path=scope["path"])
            await writer.fail(internal_error(exc))
        if writer.streaming:
            with contextlib.suppress(ClientGone):
                await writer.end()

    async def _parse_completion(self, request: Request, *, chat: bool) -> CompletionCall:
        """The checked request. Raises ApiError."""
        fields: CompletionFields
        messages: list[ChatMessage] | None = None
        prompt: str | None = None
        max_tokens: int | None
        if chat:
            body = await self._read_json(request, self._chat_decoder)
            messages = chat_messages(body.messages)
            max_tokens = body.max_completion_tokens or body.max_tokens
            fields = body
        else:
            text = await self._read_json(request, self._completion_decoder)
            if isinstance(text.prompt, list):
                if len(text.prompt) != 1:
                    raise ApiError(400, "give one prompt per request", param="prompt",
                                   code="bad_request")  # fmt: skip
                prompt = text.prompt[0]
            else:
                prompt = text.prompt
            max_tokens = text.max_tokens
            fields = text
        if fields.n not in (None, 1):
            raise ApiError(400, "only n = 1 is supported", param="n", code="bad_request")
        defaults = SamplingParams()
        sampling = SamplingParams(
            temperature=defaults.temperature if fields.temperature is None else fields.temperature,
            top_p=defaults.top_p if fields.top_p is None else fields.top_p,
            seed=fields.seed,
            stop=stop_strings(fields.stop),
        )
        options = fields.stream_options
        return CompletionCall(
            chat=chat, model=fields.model, messages=messages, prompt=prompt,
            max_tokens=max_tokens, sampling=sampling, stream=bool(fields.stream),
            include_usage=bool(options is not None and options.include_usage),
        )  # fmt: skip

    async def _complete(
        self, call: CompletionCall, receive: Receive, writer: ResponseWriter
    ) -> None:
        """Find or load the model, generate, and write the answer; a client
        that disconnects cancels it. Raises ApiError or RequestError."""
        cancel = anyio.Event()

        async def work() -> None:
            entry = await self._model_for(call, writer, cancel)
            if entry is not None:
                await self._generate(call, entry, writer, cancel)

        await beside(functools.partial(watch_disconnect, receive, cancel, writer), work)

    async def _model_for(
        self, call: CompletionCall, writer: ResponseWriter, cancel: anyio.Event
    ) -> ModelEntry | None:
        """The model the call names, loaded (on demand: a stream hears the
        load's progress as comments). A model being stopped (keep-alive ran
        out, or admission evicted it) is waited for, up to queue_timeout_s,
        and then found or loaded again. None if the client left meanwhile.
        Raises RequestError (unavailable, or the load failed)."""
        progress: Mailbox[LoadProgress] = Mailbox()
        found: list[ModelEntry] = []

        async def keep_alive(p: LoadProgress) -> None:
            await writer.comment(f"loading {p.name} {p.phase} {p.done}/{p.total}")

        async def load() -> None:
            listener = progress.put if call.stream else None
            deadline = anyio.current_time() + self.config.queue_timeout_s
            while True:
                entry = await self.registry.ensure_loaded(call.model, listener)
                if entry.state != "stopping":
                    break
                with anyio.move_on_after(deadline - anyio.current_time()):
                    await entry.forgotten.wait()
                    continue  # stopped and gone: find or load it again
                break  # still stopping: check_available says so
            found.append(entry)

        await beside(functools.partial(progress.forward, keep_alive),
                     functools.partial(wait_unless, cancel, load))  # fmt: skip
        if not found:
            return None
        entry = found[0]
        check_available(entry)
        return entry

    async def _generate(
        self, call: CompletionCall, entry: ModelEntry, writer: ResponseWriter, cancel: anyio.Event
    ) -> None:
        """Run the generation and write it: as events while it streams, or
        whole at the end. A client that leaves cancels it in the runner."""
        max_tokens = call.max_tokens or entry.spec.max_tokens or self.config.max_tokens
        request = GenerateRequest(
            name=entry.name, prompt=call.prompt, messages=call.messages,
            sampling=msgspec.structs.replace(call.sampling, max_tokens=max_tokens),
        )  # fmt: skip
        reply = Reply(call.chat, entry.name, call.include_usage)
        texts: list[str] = []
        dones: list[GenerationDone] = []
        queued: Mailbox[int] = Mailbox()

        async def write(chunk: dict[str, Any] | None) -> None:
            if chunk is not None:
                await writer.event(ENCODER.encode(chunk))

        async def emit(event: TextChunk | GenerationDone, body: bytes | None) -> None:
            queued.close()  # no place in line after the first word
            if cancel.is_set():  # the client left: take the rest quietly (the metrics count it)
                return
            if isinstance(event, GenerationDone):
                dones.append(event)
            elif not call.stream:
                texts.append(event.text)
            elif event.text:
                if not texts:  # the stream's first words: the role first
                    await write(reply.role_chunk())
                texts.append(event.text)
                await write(reply.text_chunk(event.text))

        async def tell_place() -> None:
            if call.stream:
                await queued.forward(lambda position: writer.comment(f"queued {position}"))

        await beside(tell_place, functools.partial(
            self.registry.generate, request, emit, cancel, on_queued=queued.put
        ))  # fmt: skip
        if cancel.is_set() or writer.gone:
            return  # the client left: nothing to write
        if not dones:
            raise RequestError("internal", "the generation ended without its last frame")
        done = dones[0]
        if not call.stream:
            await writer.whole(200, ENCODER.encode(reply.whole("".join(texts), done)))
            return
        if not texts:
            await write(reply.role_chunk())
        await write(reply.end_chunk(done))
        if call.include_usage:
            await writer.event(ENCODER.encode(reply.usage_chunk(done)))
        await writer.event(b"[DONE]")
        await writer.end()


class CompletionRoute:
    """The ASGI app of a completion route (an object, not a function, so
    that Starlette hands it the raw ASGI messages)."""

    def __init__(self, front: HttpFront, *, chat: bool) -> None:
        self.front = front
        self.chat = chat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.front.serve_completion(scope, receive, send, chat=self.chat)


def check_available(entry: ModelEntry) -> None:
    """Refuse at once a model that cannot serve soon: restarting (in
    backoff), crashed, failed, or still stopping (``_model_for`` waits for a
    stop up to queue_timeout_s first). A load in progress is waited for.

    Raises:
        RequestError: not_ready (503, with Retry-After while restarting), or
            insufficient_memory (507) when admission left it failed.
    """
    state = entry.state
    if state in ("ready", "busy", "starting", "loading"):
        return
    cause = entry.failure or (entry.last_exit.cause if entry.last_exit else None)
    detail = f": {cause}" if cause else ""
    if state == "failed" and entry.load_error_code == "insufficient_memory":
        raise RequestError("insufficient_memory", f"{entry.name} is failed{detail}")
    hint = "; load it again to retry" if state in ("failed", "crashed") else ""
    error = RequestError("not_ready", f"{entry.name} is {state}{detail}{hint}")
    if state == "restarting" and entry.next_restart_at is not None:
        raise ApiError.from_request_error(error, entry.next_restart_at - time.time())
    raise error


async def watch_disconnect(receive: Receive, cancel: anyio.Event, writer: ResponseWriter) -> None:
    """Set ``cancel`` when the client disconnects (the body is read by then:
    the next ASGI message is the disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            writer.gone = True
            cancel.set()
            return


# --- the server ----------------------------------------------------------------


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


def is_loopback(sock: socket.socket) -> bool:
    host = sock.getsockname()[0]
    return bool(host.startswith("127.") or host == "::1")


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

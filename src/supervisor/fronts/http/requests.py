"""What every route of the HTTP front does with its request before its own
work: check the API key, read the JSON body within its limits, and stand as a
fault boundary (whatever goes wrong ends that request with an OpenAI error
object, never the daemon)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import msgspec
import structlog
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from supervisor.config import SupervisorConfig
from supervisor.fronts.http.errors import ApiError, internal_error, validation_error
from supervisor.fronts.http.streaming import OPENAI, Framing
from supervisor.registry.registry import RequestError

log = structlog.get_logger("supervisor.http")

T = TypeVar("T")
Handler = Callable[[Request], Awaitable[Response]]


class ApiKey:
    """The ``api_key`` a request must carry, as ``Authorization: Bearer KEY``
    (OpenAI's and Ollama's clients) or ``x-api-key: KEY`` (Anthropic's);
    None: no key is asked for."""

    def __init__(self, key: str | None) -> None:
        self._key = key.encode() if key is not None else None

    def check(self, request: Request) -> None:
        """Raises ApiError (401) unless ``request`` carries the key."""
        if self._key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            given = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.strip().encode(), self._key):
            raise ApiError(
                401, "missing or wrong API key (Authorization: Bearer KEY, or x-api-key: KEY)",
                type="authentication_error", code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )  # fmt: skip


def guarded(handler: Handler, key: ApiKey | None, framing: Framing = OPENAI) -> Handler:
    """``handler`` as a fault boundary (and behind ``key``, when given); its
    errors in the shape ``framing`` gives them."""

    def failed(error: ApiError) -> Response:
        body = framing.error_body(error)
        return Response(body, error.status, error.headers, media_type="application/json")

    async def endpoint(request: Request) -> Response:
        try:
            if key is not None:
                key.check(request)
            return await handler(request)
        except ApiError as err:
            return failed(err)
        except RequestError as exc:
            return failed(ApiError.from_request_error(exc))
        except ClientDisconnect:
            return Response(status_code=400)  # no one reads it
        except Exception as exc:  # a fault boundary: the daemon outlives any request
            log.exception("http_request_failed", path=request.url.path)
            return failed(internal_error(exc))

    return endpoint


async def read_json(
    request: Request, decoder: msgspec.json.Decoder[T], config: SupervisorConfig
) -> T:
    """The body, capped at max_frame_bytes and read within
    client_idle_timeout_s, decoded. Raises ApiError, ClientDisconnect."""
    limit = config.max_frame_bytes
    too_large = ApiError(413, f"the body is over {limit} bytes (max_frame_bytes)",
                         code="bad_request")  # fmt: skip
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    try:
        with anyio.fail_after(config.client_idle_timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise too_large
    except TimeoutError:
        raise ApiError(408, f"the body took over {config.client_idle_timeout_s:g}s "
                       "(client_idle_timeout_s)", code="bad_request") from None  # fmt: skip
    try:
        return decoder.decode(body)
    except msgspec.MsgspecError as exc:
        raise validation_error(exc) from None

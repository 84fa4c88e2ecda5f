"""The HTTP front's error objects, in OpenAI's shape: ``{"error": {"message",
"type", "param", "code"}}``, with the HTTP status of each registry error code."""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from ipc.messages import ErrorCode
from supervisor.registry.registry import RequestError

RETRY_AFTER_BUSY_S = 1
ENCODER = msgspec.json.Encoder()

# Every registry error code, as an HTTP status and an OpenAI error type.
ERROR_STATUS: dict[ErrorCode, tuple[int, str]] = {
    "bad_request": (400, "invalid_request_error"),
    "too_large": (413, "invalid_request_error"),  # over max_frame_bytes as a runner command
    "protocol": (400, "invalid_request_error"),
    "forbidden": (403, "permission_error"),
    "unknown_model": (404, "not_found_error"),
    "already_loaded": (409, "invalid_request_error"),  # a reference's name is taken
    "busy": (429, "rate_limit_error"),
    "internal": (500, "server_error"),
    "runner_died": (500, "server_error"),  # the message names the signal or cause
    "generation_failed": (500, "server_error"),
    "load_failed": (503, "server_error"),
    "not_ready": (503, "server_error"),  # restarting, failed, stopping, timed out in line
    "shutting_down": (503, "server_error"),
    "insufficient_memory": (507, "server_error"),
}


class ApiError(Exception):
    """An HTTP request fails with ``status`` and an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    @classmethod
    def from_request_error(cls, exc: RequestError, retry_after_s: float | None = None) -> ApiError:
        """The HTTP form of a registry error (see ERROR_STATUS)."""
        status, kind = ERROR_STATUS.get(exc.code, (500, "server_error"))
        if exc.code == "busy" and retry_after_s is None:
            retry_after_s = RETRY_AFTER_BUSY_S
        headers = {}
        if retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
        return cls(status, exc.message, type=kind, code=exc.code, headers=headers)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> Response:
        body = msgspec.json.encode(self.body())
        return Response(body, self.status, self.headers, media_type="application/json")


def validation_error(exc: msgspec.MsgspecError) -> ApiError:
    """A 400 for a body msgspec refused, naming the field when it can: a
    field the body's struct does not have is ``unsupported parameter: X``
    (``X`` with its path when nested: ``messages[0].audio``)."""
    text = str(exc)
    if not isinstance(exc, msgspec.ValidationError):
        return ApiError(400, f"invalid JSON: {text}", code="bad_request")
    unknown = re.fullmatch(r"Object contains unknown field `(.+?)`(?: - at `\$\.(.+)`)?", text)
    if unknown is not None:
        field, path = unknown.groups()
        param = f"{path}.{field}" if path else field
        return ApiError(400, f"unsupported parameter: {param}", code="bad_request", param=param)
    found = re.search(r"`\$\.([A-Za-z_]+)", text) or re.search(r"field `(\w+)`", text)
    param = found.group(1) if found else None
    return ApiError(400, f"invalid request: {text}", code="bad_request", param=param)


def internal_error(exc: Exception) -> ApiError:
    return ApiError(500, f"internal error: {exc!r}", type="server_error", code="internal")


async def routing_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 and 405, as OpenAI error objects."""
    assert isinstance(exc, HTTPException)
    headers = dict(exc.headers or {})
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return ApiError(exc.status_code, message, type=kind, headers=headers).response()

"""Who may call the HTTP front: the checks that web browsers make necessary.

Any page in a browser on this machine can send requests to loopback, and
three holes follow (Ollama had them; its fix was a Host check and an origin
allow-list). :class:`HttpGuard`, in front of every route, closes them before
any routing, so a refused request reaches no handler (no load, no
generation):

- DNS rebinding: a page whose name now resolves to 127.0.0.1 is
  same-origin with the front and may read every answer. Its requests carry
  its own name as ``Host``: only the loopback names, the listen address and
  ``http_allowed_hosts`` are served (403 ``host_not_allowed``).
- Simple requests: a page may send a GET, or a POST with a form or
  ``text/plain`` body, to any address without a CORS preflight. CORS only
  keeps the page from reading the answer; the request still acts. A request
  with an ``Origin`` is served only from the daemon's own pages (the Origin
  is its own base URL) or an origin in ``http_cors_origins`` (403
  ``origin_not_allowed``); clients that are not browsers send no Origin.
- Requests without an Origin: an ``<img>`` or ``<script>`` of any page sends
  its GET with none; browsers say where such a request comes from in
  ``Sec-Fetch-Site``, and another site's (``cross-site``, ``same-site``) is
  refused, but for a link the user follows (``Sec-Fetch-Mode: navigate``:
  the answer is shown to the user, not to the page) and with
  ``http_cors_origins = ["*"]``.
- Bodies: a POST must say ``Content-Type: application/json`` (parameters
  allowed), which no simple request can (415 ``unsupported_media_type``).

Starlette's CORSMiddleware answers the preflights of the allowed origins and
adds their headers to the answers; a refused origin's preflight is a 403 here.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Sequence

import psutil
import structlog
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from supervisor.fronts.http.errors import ApiError
from supervisor.netaddr import IpAddress, ip_address, is_loopback

log = structlog.get_logger("supervisor.http")

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
JSON = "application/json"
CORS_MAX_AGE_S = 600
FOREIGN_FETCH_SITES = frozenset({"cross-site", "same-site"})
"""Sec-Fetch-Site values of a request a page of another origin made (a
browser sends the header with every request, and an Origin only with some)."""


def host_name(header: str) -> str | None:
    """The name a ``Host`` header holds (``name``, ``name:port``,
    ``[v6]:port``), lowercased, without its port, its brackets or a final
    dot; None for a header that is none of those."""
    if header.startswith("["):
        name, bracket, rest = header[1:].partition("]")
        port_sep, port = rest[:1], rest[1:]
        if not bracket or (rest and port_sep != ":") or ip_address(name) is None:
            return None
    else:
        name, port_sep, port = header.rpartition(":")
        if not port_sep:
            name, port = header, ""
        if ":" in name:  # an IPv6 address without its brackets
            return None
    if port and not port.isdigit():
        return None
    name = name.lower().removesuffix(".")
    if not name or any(c.isspace() or c in "/@[]" for c in name):
        return None
    return name


def interface_addresses() -> set[IpAddress]:
    """The addresses of this machine's network interfaces."""
    found: set[IpAddress] = set()
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family in (socket.AF_INET, socket.AF_INET6):
                ip = ip_address(address.address.partition("%")[0])  # without an IPv6 zone
                if ip is not None:
                    found.add(ip)
    return found


class AllowedHosts:
    """The names a request's ``Host`` may carry: ``localhost`` and every
    loopback address, the listen address, and ``configured``
    (``http_allowed_hosts``; ``"*"``: any).

    Any port goes with an allowed name: a rebinding page's requests carry its
    own name whatever the port, while a port check would refuse a tunnel or a
    proxy on another port (``ssh -L 8080:localhost:11480``) and could be
    known only after the bind (port 0).
    """

    def __init__(self, configured: Sequence[str]) -> None:
        self.any = "*" in configured
        self.names: set[str] = set()  # besides localhost (see is_loopback)
        self.addresses: set[IpAddress] = set()
        self.every_interface = False  # listening on 0.0.0.0 or ::
        self._add(name for name in configured if name != "*")

    def listen_on(self, *hosts: str) -> None:
        """Also allow ``hosts``, the listen address as configured and as
        bound: a name or an address, or for a wildcard address (0.0.0.0,
        ::) every address of this machine's interfaces."""
        for host in hosts:
            ip = ip_address(host)
            if ip is not None and ip.is_unspecified:
                self.every_interface = True
            else:
                self._add([host])

    def allows(self, name: str | None) -> bool:
        """Whether a request whose Host names ``name`` (see :func:`host_name`)
        is served."""
        if self.any:
            return True
        if not name:
            return False
        if is_loopback(name):
            return True
        ip = ip_address(name)
        if ip is None:
            return name in self.names
        if ip in self.addresses:
            return True
        return self.every_interface and ip in interface_addresses()

    def _add(self, hosts: Iterable[str]) -> None:
        for host in hosts:
            ip = ip_address(host)
            if ip is not None:
                self.addresses.add(ip)
            else:
                self.names.add(host.lower().removesuffix("."))


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type is ``application/json`` (with any parameters)."""
    return (content_type or "").partition(";")[0].strip().lower() == JSON


def is_same_origin(origin: str, host: str) -> bool:
    """Whether a page of ``origin`` was served by us under the name in the
    request's ``host`` header (http here; https behind a proxy)."""
    origin = origin.lower()
    return origin in (f"http://{host.lower()}", f"https://{host.lower()}")


CORS_HEADERS = [
    "Authorization",
    "Content-Type",
    # Anthropic's browser client sends its key and version as headers of its own.
    "x-api-key",
    "anthropic-version",
    "anthropic-beta",
    "anthropic-dangerous-direct-browser-access",
]
"""The request headers an allowed origin's page may send."""


class HttpGuard:
    """The ASGI layer in front of every route: the Host, Origin and body
    checks of this module, then CORS for ``cors_origins``, then ``app``.

    Args:
        app: the routes.
        allowed_hosts: ``http_allowed_hosts``.
        cors_origins: ``http_cors_origins``, the origins whose pages may call
            the front (``"*"``: any).
    """

    def __init__(
        self, app: ASGIApp, *, allowed_hosts: Sequence[str], cors_origins: Sequence[str]
    ) -> None:
        self.hosts = AllowedHosts(allowed_hosts)
        self.cors: CORSMiddleware | None = None
        if cors_origins:  # a chat UI in a browser calls the API from its page
            self.cors = CORSMiddleware(
                app,
                allow_origins=cors_origins,
                allow_methods=["GET", "POST", "OPTIONS"],
                allow_headers=CORS_HEADERS,
                max_age=CORS_MAX_AGE_S,
            )
        self.app: ASGIApp = self.cors or app
        self._any_origin = "*" in cors_origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = self.refusal(scope["method"], headers)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        log.warning("http_request_refused", code=refusal.code, method=scope["method"],
                    path=scope["path"], host=headers.get("host"),
                    origin=headers.get("origin"))  # fmt: skip
        await refusal.response()(scope, receive, send)

    def refusal(self, method: str, headers: Headers) -> ApiError | None:
        """Why a request with ``headers`` is refused, or None to serve it."""
        host = headers.get("host", "")
        if not self.hosts.allows(host_name(host)):
            return ApiError(
                403, f"Host {host!r} is not a name of this server: add it to "
                "http_allowed_hosts to serve it", type="permission_error", code="host_not_allowed",
            )  # fmt: skip
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, host):
            return ApiError(
                403, f"pages of origin {origin!r} may not call this server: add it to "
                "http_cors_origins to let them", type="permission_error", code="origin_not_allowed",
            )  # fmt: skip
        if (
            origin is None
            and headers.get("sec-fetch-site") in FOREIGN_FETCH_SITES
            and headers.get("sec-fetch-mode") != "navigate"  # a followed link: shown to the user
            and not self._any_origin
        ):
            return ApiError(
                403, "another site's page may not call this server (a request of an <img>, "
                "<script> or form from it carries no Origin; Sec-Fetch-Site says where it came "
                "from)", type="permission_error", code="origin_not_allowed",
            )  # fmt: skip
        if method in BODY_METHODS and not is_json(headers.get("content-type")):
            return ApiError(
                415, f"send the body as JSON, with Content-Type: {JSON}",
                code="unsupported_media_type",
            )  # fmt: skip
        return None

    def _origin_allowed(self, origin: str, host: str) -> bool:
        if is_same_origin(origin, host):
            return True
        return self.cors is not None and self.cors.is_allowed_origin(origin)

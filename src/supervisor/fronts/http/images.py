"""Images in chat requests, on every front: the bytes the runner gets.

An image comes as a data URL (``data:image/png;base64,...``: OpenAI's
``image_url``, the Responses API's ``input_image``), as base64 with its media
type (Anthropic's ``{"type": "base64", "media_type", "data"}`` source,
Ollama's ``images``), or as an http(s) URL (OpenAI's ``image_url``, the
Responses API's ``image_url``, Anthropic's ``{"type": "url"}`` source). The
daemon does not decode images: the runner does (``runner.vision``), where a
hostile file can only end a runner. Here they are only un-base64'd (ASCII
whitespace, as ``base64`` writes its lines, is dropped first) and held to
the limits: at most ``max_images_per_request`` images, each at most
``max_image_bytes``, all together at most :func:`images_budget` (the frame
the request travels to its runner in).

An http(s) URL is fetched by the daemon, with httpx, only when the config's
``allow_remote_images`` is on (off by default: a server that fetches any URL
a client names reaches what the client cannot). Parsing is synchronous (the
fronts' request models), fetching is not: a parser gives an :class:`ImageUrl`
for such an image, :func:`attach_images` leaves an empty placeholder in the
message and returns the :class:`RemoteImage` that says where the bytes go
(beside the call, never inside image bytes, which a client writes), and
:func:`ready_images` fetches them once the call's model is known to exist
and to take images. A fetch resolves the host itself and connects only to a
global address (not loopback, private, link-local, multicast or reserved,
unless ``allow_private_image_hosts`` is on), on every redirect hop; the
client hears only that the URL could not be fetched, the daemon log why.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import socket
from typing import NamedTuple

import anyio
import httpx
import msgspec
import structlog

from ipc.messages import ChatMessage
from supervisor.config import SupervisorConfig
from supervisor.fronts.http.errors import ApiError

__all__ = [
    "FETCH_TIMEOUT_S",
    "ImageUrl",
    "RemoteImage",
    "attach_images",
    "check_images",
    "data_url_bytes",
    "decode_base64",
    "image_from_url",
    "images_budget",
    "ready_images",
]

log = structlog.get_logger("supervisor.http")

FETCH_TIMEOUT_S = 30.0
MAX_REDIRECTS = 5
FRAME_MARGIN_BYTES = 1 << 20  # the rest of a request's frame: its text, tools, settings
DEFAULT_MAX_IMAGE_BYTES = 10 << 20
_WHITESPACE = b" \t\n\r\f\v"


class ImageUrl(msgspec.Struct, frozen=True):
    """An http(s) image a parser found: its URL and the field that named it."""

    url: str
    param: str


class RemoteImage(NamedTuple):
    """Where the bytes of an http(s) image go: ``message.images[position]``."""

    message: ChatMessage
    position: int
    url: str
    param: str


class FetchRefused(Exception):
    """A URL the daemon does not fetch or could not fetch; the reason is for the log."""


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="bad_request")


def images_budget(config: SupervisorConfig) -> int:
    """The most image bytes one request may carry: its frame to the runner
    (``max_frame_bytes``) less room for the rest of the request."""
    frame = config.max_frame_bytes
    return frame - min(FRAME_MARGIN_BYTES, frame // 4)


def image_cap(config: SupervisorConfig) -> int:
    """The most bytes of one image: ``max_image_bytes``, by default 10 MiB
    or the whole budget where the frame leaves less."""
    if config.max_image_bytes is not None:
        return config.max_image_bytes
    return min(DEFAULT_MAX_IMAGE_BYTES, images_budget(config))


def decode_base64(data: str, param: str) -> bytes:
    """Base64 image bytes; ASCII whitespace (line breaks) is dropped first.
    Raises ApiError (400) for text that is not base64 or empty."""
    try:
        raw = base64.b64decode(data.encode("ascii").translate(None, _WHITESPACE), validate=True)
    except (binascii.Error, ValueError):
        raise bad(param, "the image is not valid base64") from None
    if not raw:
        raise bad(param, "the image is empty")
    return raw


def data_url_bytes(url: str, param: str) -> bytes:
    """The bytes of a ``data:<type>;base64,<data>`` URL. Raises ApiError (400)."""
    head, comma, data = url.partition(",")
    if not url.startswith("data:") or not comma or not head.endswith(";base64"):
        raise bad(param, "an image data URL must be base64: data:<type>;base64,<data>")
    return decode_base64(data, param)


def image_from_url(url: str, param: str) -> bytes | ImageUrl:
    """The bytes of a data URL, or the :class:`ImageUrl` of an http(s) one.

    Raises ApiError (400): another scheme, or a data URL that is not base64."""
    if url.startswith("data:"):
        return data_url_bytes(url, param)
    if url.startswith(("http://", "https://")):
        return ImageUrl(url, param)
    raise bad(param, "an image_url must be a data URL (data:image/png;base64,...) or http(s)")


def attach_images(message: ChatMessage, images: list[bytes | ImageUrl]) -> list[RemoteImage]:
    """Give ``message`` its ``images``, an empty placeholder for each http(s)
    one; the :class:`RemoteImage` of each, for :func:`ready_images` to fill."""
    message.images = [b"" if isinstance(image, ImageUrl) else image for image in images] or None
    return [RemoteImage(message, j, image.url, image.param)
            for j, image in enumerate(images) if isinstance(image, ImageUrl)]  # fmt: skip


def check_images(
    messages: list[ChatMessage] | None, remote: list[RemoteImage], config: SupervisorConfig
) -> None:
    """Hold a parsed call's images to the limits before its model is sought:
    their number, each inline image's size and all of theirs; http(s) ones
    only with ``allow_remote_images``. Raises ApiError (400, 413)."""
    images = [data for message in messages or () for data in message.images or ()]
    most = config.max_images_per_request
    if len(images) > most:
        raise bad("messages", f"{len(images)} images in one request, over {most} "
                  "(max_images_per_request)")  # fmt: skip
    if remote and not config.allow_remote_images:
        raise bad(remote[0].param, "image URLs are off on this server (allow_remote_images); "
                  "send the image as a data URL or base64")  # fmt: skip
    cap = image_cap(config)
    for n, data in enumerate(images, 1):
        if len(data) > cap:
            raise bad("messages", f"image {n} is {len(data)} bytes, over {cap} (max_image_bytes)")
    total_fits(sum(map(len, images)), config)


def total_fits(total: int, config: SupervisorConfig) -> None:
    """Raises ApiError (413) when ``total`` image bytes cannot reach a runner."""
    budget = images_budget(config)
    if total > budget:
        raise ApiError(413, f"request too large: its images are {total} bytes, over the "
                       f"{budget} bytes a request's {config.max_frame_bytes}-byte frame "
                       "(max_frame_bytes) leaves them", code="request_too_large")  # fmt: skip


def refuse_text_only(name: str, vision: bool | None, messages: list[ChatMessage] | None) -> None:
    """Refuse images for a model known to be text-only (``vision`` False: its
    estimate found no vision tower; None: not known, the runner says).
    Raises ApiError (400) naming the model."""
    if vision is False and any(message.images for message in messages or ()):
        raise bad("messages", f"{name}: the model is text-only: it takes no images (it has "
                  "no vision tower)")  # fmt: skip


async def ready_images(
    messages: list[ChatMessage] | None,
    remote: list[RemoteImage],
    config: SupervisorConfig,
    model: str,
    vision: bool | None,
) -> None:
    """Once the call's ``model`` is known (``vision``: whether it takes
    images, None if not known): refuse images to a text-only model, then
    fetch each distinct http(s) URL once, with one client, and put its bytes
    where :class:`RemoteImage` says, held to ``max_image_bytes`` and, with
    the rest, to :func:`images_budget`.

    Raises ApiError: 400 for a text-only model, a URL that could not be
    fetched (the log says why), an image over the cap; 413 over the budget."""
    refuse_text_only(model, vision, messages)
    if not remote:
        return
    cap = image_cap(config)
    budget = images_budget(config)
    inline = sum(len(d) for message in messages or () for d in message.images or ())
    fetched: dict[str, bytes] = {}
    async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S, trust_env=False) as client:
        for place in remote:
            data = fetched.get(place.url)
            if data is None:
                limit = min(cap, budget - inline)
                data = fetched[place.url] = await fetch(client, place, limit, config)
            if len(data) > cap:
                raise bad(place.param, f"the image is over {cap} bytes (max_image_bytes)")
            inline += len(data)
            total_fits(inline, config)
            assert place.message.images is not None
            place.message.images[place.position] = data


async def fetch(
    client: httpx.AsyncClient, place: RemoteImage, limit: int, config: SupervisorConfig
) -> bytes:
    """The bytes at ``place.url``, read up to ``limit`` + 1 (what is over is
    the caller's to refuse). Raises ApiError (400): one text for every
    failure, the reason in the log."""
    try:
        with anyio.fail_after(FETCH_TIMEOUT_S):
            return await follow(client, place.url, limit, config.allow_private_image_hosts)
    except (FetchRefused, TimeoutError, httpx.HTTPError, OSError, ValueError) as exc:
        log.warning("image_fetch_failed", url=place.url, param=place.param,
                    error=f"{type(exc).__name__}: {exc}")  # fmt: skip
        raise bad(place.param, f"the image URL at {place.param} could not be fetched") from None


async def follow(client: httpx.AsyncClient, url: str, limit: int, private: bool) -> bytes:
    """GET ``url``, following up to :data:`MAX_REDIRECTS` redirects, each hop
    to an address :func:`allowed_address` allows (connected to by that
    address, so that a second DNS answer cannot differ). Raises
    FetchRefused, httpx.HTTPError, OSError."""
    target = httpx.URL(url)
    for _ in range(MAX_REDIRECTS + 1):
        if target.scheme not in ("http", "https") or not target.host:
            raise FetchRefused(f"not an http(s) URL: {target}")
        address = await allowed_address(target, private)
        request = client.build_request(
            "GET", target.copy_with(host=address), headers={"Host": target.netloc.decode()},
            extensions={"sni_hostname": target.host},
        )  # fmt: skip
        response = await client.send(request, stream=True)
        try:
            if response.is_redirect:
                target = target.join(response.headers["location"])
                continue
            if response.status_code != 200:
                raise FetchRefused(f"HTTP {response.status_code}")
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > limit:
                    break
            if not body:
                raise FetchRefused("an empty body")
            return bytes(body)
        finally:
            await response.aclose()
    raise FetchRefused(f"over {MAX_REDIRECTS} redirects")


async def allowed_address(url: httpx.URL, private: bool) -> str:
    """The address to connect to for ``url``'s host: its first, when every
    address the host resolves to is global (or ``private`` allows any).
    Raises FetchRefused, OSError (the name does not resolve)."""
    port = url.port or (443 if url.scheme == "https" else 80)
    infos = await anyio.getaddrinfo(url.host, port, type=socket.SOCK_STREAM)
    addresses = [ipaddress.ip_address(str(info[4][0]).partition("%")[0]) for info in infos]
    if not addresses:
        raise FetchRefused(f"{url.host} has no address")
    for address in addresses:
        if not private and not is_public(address):
            raise FetchRefused(f"{url.host} resolves to {address}, not a global address")
    return str(addresses[0])


def is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether ``address`` is a global unicast one (an IPv4-mapped IPv6
    address is judged as its IPv4 one)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not (
        address.is_multicast or address.is_reserved or address.is_unspecified
        or address.is_loopback or address.is_link_local or address.is_private
    )  # fmt: skip

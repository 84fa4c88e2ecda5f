"""The HTTP front against web pages: any page in a browser on this machine can
send requests to loopback, so the front checks the Host (DNS rebinding), the
Origin (CORS, and simple requests that need no preflight) and the body's type
before any route runs. Real daemons, raw HTTP (httpx) standing in for a
browser, and the real ``openai`` client."""

from __future__ import annotations

import ipaddress
from typing import Any

import httpx
import openai
import psutil

from conftest import DaemonFactory
from supervisor.client import Client
from supervisor.config import HTTP_ENV, SupervisorConfig, exposure_problem
from supervisor.daemon.process import DaemonProcess
from supervisor.fronts.http.guard import AllowedHosts, host_name
from supervisor.netaddr import is_loopback
from test_http import metric

CHAT = [{"role": "user", "content": "Tell me a story."}]
ATTACKER = "http://attacker.example"
# A configured model that any request may load on demand: a refused request must not.
ON_DEMAND = 'hot_spare = false\n[[models]]\nname = "tiny"\nmodel = "builtin:tiny"\n'


def start(
    start_daemon: DaemonFactory, config: str | None = None, listen: str = "127.0.0.1:0"
) -> tuple[DaemonProcess, str]:
    """A daemon with its HTTP front on a free port, and the front's base URL."""
    daemon = start_daemon(config, env={HTTP_ENV: listen})
    url = Client(daemon.socket_path).status().supervisor.http
    assert url is not None
    return daemon, url


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI error object of a refusal with ``status``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def chat_body(max_tokens: int = 3) -> dict[str, Any]:
    return {"model": "tiny", "messages": CHAT, "max_tokens": max_tokens}


# --- the three requests of a hostile page ---------------------------------------------


def test_a_foreign_page_cannot_run_a_generation_or_load_a_model(
    start_daemon: DaemonFactory,
) -> None:
    """What a browser sends without a preflight from any page: a text/plain
    POST with the page's Origin. Refused before any route: nothing loads,
    nothing generates."""
    daemon, url = start(start_daemon, ON_DEMAND)
    chat = f"{url}/v1/chat/completions"
    body = httpx.Request("POST", chat, json=chat_body()).content

    simple = httpx.post(chat, content=body, timeout=30,
                        headers={"Content-Type": "text/plain", "Origin": ATTACKER})  # fmt: skip
    error = error_of(simple, 403)
    assert error["code"] == "origin_not_allowed" and ATTACKER in error["message"]
    assert "http_cors_origins" in error["message"]
    # A JSON body does not make a foreign page welcome (it needs a preflight, which fails too).
    as_json = httpx.post(chat, json=chat_body(), headers={"Origin": ATTACKER}, timeout=30)
    assert error_of(as_json, 403)["code"] == "origin_not_allowed"
    # A sandboxed frame or a file: page says "null".
    nulled = httpx.post(chat, json=chat_body(), headers={"Origin": "null"}, timeout=30)
    assert error_of(nulled, 403)["code"] == "origin_not_allowed"
    # Nor may it read: the model list, the metrics, the health line.
    for path in ("/v1/models", "/v1/models/tiny", "/metrics", "/health"):
        read = httpx.get(url + path, headers={"Origin": ATTACKER}, timeout=30)
        assert error_of(read, 403)["code"] == "origin_not_allowed", path
        assert "builtin:tiny" not in read.text

    assert Client(daemon.socket_path).status().runners == []  # nothing was loaded
    assert metric(url, "mlx_supervisor_requests_total", model="tiny", outcome="ok") == 0
    assert metric(url, "mlx_supervisor_http_requests_total",
                  route="/v1/chat/completions", status="403") == 3  # fmt: skip


def test_a_foreign_pages_no_cors_requests_are_refused_though_they_carry_no_origin(
    start_daemon: DaemonFactory,
) -> None:
    """An <img> or <script> on any page sends a GET with no Origin at all; a
    browser says where it comes from in Sec-Fetch-Site instead. Another site's
    is refused; a user typing the URL ("none") and the front's own pages
    ("same-origin") are served, as are clients that send neither."""
    _, url = start(start_daemon, ON_DEMAND)
    for site in ("cross-site", "same-site"):
        fetched = httpx.get(f"{url}/v1/models", headers={"Sec-Fetch-Site": site}, timeout=30)
        assert error_of(fetched, 403)["code"] == "origin_not_allowed", site
    for site in ("none", "same-origin"):
        fetched = httpx.get(f"{url}/v1/models", headers={"Sec-Fetch-Site": site}, timeout=30)
        assert fetched.status_code == 200, site
    # A link on another site that the user follows: the answer is shown to them, not the page.
    followed = httpx.get(f"{url}/v1/models", timeout=30,
                         headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"})
    assert followed.status_code == 200
    # A page of an allowed origin sends its Origin with its fetch: served.
    _, url2 = start(start_daemon, 'http_cors_origins = ["http://localhost:3000"]\n')
    allowed = httpx.get(f"{url2}/v1/models", timeout=30,
                        headers={"Sec-Fetch-Site": "same-site", "Origin": "http://localhost:3000"})
    assert allowed.status_code == 200


def test_a_dns_rebinding_page_reads_nothing(start_daemon: DaemonFactory) -> None:
    """A page whose name now resolves to 127.0.0.1 sends its own name as
    Host: refused on every route before any routing, /health included."""
    daemon, url = start(start_daemon, ON_DEMAND)
    port = port_of(url)
    Client(daemon.socket_path).load("builtin:tiny")
    rebound = {"Host": f"attacker.example:{port}"}

    listed = httpx.get(f"{url}/v1/models", headers=rebound, timeout=30)
    error = error_of(listed, 403)
    assert error["code"] == "host_not_allowed" and "attacker.example" in error["message"]
    assert "http_allowed_hosts" in error["message"]
    assert "builtin:tiny" not in listed.text and "pid" not in listed.text
    for path in ("/v1/models/tiny", "/metrics", "/health", "/nothing"):
        assert error_of(httpx.get(url + path, headers=rebound, timeout=30), 403)["code"] == (
            "host_not_allowed"
        ), path
    generated = httpx.post(f"{url}/v1/chat/completions", json=chat_body(),
                           headers=rebound, timeout=30)  # fmt: skip
    assert error_of(generated, 403)["code"] == "host_not_allowed"
    # Same-origin on the rebound name is still that name: refused.
    own_origin = {**rebound, "Origin": f"http://attacker.example:{port}"}
    same_name = httpx.post(f"{url}/v1/chat/completions", json=chat_body(), headers=own_origin,
                           timeout=30)  # fmt: skip
    assert error_of(same_name, 403)["code"] == "host_not_allowed"
    for bad in ("", "attacker.example", "localhost.attacker.example", "127.0.0.1.nip.io",
                "localhost:port"):  # fmt: skip
        refused = httpx.get(f"{url}/health", headers={"Host": bad}, timeout=30)
        assert error_of(refused, 403)["code"] == "host_not_allowed", bad
    assert metric(url, "mlx_supervisor_requests_total", model="tiny", outcome="ok") == 0

    # The loopback names and addresses, with this port or any other (a tunnel,
    # ssh -L 8080:localhost:PORT, sends its own), or none.
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", f"[::1]:{port}",
                 "localhost", "127.0.0.1", "[::1]", "localhost:8080", "127.0.0.2:1",
                 "localhost."):  # fmt: skip
        answer = httpx.get(f"{url}/v1/models", headers={"Host": host}, timeout=30)
        assert answer.status_code == 200, (host, answer.text)
        assert [m["id"] for m in answer.json()["data"]] == ["tiny"]


def test_a_post_must_be_json(start_daemon: DaemonFactory) -> None:
    """Bodies are JSON only: a type a form or a no-cors fetch can send gets
    415 before the body is read; JSON with parameters passes."""
    daemon, url = start(start_daemon, ON_DEMAND)
    chat = f"{url}/v1/chat/completions"
    body = httpx.Request("POST", chat, json=chat_body()).content
    for content_type in ("text/plain", "text/plain;charset=UTF-8", "multipart/form-data; b=x",
                         "application/x-www-form-urlencoded", "application/jsonp",
                         "application/json-seq", "application/vnd.api+json", None):  # fmt: skip
        headers = {"Content-Type": content_type} if content_type else {}
        refused = httpx.post(chat, content=body, headers=headers, timeout=30)
        error = error_of(refused, 415)
        assert error["code"] == "unsupported_media_type", content_type
        assert "application/json" in error["message"]
    assert error_of(httpx.post(f"{url}/v1/completions", content=b"", timeout=30), 415)
    assert Client(daemon.socket_path).status().runners == []  # nothing was loaded

    for content_type in ("application/json", "application/json; charset=utf-8",
                         "Application/JSON;charset=UTF-8"):  # fmt: skip
        answer = httpx.post(chat, content=body, headers={"Content-Type": content_type},
                            timeout=120)  # fmt: skip
        assert answer.status_code == 200, (content_type, answer.text)
        assert answer.json()["usage"]["completion_tokens"] == 3


# --- what stays allowed ---------------------------------------------------------------


def test_preflights_and_requests_from_allowed_and_refused_origins(
    start_daemon: DaemonFactory,
) -> None:
    allowed = "http://localhost:3000"
    _, url = start(start_daemon, f'http_cors_origins = ["{allowed}"]\n' + ON_DEMAND)
    chat = f"{url}/v1/chat/completions"
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type, authorization"}  # fmt: skip

    # A real preflight, as a browser sends it before a JSON POST.
    ok = httpx.options(chat, headers={**preflight, "Origin": allowed}, timeout=30)
    assert ok.status_code == 200, ok.text
    assert ok.headers["access-control-allow-origin"] == allowed
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "content-type" in ok.headers["access-control-allow-headers"].lower()
    refused = httpx.options(chat, headers={**preflight, "Origin": ATTACKER}, timeout=30)
    assert error_of(refused, 403)["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in refused.headers

    # Then the request itself, with the headers a browser needs to let the page read it.
    answer = httpx.post(chat, json=chat_body(), headers={"Origin": allowed}, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.headers["access-control-allow-origin"] == allowed
    listed = httpx.get(f"{url}/v1/models", headers={"Origin": allowed}, timeout=30)
    assert listed.status_code == 200
    assert listed.headers["access-control-allow-origin"] == allowed
    # An allowed origin still sends JSON only.
    plain = httpx.post(chat, content=b"{}", timeout=30,
                       headers={"Origin": allowed, "Content-Type": "text/plain"})  # fmt: skip
    assert error_of(plain, 415)["code"] == "unsupported_media_type"
    for other in (ATTACKER, "http://localhost:3001", "https://localhost:3000", "null"):
        read = httpx.get(f"{url}/v1/models", headers={"Origin": other}, timeout=30)
        assert error_of(read, 403)["code"] == "origin_not_allowed", other
    assert metric(url, "mlx_supervisor_requests_total", model="tiny", outcome="ok") == 1

    # Without http_cors_origins no foreign page gets a preflight either.
    _, closed = start(start_daemon, "hot_spare = false\n")
    for origin in (allowed, ATTACKER):
        shut = httpx.options(f"{closed}/v1/chat/completions", timeout=30,
                             headers={**preflight, "Origin": origin})  # fmt: skip
        assert error_of(shut, 403)["code"] == "origin_not_allowed"
        assert "access-control-allow-origin" not in shut.headers


def test_same_origin_pages_and_clients_without_origin_are_served(
    start_daemon: DaemonFactory,
) -> None:
    """The daemon's own pages (Origin: its own base URL, under any allowed
    name) and clients that send no Origin (curl, SDKs, the openai client,
    unmodified) are served."""
    _, url = start(start_daemon, ON_DEMAND)
    port = port_of(url)
    chat = f"{url}/v1/chat/completions"
    own = httpx.post(chat, json=chat_body(), headers={"Origin": url}, timeout=120)
    assert own.status_code == 200, own.text
    by_name = httpx.post(chat, json=chat_body(), timeout=120, headers={
        "Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"})  # fmt: skip
    assert by_name.status_code == 200, by_name.text
    # Another port on the same name is another origin.
    elsewhere = httpx.get(f"{url}/v1/models", timeout=30, headers={
        "Host": f"localhost:{port}", "Origin": f"http://localhost:{port + 1}"})  # fmt: skip
    assert error_of(elsewhere, 403)["code"] == "origin_not_allowed"

    api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    assert [m.id for m in api.models.list().data] == ["tiny"]
    reply = api.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4)  # type: ignore[arg-type]
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    streamed = list(api.completions.create(model="tiny", prompt="Once", max_tokens=4,
                                           stream=True))  # fmt: skip
    assert streamed[-1].choices[0].finish_reason == "length"
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200


def test_http_allowed_hosts_names_more_hosts_and_star_any(start_daemon: DaemonFactory) -> None:
    _, url = start(start_daemon, 'hot_spare = false\nhttp_allowed_hosts = ["mybox.lan"]\n')
    port = port_of(url)
    for host in (f"mybox.lan:{port}", "MyBox.lan", f"localhost:{port}"):
        assert httpx.get(f"{url}/v1/models", headers={"Host": host}, timeout=30).status_code == (
            200
        ), host
    other = httpx.get(f"{url}/v1/models", headers={"Host": f"other.lan:{port}"}, timeout=30)
    assert error_of(other, 403)["code"] == "host_not_allowed"
    # A page on the allowed name is same-origin there.
    own = httpx.get(f"{url}/v1/models", timeout=30, headers={
        "Host": f"mybox.lan:{port}", "Origin": f"http://mybox.lan:{port}"})  # fmt: skip
    assert own.status_code == 200

    _, anyone = start(start_daemon, 'hot_spare = false\nhttp_allowed_hosts = ["*"]\n')
    answer = httpx.get(f"{anyone}/v1/models", headers={"Host": "attacker.example"}, timeout=30)
    assert answer.status_code == 200


def test_a_wildcard_listen_address_allows_this_machines_addresses(
    start_daemon: DaemonFactory,
) -> None:
    """On 0.0.0.0 the front is reached by this machine's addresses (a LAN
    client names one of them); names still need http_allowed_hosts."""
    ours = [a.address.partition("%")[0] for addresses in psutil.net_if_addrs().values()
            for a in addresses if a.family.name in ("AF_INET", "AF_INET6")]  # fmt: skip
    lan = [a for a in ours if not ipaddress.ip_address(a).is_loopback]
    _, url = start(start_daemon, 'hot_spare = false\napi_key = "k"\n', listen="0.0.0.0:0")
    port = port_of(url)
    local = f"http://127.0.0.1:{port}"
    key = {"Authorization": "Bearer k"}
    for address in ["127.0.0.1", *lan]:
        host = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        answer = httpx.get(f"{local}/v1/models", headers={**key, "Host": host}, timeout=30)
        assert answer.status_code == 200, (host, answer.text)
    for host in (f"attacker.example:{port}", f"203.0.113.9:{port}"):
        refused = httpx.get(f"{local}/v1/models", headers={**key, "Host": host}, timeout=30)
        assert error_of(refused, 403)["code"] == "host_not_allowed", host


# --- the pieces -------------------------------------------------------------------------


def test_host_names_are_read_without_their_port() -> None:
    assert host_name("localhost:11480") == "localhost"
    assert host_name("LocalHost") == "localhost"
    assert host_name("localhost.:80") == "localhost"
    assert host_name("[::1]:11480") == "::1"
    assert host_name("[::1]") == "::1"
    assert host_name("127.0.0.1:") == "127.0.0.1"
    for bad in ("", "::1", "[::1", "[::1]x", "[::1]:x", "host:port", "a b"):
        assert host_name(bad) is None, bad


def test_allowed_hosts_by_listen_address() -> None:
    loopback = AllowedHosts([])
    loopback.listen_on("127.0.0.1")
    for name in ("localhost", "127.0.0.1", "127.8.9.1", "::1", "0:0::1"):
        assert loopback.allows(name), name
    for name in ("192.0.2.77", "0.0.0.0", "attacker.example", "localhost.example", ""):
        assert not loopback.allows(name), name

    lan = AllowedHosts(["MyBox.Lan.", "[fd00::7]"])
    lan.listen_on("192.0.2.77")
    for name in ("192.0.2.77", "mybox.lan", "fd00::7", "localhost"):
        assert lan.allows(name), name
    assert not lan.allows("192.0.2.78") and not lan.allows("other.lan")


def test_one_loopback_rule_for_the_listen_address_and_the_host_header() -> None:
    """The config (may the front listen there without an api_key?) and the
    guard (may a Host name us?) ask the same question, with one answer."""
    loopback = ["localhost", "LocalHost", "127.0.0.1", "127.8.9.1", "::1", "::ffff:127.0.0.2"]
    others = ["localhost.example", "127.0.0.1.nip.io", "0.0.0.0", "::", "::ffff:192.0.2.7",
              "192.0.2.7", "mybox.lan"]  # fmt: skip
    for host in loopback + others:
        expected = host in loopback
        bracketed = f"[{host}]" if ":" in host else host  # as Host and http_listen write it
        assert is_loopback(host) is is_loopback(bracketed) is expected, host
        assert AllowedHosts([]).allows(host_name(bracketed)) is expected, host
        # A name other than localhost is not loopback, whatever it resolves to now.
        listening = SupervisorConfig(http_listen=f"{bracketed}:0")
        assert (exposure_problem(listening) is None) is expected, host

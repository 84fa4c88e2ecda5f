"""The management API (``/admin``) and the event hub behind ``/admin/events``:
live daemons with HTTP on a free port, builtin:tiny runners, raw HTTP (httpx
and plain sockets), a runner killed with SIGKILL; the hub alone, and one
events stream whose client stops reading, in process over a real registry."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import httpx
import msgspec
import psutil
import pytest
from starlette.applications import Starlette
from structlog.testing import capture_logs

from conftest import DaemonFactory, faults, runner
from ipc.messages import FAULTS_ENV, LoadRequest, StatusReply
from supervisor.client import Client, ClientError
from supervisor.config import HTTP_ENV, SupervisorConfig
from supervisor.daemon.process import DaemonProcess
from supervisor.events import EventHub
from supervisor.fronts.http.admin import AdminRoutes
from supervisor.registry.registry import Registry

TINY = 'hot_spare = false\n[[models]]\nname = "tiny"\nmodel = "builtin:tiny"\n'
OTHER = '[[models]]\nname = "other"\nmodel = "builtin:tiny"\n'
ATTACKER = "http://attacker.example"
JSON = {"Content-Type": "application/json"}
STREAM_WAIT_S = 20.0


def start(start_daemon: DaemonFactory, config: str = TINY) -> tuple[DaemonProcess, str]:
    """A daemon with its HTTP front on a free port, and the front's base URL."""
    daemon = start_daemon(config, env={HTTP_ENV: "127.0.0.1:0"})
    url = Client(daemon.socket_path).status().supervisor.http
    assert url is not None
    return daemon, url


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def sse_blocks(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """A stream's events, each as ``{"event", "id", "data"}`` (data parsed
    from JSON; None for a block without data), and its comments as
    ``{"comment": text}``."""
    block: dict[str, Any] = {}
    for line in lines:
        if line.startswith(":"):
            yield {"comment": line[1:].strip()}
        elif not line:
            if "data" in block:
                block["data"] = json.loads(block["data"])
                yield block
            block = {}
        else:
            field, _, value = line.partition(":")
            block[field] = value.removeprefix(" ")


class EventReader:
    """``GET /admin/events`` read in a thread: each event (and the stream's
    end, as None) goes to a queue the test reads with a deadline."""

    def __init__(self, url: str, **params: str) -> None:
        self.queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.subscribed = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, args=(url, params), daemon=True)
        self._thread.start()
        assert self.subscribed.wait(STREAM_WAIT_S), "the events stream did not open"

    def _read(self, url: str, params: dict[str, str]) -> None:
        try:
            with httpx.stream("GET", f"{url}/admin/events", params=params,
                              timeout=STREAM_WAIT_S) as response:  # fmt: skip
                assert response.status_code == 200, response.read()
                assert response.headers["content-type"].startswith("text/event-stream")
                for block in sse_blocks(response.iter_lines()):
                    if "comment" in block:
                        self.subscribed.set()  # the first comment follows the subscription
                    else:
                        self.queue.put(block)
        except BaseException as exc:  # the test asserts on it
            self.error = exc
        finally:
            self.subscribed.set()
            self.queue.put(None)

    def until(self, done: Any, timeout_s: float = STREAM_WAIT_S) -> list[dict[str, Any]]:
        """Events (their data) until one for which ``done(event)`` holds, that one included."""
        deadline = time.monotonic() + timeout_s
        seen: list[dict[str, Any]] = []
        while True:
            block = self.queue.get(timeout=max(deadline - time.monotonic(), 0.01))
            assert block is not None, f"the stream ended early ({self.error!r}) after {seen}"
            event = block["data"]
            assert int(block["id"]) == event["id"]
            seen.append(event)
            if done(event):
                return seen

    def rest(self, timeout_s: float = STREAM_WAIT_S) -> list[dict[str, Any]]:
        """Every event up to the stream's end (which must come within ``timeout_s``)."""
        events = []
        while (block := self.queue.get(timeout=timeout_s)) is not None:
            events.append(block["data"])
        self._thread.join(timeout_s)
        assert self.error is None, self.error
        return events


def release(fifo: Path) -> None:
    """Let whoever is blocked opening ``fifo`` to read go on (it reads an
    empty file); nothing when no one is."""
    with contextlib.suppress(OSError):  # ENXIO: no reader
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def no_status() -> StatusReply:
    raise AssertionError("not asked for in this test")


def kinds(events: list[dict[str, Any]], model: str = "tiny") -> list[str]:
    """``kind`` of each event about ``model``, a state move as ``state:NEW``."""
    return [
        f"state:{e['fields']['new']}" if e["kind"] == "model_state" else e["kind"]
        for e in events
        if e["model"] == model
    ]


# --- the socket's operations over HTTP ---------------------------------------------


def test_a_load_streams_its_progress_then_the_model_is_in_status(
    start_daemon: DaemonFactory,
) -> None:
    daemon, url = start(start_daemon, TINY + OTHER)
    socket_status = Client(daemon.socket_path).status

    with httpx.stream("POST", f"{url}/admin/models", json={"model": "tiny"}, timeout=60,
                      headers={"Accept": "text/event-stream"}) as response:  # fmt: skip
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in sse_blocks(response.iter_lines()) if "comment" not in b]
    names = [b["event"] for b in blocks]
    assert names[-1] == "loaded" and set(names[:-1]) == {"progress"}, names
    progress = [b["data"] for b in blocks[:-1]]
    assert all(p["name"] == "tiny" and 0 <= p["done"] <= p["total"] for p in progress)
    assert any(p["phase"] == "weights" for p in progress)
    loaded = blocks[-1]["data"]
    assert (loaded["type"], loaded["name"], loaded["model"]) == ("loaded", "tiny", "builtin:tiny")

    # /admin/status is the socket's status document (status --json), the model in it.
    status = msgspec.json.decode(httpx.get(f"{url}/admin/status", timeout=10).content,
                                 type=StatusReply)  # fmt: skip
    assert status.supervisor.pid == socket_status().supervisor.pid == daemon.pid
    assert status.supervisor.http == url
    (info,) = status.runners
    assert (info.name, info.state, info.pid) == ("tiny", "ready", loaded["pid"])

    # Not streamed: the result as one JSON body; a name taken: 409 before anything starts.
    second = httpx.post(f"{url}/admin/models?stream=false", timeout=60, json={"model": "other"})
    assert second.status_code == 200, second.text
    assert second.json()["name"] == "other" and runner(Client(daemon.socket_path), "other").pid
    taken = httpx.post(f"{url}/admin/models", json={"model": "tiny"}, timeout=10)
    assert error_of(taken, 409)["code"] == "already_loaded"

    # Bad requests change nothing.
    unknown_field = httpx.post(f"{url}/admin/models", json={"model": "tiny", "gpu": 1})
    assert error_of(unknown_field, 400)["param"] == "gpu"
    assert error_of(httpx.post(f"{url}/admin/models?stream=maybe", json={"model": "x"}),
                    400)["param"] == "stream"  # fmt: skip
    not_json = httpx.post(f"{url}/admin/models", content=b'{"model": "tiny"}')
    assert error_of(not_json, 415)["code"] == "unsupported_media_type"
    # Without a key, any local user reaches the port: only configured models, no env.
    for body in (
        {"model": "/etc"},
        {"model": "tiny", "name": "t3", "env": {"A": "1"}},
        {"model": "tiny", "name": "t4", "env": {"MLX_SUPERVISOR_FAULTS": "crash"}},
    ):
        assert error_of(httpx.post(f"{url}/admin/models", json=body), 403)["code"] == "forbidden"
    assert sorted(r.name for r in socket_status().runners) == ["other", "tiny"]


def test_pin_unpin_cache_clear_and_unload_act_on_the_model(start_daemon: DaemonFactory) -> None:
    daemon, url = start(start_daemon)
    client = Client(daemon.socket_path)
    pid = client.load("builtin:tiny").pid

    pinned = httpx.post(f"{url}/admin/models/tiny/pin", headers=JSON, timeout=10)
    assert pinned.status_code == 200 and pinned.json()["pinned"] is True
    assert runner(client, "tiny").pinned
    assert httpx.post(f"{url}/admin/models/tiny/pin", json={}).json()["pinned"] is True
    assert error_of(httpx.post(f"{url}/admin/models/tiny/pin"), 415)["code"] == (
        "unsupported_media_type"
    )
    unpinned = httpx.delete(f"{url}/admin/models/tiny/pin", timeout=10)
    assert unpinned.status_code == 200 and unpinned.json()["pinned"] is False
    assert not runner(client, "tiny").pinned

    for body in (None, {}, {"disk_only": True}):
        cleared = httpx.post(f"{url}/admin/models/tiny/cache/clear", headers=JSON, timeout=10,
                             content=None if body is None else json.dumps(body))  # fmt: skip
        assert cleared.status_code == 200, cleared.text
        assert cleared.json()["type"] == "cache_cleared" and cleared.json()["name"] == "tiny"
    bad = httpx.post(f"{url}/admin/models/tiny/cache/clear", json={"disk_only": "yes"})
    assert error_of(bad, 400)["code"] == "bad_request"

    for method, path in (("POST", "pin"), ("DELETE", "pin"), ("POST", "cache/clear")):
        missing = httpx.request(method, f"{url}/admin/models/nope/{path}", headers=JSON)
        assert error_of(missing, 404)["code"] == "unknown_model", path
    assert error_of(httpx.delete(f"{url}/admin/models/nope"), 404)["code"] == "unknown_model"

    unloaded = httpx.delete(f"{url}/admin/models/tiny", timeout=30)
    assert unloaded.status_code == 200, unloaded.text
    reply = unloaded.json()
    assert (reply["type"], reply["name"], reply["pid"]) == ("unloaded", "tiny", pid)
    assert reply["steps"] == ["shutdown"] and reply["exit"]["cause_class"] == "requested"
    assert client.status().runners == []
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_reload_applies_the_config_file_and_refuses_a_broken_one(
    start_daemon: DaemonFactory,
) -> None:
    daemon, url = start(start_daemon)
    assert daemon.config_path is not None
    daemon.config_path.write_text(TINY + '[[models]]\nname = "other"\nmodel = "builtin:tiny"\n')
    applied = httpx.post(f"{url}/admin/reload", json={}, timeout=30)
    assert applied.status_code == 200, applied.text
    assert applied.json()["ok"] is True and applied.json()["added"] == ["other"]

    daemon.config_path.write_text('max_tokens = "many"\n' + TINY)
    refused = httpx.post(f"{url}/admin/reload", headers=JSON, timeout=30)
    assert refused.status_code == 422, refused.text
    assert refused.json()["ok"] is False and refused.json()["key"] == "max_tokens"
    assert error_of(httpx.post(f"{url}/admin/reload", json={"now": True}), 400)["param"] == "now"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_reload_is_501_where_the_daemon_has_none() -> None:
    config = SupervisorConfig(http_listen="off", hot_spare=False)
    async with anyio.create_task_group() as tg:
        routes = AdminRoutes(Registry(config, tg), config, status=no_status)
        transport = httpx.ASGITransport(app=Starlette(routes=routes.routes()))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            response = await http.post("/admin/reload", json={})
        error = error_of(response, 501)
        assert error["code"] == "not_implemented" and "reload" in error["message"]
        tg.cancel_scope.cancel()


# --- who may call it ---------------------------------------------------------------


def test_the_admin_key_opens_the_admin_routes_and_api_key_does_not(
    start_daemon: DaemonFactory,
) -> None:
    _, url = start(start_daemon, 'hot_spare = false\napi_key = "plain"\n')
    assert error_of(httpx.get(f"{url}/admin/status"), 401)["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/admin/status", headers={"x-api-key": "plain"}).status_code == 200
    # With a key the caller is the operator: any reference loads, as over the socket.
    loaded = httpx.post(f"{url}/admin/models", json={"model": "builtin:tiny"}, timeout=60,
                        headers={"Authorization": "Bearer plain"})  # fmt: skip
    assert loaded.status_code == 200 and loaded.json()["name"] == "tiny"

    config = 'hot_spare = false\napi_key = "plain"\nadmin_api_key = "boss"\n'
    _, url = start(start_daemon, config)
    plain, boss = ({"Authorization": f"Bearer {key}"} for key in ("plain", "boss"))
    for path in ("/admin/status", "/admin/events"):
        assert error_of(httpx.get(url + path), 401)["code"] == "invalid_api_key", path
        assert error_of(httpx.get(url + path, headers=plain), 401)["code"] == "invalid_api_key"
    assert error_of(httpx.delete(f"{url}/admin/models/tiny", headers=plain), 401)
    assert httpx.get(f"{url}/admin/status", headers=boss).status_code == 200
    assert httpx.delete(f"{url}/admin/models/tiny", headers=boss).status_code == 404
    # The admin key is for /admin only; the other routes keep api_key.
    assert httpx.get(f"{url}/v1/models", headers=plain).status_code == 200
    assert httpx.get(f"{url}/v1/models", headers=boss).status_code == 401


def test_a_foreign_page_reaches_no_admin_route(start_daemon: DaemonFactory) -> None:
    daemon, url = start(start_daemon)
    foreign = {"Origin": ATTACKER}
    load = httpx.post(f"{url}/admin/models", json={"model": "tiny"}, headers=foreign)
    assert error_of(load, 403)["code"] == "origin_not_allowed"
    simple = httpx.post(f"{url}/admin/models", content=b'{"model": "tiny"}',
                        headers={"Content-Type": "text/plain", **foreign})  # fmt: skip
    assert error_of(simple, 403)["code"] == "origin_not_allowed"
    for method, path in (
        ("GET", "/admin/status"),
        ("GET", "/admin/events"),
        ("DELETE", "/admin/models/tiny"),
        ("POST", "/admin/reload"),
    ):
        refused = httpx.request(method, url + path, headers={**JSON, **foreign}, timeout=10)
        assert error_of(refused, 403)["code"] == "origin_not_allowed", path
    no_cors = httpx.get(f"{url}/admin/status", headers={"Sec-Fetch-Site": "cross-site"})
    assert error_of(no_cors, 403)["code"] == "origin_not_allowed"
    assert Client(daemon.socket_path).status().runners == []  # nothing was loaded
    # The daemon's own page (same origin) reaches the route.
    own = httpx.post(f"{url}/admin/models/tiny/pin", headers={**JSON, "Origin": url})
    assert error_of(own, 404)["code"] == "unknown_model"


def test_without_a_key_a_load_is_the_load_on_demand_of_a_configured_model(
    start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    """Without a key any local user reaches the port: a load over HTTP takes
    ``model`` alone and loads what a load on demand would (a configured model,
    as configured); every other field is refused before anything is read. A
    FIFO as the hostfile would block whoever opens it: refused, and the daemon
    answers on. With ``load_on_demand = false`` nothing loads over HTTP."""
    daemon, url = start(start_daemon)
    client = Client(daemon.socket_path)
    fifo = tmp_path / "hosts.fifo"
    os.mkfifo(fifo)
    try:
        for field, value in (
            ("hostfile", str(fifo)), ("name", "copy"), ("pinned", True), ("ranks", 2),
            ("max_tokens", 9), ("context_tokens", 64), ("kv_bits", 8), ("restart", "never"),
            ("keep_alive_s", 0), ("max_concurrent", 1), ("prefix_cache", False),
        ):  # fmt: skip
            body = {"model": "tiny", field: value}
            error = error_of(httpx.post(f"{url}/admin/models", json=body, timeout=10), 403)
            assert error["code"] == "forbidden" and error["param"] == field, error
            assert "admin_api_key" in error["message"]
            assert httpx.get(f"{url}/admin/status", timeout=10).status_code == 200
    finally:
        release(fifo)
    assert client.status().runners == []
    # The reference of a configured model loads it under its name, as configured.
    loaded = httpx.post(f"{url}/admin/models", json={"model": "builtin:tiny"}, timeout=60)
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["name"] == "tiny" and [r.name for r in client.status().runners] == ["tiny"]

    _, url = start(start_daemon, TINY.replace("hot_spare = false\n",
                                              "hot_spare = false\nload_on_demand = false\n"))
    error = error_of(httpx.post(f"{url}/admin/models", json={"model": "tiny"}, timeout=10), 403)
    assert error["code"] == "forbidden" and "load_on_demand" in error["message"]


def test_a_hostfile_that_is_no_regular_file_is_refused_over_the_socket(
    start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    """The operator's load names a FIFO (or a device) as its hostfile: a
    clear refusal, not a daemon blocked opening it."""
    daemon = start_daemon("hot_spare = false\n")
    client = Client(daemon.socket_path, timeout_s=10)
    fifo = tmp_path / "hosts.fifo"
    os.mkfifo(fifo)
    try:
        for hostfile in (fifo, Path("/dev/zero")):
            with pytest.raises(ClientError) as refused:
                client.load("builtin:tiny", "pair", hostfile=str(hostfile))
            assert refused.value.code == "bad_request", refused.value
            assert "not a regular file" in refused.value.message
            assert client.status().runners == []
    finally:
        release(fifo)


def test_admin_routes_take_only_the_fronts_own_pages_whatever_cors_allows(
    start_daemon: DaemonFactory,
) -> None:
    """``http_cors_origins`` lets other pages call the model APIs; not the
    management API, which takes a page's request only from the front's own
    origin, and never one another site's page sent (Sec-Fetch-Site), even as
    a link followed."""
    config = TINY.replace("\n[[", '\nhttp_cors_origins = ["*"]\n[[', 1)
    daemon, url = start(start_daemon, config)
    client = Client(daemon.socket_path)
    client.load("builtin:tiny")
    foreign = {**JSON, "Origin": ATTACKER}
    for method, path in (
        ("POST", "/admin/reload"),
        ("POST", "/admin/models/tiny/pin"),
        ("DELETE", "/admin/models/tiny"),
        ("GET", "/admin/status"),
        ("GET", "/admin/events"),
    ):
        refused = httpx.request(method, url + path, headers=foreign, timeout=10)
        assert error_of(refused, 403)["code"] == "origin_not_allowed", path
    for site, mode in (("cross-site", "cors"), ("same-site", "no-cors"),
                       ("cross-site", "navigate")):  # fmt: skip
        headers = {"Sec-Fetch-Site": site, "Sec-Fetch-Mode": mode}
        refused = httpx.get(f"{url}/admin/status", headers=headers, timeout=10)
        assert error_of(refused, 403)["code"] == "origin_not_allowed", (site, mode)
    assert not runner(client, "tiny").pinned and not daemon.events("config_reloaded")
    # The model APIs keep http_cors_origins; the front's own page reaches /admin.
    assert httpx.get(f"{url}/v1/models", headers=foreign, timeout=10).status_code == 200
    own = {**JSON, "Origin": url, "Sec-Fetch-Site": "same-origin"}
    assert httpx.post(f"{url}/admin/models/tiny/pin", headers=own, timeout=10).status_code == 200


@pytest.mark.anyio
async def test_an_event_id_that_is_no_whole_number_is_refused() -> None:
    """``"²".isdigit()`` holds, but it is no number ``int`` reads."""
    config = SupervisorConfig(http_listen="off", hot_spare=False)
    async with anyio.create_task_group() as tg:
        routes = AdminRoutes(Registry(config, tg), config, status=no_status)
        transport = httpx.ASGITransport(app=Starlette(routes=routes.routes()))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            since = await http.get("/admin/events", params={"since": "²"})
            superscript = {"Last-Event-ID": "²".encode("latin-1")}
            header = await http.get("/admin/events", headers=superscript)
        assert error_of(since, 400)["param"] == "since"
        assert error_of(header, 400)["param"] == "Last-Event-ID"
        tg.cancel_scope.cancel()


# --- events ------------------------------------------------------------------------


def test_events_show_a_killed_runners_death_and_restart_in_order_and_replay(
    start_daemon: DaemonFactory,
) -> None:
    daemon, url = start(start_daemon)
    client = Client(daemon.socket_path)
    client.load("builtin:tiny")
    (listed,) = httpx.get(f"{url}/admin/status", timeout=10).json()["runners"]
    pid = listed["pid"]
    assert listed["name"] == "tiny" and pid == runner(client, "tiny").pid
    live = EventReader(url)

    killed_at = time.time()
    psutil.Process(pid).send_signal(signal.SIGKILL)
    events = live.until(lambda e: e["kind"] == "model_ready" and e["model"] == "tiny")
    assert kinds(events) == [
        "runner_died", "state:crashed", "restart_scheduled", "state:restarting",
        "state:starting", "state:loading", *["model_loading"] * kinds(events).count(
            "model_loading"), "state:ready", "model_ready",
    ]  # fmt: skip
    died = events[0]["fields"]
    assert (died["pid"], died["signal"], died["code"]) == (pid, "SIGKILL", None)
    assert died["cause_class"] in ("unknown", "oom_killed") and "SIGKILL" in died["cause"]
    ids = [e["id"] for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert all(killed_at - 1 <= e["ts"] <= time.time() + 1 for e in events)
    new_pid = events[-1]["fields"]["pid"]
    assert new_pid != pid and runner(client, "tiny").pid == new_pid
    assert events[-1]["fields"]["restarts"] == 1

    # A reader that comes later (or comes back) replays from an id: the same events.
    for params in ({"since": str(ids[0] - 1)}, {}):
        headers = {} if params else {"Last-Event-ID": str(ids[0] - 1)}
        with httpx.stream("GET", f"{url}/admin/events", params=params, headers=headers,
                          timeout=STREAM_WAIT_S) as response:  # fmt: skip
            replayed = []
            for block in sse_blocks(response.iter_lines()):
                if "data" in block:
                    replayed.append(block["data"])
                if replayed and replayed[-1]["id"] == ids[-1]:
                    break
        assert [e for e in replayed if e["model"] == "tiny"] == events
    bad = httpx.get(f"{url}/admin/events", params={"since": "yesterday"})
    assert error_of(bad, 400)["param"] == "since"

    # The daemon stopping ends the stream, after its last events.
    assert daemon.terminate() == 0
    last = live.rest()
    ending = [e["kind"] for e in last if e["kind"] in ("daemon_stopping", "model_unloaded")]
    assert ending == ["daemon_stopping", "model_unloaded"]
    assert [e["id"] for e in last] == sorted(e["id"] for e in last)


def test_events_show_a_keep_alive_expiry_and_its_unload(start_daemon: DaemonFactory) -> None:
    _, url = start(start_daemon, TINY + "keep_alive_s = 0.5\n")
    live = EventReader(url)
    assert httpx.post(f"{url}/admin/models", json={"model": "tiny"}, timeout=60).status_code == 200
    events = live.until(lambda e: e["kind"] == "model_unloaded")
    assert kinds(events)[-4:] == [
        "model_ready",
        "model_expired",
        "state:stopping",
        "model_unloaded",
    ]
    expired, unloaded = events[-3]["fields"], events[-1]["fields"]
    assert expired["keep_alive_s"] == 0.5 and expired["idle_s"] >= 0.5
    assert unloaded["reason"].startswith("expired") and unloaded["steps"] == ["shutdown"]


def test_a_runner_that_fails_to_start_is_no_death_of_the_runner_before_it(
    start_daemon: DaemonFactory,
) -> None:
    """A restart whose runner never starts (here it exits before its
    handshake, as a runner with a bad cpu_blas would) is published as
    ``runner_start_failed``, without a pid, and counts no death: only the
    killed runner's is one, with its own pid."""
    config = TINY.replace("\n[[", "\nrestart_backoff_s = 0.1\nrestart_backoff_cap_s = 0.2\n[[")
    daemon, url = start(start_daemon, config)
    client = Client(daemon.socket_path)
    pid = client.load("builtin:tiny").pid
    assert daemon.config_path is not None
    daemon.config_path.write_text(config + f"env = {{ {FAULTS_ENV} = \"exit_in_handshake\" }}\n")
    (change,) = client.reload().changed
    assert change.next_load == ["env"]
    live = EventReader(url)

    psutil.Process(pid).send_signal(signal.SIGKILL)
    events = live.until(lambda e: e["kind"] == "runner_start_failed")
    died = [e for e in events if e["kind"] == "runner_died"]
    assert [e["fields"]["pid"] for e in died] == [pid]
    failed = events[-1]["fields"]
    assert failed["pid"] is None and "handshake" in failed["error"], failed
    assert client.unload("tiny").name == "tiny"
    deaths = {k: v for k, v in client.status().counters.items() if k.startswith("deaths_")}
    assert sum(deaths.values()) == 1, deaths


def test_a_reader_that_never_reads_leaves_the_daemon_answering_everyone_else(
    start_daemon: DaemonFactory,
) -> None:
    """A client that opens the events stream and reads nothing: the daemon
    answers everyone else as before, and a reader that does read sees every
    event. (The ~60 KB of events here fit in loopback's socket buffers, which
    hold megabytes: what a stream that can no longer write does is
    test_a_stalled_events_stream_is_dropped_and_ends_at_the_write_deadline's.)"""
    daemon, url = start(start_daemon)
    client = Client(daemon.socket_path)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as stalled:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        stalled.connect((host, int(port)))
        stalled.sendall(f"GET /admin/events?since=0 HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        client.load("builtin:tiny")
        # Each answer within the timeout.
        with httpx.Client(base_url=url, headers=JSON, timeout=5) as http:
            for _ in range(150):
                assert http.post("/admin/models/tiny/pin").status_code == 200
                assert http.delete("/admin/models/tiny/pin").status_code == 200
            assert http.get("/admin/status").status_code == 200
            assert client.status().runners[0].state == "ready"
            assert client.unload("tiny").steps == ["shutdown"]
            # A reader that does read sees every one of those events.
            with http.stream("GET", "/admin/events", params={"since": "0"}) as response:
                seen = []
                for block in sse_blocks(response.iter_lines()):
                    if "data" in block:
                        seen.append(block["data"]["kind"])
                        if seen[-1] == "model_unloaded":
                            break
        assert seen.count("model_pinned") == seen.count("model_unpinned") == 150


@pytest.mark.anyio
async def test_a_stalled_events_stream_is_dropped_and_ends_at_the_write_deadline() -> None:
    """What a TCP peer that reads nothing does to a server, once its buffers
    are full (megabytes on loopback, too many events for a test): the
    stream's writes block. The hub drops the stream's subscription once it
    falls a whole buffer behind, publishing never waits, and the stream ends
    at the write deadline."""
    config = SupervisorConfig(http_listen="off", hot_spare=False, client_write_timeout_s=0.5)
    blocked = anyio.Event()

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            blocked.set()
            await anyio.sleep_forever()  # the client's window is shut

    async def receive() -> dict[str, Any]:
        await anyio.sleep_forever()  # nor does it leave
        raise AssertionError

    scope = {"type": "http", "method": "GET", "path": "/admin/events", "raw_path": b"",
             "query_string": b"", "headers": [], "asgi": {"spec_version": "2.3"}}  # fmt: skip
    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            registry = Registry(config, tg)
            hub = registry.events
            app = Starlette(routes=AdminRoutes(registry, config, status=no_status).routes())
            served = anyio.Event()

            async def serve() -> None:
                await app(scope, receive, send)
                served.set()

            tg.start_soon(serve)
            with anyio.fail_after(5):
                await blocked.wait()  # subscribed, and its first write stuck
            assert hub.subscriber_count == 1
            started = time.perf_counter()
            for n in range(1000):
                hub.publish("model_pinned", "tiny", n=n)
            assert time.perf_counter() - started < 0.5  # never waited on the reader
            assert hub.subscriber_count == 0  # dropped, a whole buffer behind
            with anyio.fail_after(5):
                await served.wait()
            tg.cancel_scope.cancel()
    names = [record["event"] for record in logs]
    assert "event_subscriber_lagged" in names and "http_stream_client_stalled" in names


@pytest.mark.anyio
async def test_a_load_call_that_ends_takes_its_progress_listener_with_it() -> None:
    """A streamed load whose client leaves while its model loads: the load
    goes on, the progress listener of the call that ended does not stay on
    the model (to be called on every later load's progress)."""
    config = SupervisorConfig(http_listen="off", hot_spare=False, shutdown_grace_s=0.1)
    heard: list[object] = []
    ended = anyio.Event()
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            registry = Registry(config, tg)
            registry.start_background()
            spec = registry.spec_for(LoadRequest("builtin:tiny", env=faults("hang_at_load")))
            call = anyio.CancelScope()

            async def load() -> None:
                try:
                    with call:
                        await registry.load(spec, heard.append)
                finally:
                    ended.set()

            try:
                async with registry.events.subscribe() as events:
                    tg.start_soon(load)
                    async for event in events:
                        if event.kind == "model_state" and event.fields["new"] == "loading":
                            break
                call.cancel()  # the client left
                await ended.wait()
                entry = registry.entries["tiny"]
                assert entry.state == "loading" and entry.progress_listeners == []
            finally:
                await registry.shutdown()
                tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_an_eviction_of_a_model_gone_meanwhile_is_neither_counted_nor_announced() -> None:
    config = SupervisorConfig(http_listen="off", hot_spare=False)
    async with anyio.create_task_group() as tg:
        registry = Registry(config, tg)
        evict = functools.partial(registry.admitter.evict_to_make_room, for_model="tiny")
        assert await evict("gone", "evicted (memory) to make room for tiny") is False
        evicted: list[str] = []
        victim = SimpleNamespace(name="gone")
        await registry.admission._evict(victim, "tiny", "memory", evict, evicted)  # type: ignore[arg-type]
        assert evicted == [] and registry.counters["evicted"] == 0
        assert [e.kind for e in registry.events.recent()] == []
        sample = registry.metrics.registry.get_sample_value(
            "mlx_supervisor_model_evictions_total", {"model": "gone"}
        )
        assert not sample
        tg.cancel_scope.cancel()


# --- the hub -----------------------------------------------------------------------


def test_event_ids_grow_by_one_and_the_ring_keeps_the_latest() -> None:
    hub = EventHub(history=3, clock=lambda: 1234.5)
    base = hub.last_id  # the ids of this hub are above it
    published = [hub.publish("model_state", "tiny", new=str(n)) for n in range(5)]
    assert [e.id - base for e in published] == [1, 2, 3, 4, 5] and hub.last_id == base + 5
    assert published[0].ts == 1234.5 and published[0].fields == {"new": "0"}
    assert [e.id - base for e in hub.recent()] == [3, 4, 5]
    assert [e.id - base for e in hub.recent(2)] == [4, 5]
    assert [e.id - base for e in hub.after(base + 3)] == [4, 5] and hub.after(base + 5) == []
    assert [e.id - base for e in hub.after(0)] == [3, 4, 5]
    assert json.loads(msgspec.json.encode(published[4])) == {
        "id": base + 5, "ts": 1234.5, "kind": "model_state", "model": "tiny",
        "fields": {"new": "4"},
    }  # fmt: skip


@pytest.mark.anyio
async def test_a_new_daemons_event_ids_are_above_an_old_ones() -> None:
    """A dashboard that reconnects to a new daemon with the last id the old
    one gave it gets every event the new one holds, though the old one
    published more events than the new one has yet (ids start at the
    daemon's start time in microseconds, not at 1)."""
    old = EventHub(clock=lambda: 1000.0)
    for n in range(50):
        old.publish("tick", n=n)
    new = EventHub(clock=lambda: 1000.001)  # a millisecond later
    started = new.publish("daemon_started")
    assert started.id > old.last_id
    assert new.after(old.last_id) == [started]
    async with new.subscribe(since=old.last_id) as reconnected:
        assert await reconnected.receive() == started and reconnected.missed is None
    async with new.subscribe(since=0) as first:  # the dashboard's first connection
        assert await first.receive() == started and first.missed is None


@pytest.mark.anyio
async def test_a_subscription_replays_then_follows_without_a_gap_or_a_repeat() -> None:
    hub = EventHub(history=3)
    base = hub.last_id
    for n in range(3):
        hub.publish("a", n=n)
    async with hub.subscribe(since=base + 1) as subscription:
        hub.publish("b")
        got = [await subscription.receive() for _ in range(3)]
        assert [e.id - base for e in got] == [2, 3, 4] and subscription.missed is None
    hub.publish("c")  # 5; the ring holds 3..5
    async with hub.subscribe(since=0) as late:
        assert (await late.receive()).id == base + 3 and late.missed == (base + 1, base + 2)
    assert hub.subscriber_count == 0


@pytest.mark.anyio
async def test_a_reader_a_whole_buffer_behind_is_dropped_and_the_publisher_goes_on() -> None:
    hub = EventHub(buffer=4)
    base = hub.last_id
    async with hub.subscribe() as slow, hub.subscribe() as other:
        for n in range(10):
            hub.publish("tick", n=n)
        assert [e.id - base async for e in slow] == [1, 2, 3, 4] and slow.lagged
        assert hub.subscriber_count == 0  # both fell behind
        assert other.lagged


@pytest.mark.anyio
async def test_closing_the_hub_ends_every_subscription_after_what_it_holds() -> None:
    hub = EventHub()
    async with hub.subscribe() as subscription:
        hub.publish("daemon_stopping")
        hub.close()
        assert [e.kind async for e in subscription] == ["daemon_stopping"]
        assert not subscription.lagged
    async with hub.subscribe() as after:
        assert [e async for e in after] == []

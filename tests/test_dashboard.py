"""The dashboard (``GET /``) in a real browser: headless Chromium (Debian's
``chromium``, or $MLX_SUPERVISOR_CHROMIUM) driven by Playwright, against a
live daemon with ``builtin:tiny``. What a person does: open the page, load a
model, chat with it, kill its runner and watch the death and the restart.
Screenshots go to the test's tmp dir, and to $MLX_SUPERVISOR_SCREENSHOTS
when it names a directory.

Also, without a browser: the page's headers, the same-origin rule on the
dashboard's routes, and the daemon-side rings it reads (memory timeline,
runner log lines)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from conftest import DaemonFactory, runner
from supervisor.client import Client
from supervisor.config import HTTP_ENV
from supervisor.memory.history import MemoryHistory
from supervisor.memory.monitor import MemoryMonitor, SystemMemory
from supervisor.runners.handle import RunnerLogs

CHROMIUM_ENV = "MLX_SUPERVISOR_CHROMIUM"
SCREENSHOTS_ENV = "MLX_SUPERVISOR_SCREENSHOTS"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]  # fmt: skip
SHOWN_WITHIN_S = 2.0  # a runner's death and its restart, on the page, after the kill
# The model's row follows the status stream (a snapshot at most once a second): a
# looser bound, so that a busy 2-core machine painting late is no failure.
ROW_WITHIN_S = 5.0
CONFIG = """hot_spare = false
memory_poll_s = 0.2
[[models]]
name = "tiny"
model = "builtin:tiny"
"""
STEP_MS = 30_000  # a generous bound on any one step (a load, a chat answer)


def chromium_path() -> str | None:
    """The Chromium to drive: $MLX_SUPERVISOR_CHROMIUM, else Debian's."""
    given = os.environ.get(CHROMIUM_ENV)
    if given:
        return given if os.access(given, os.X_OK) else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


def start_http(start_daemon: DaemonFactory, config: str = CONFIG) -> tuple[Client, str]:
    daemon = start_daemon(config, env={HTTP_ENV: "127.0.0.1:0"})
    client = Client(daemon.socket_path)
    url = client.status().supervisor.http
    assert url is not None
    return client, url


class Browser:
    """A page in a fresh headless Chromium profile, with every console
    message and page error it produced."""

    def __init__(self, context: Any, shots: list[Path]) -> None:
        self.context = context
        self.page = context.new_page()
        self.shots = shots
        self.errors: list[str] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda exc: self.errors.append(f"page error: {exc}"))

    def _console(self, message: Any) -> None:
        if message.type in ("error", "assert"):
            self.errors.append(f"console {message.type}: {message.text} at {message.location}")

    def screenshot(self, name: str) -> None:
        for folder in self.shots:
            self.page.screenshot(path=str(folder / f"dashboard-{name}.png"), full_page=True)

    def no_errors(self) -> None:
        assert not self.errors, "\n".join(self.errors)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    """A headless Chromium page (skipped, saying why, without Chromium or Playwright)."""
    # CI sets MLX_SUPERVISOR_REQUIRE_BROWSER=1: there a missing browser fails the run.
    without = pytest.fail if os.environ.get("MLX_SUPERVISOR_REQUIRE_BROWSER") else pytest.skip
    try:
        from playwright import sync_api
    except ImportError:
        without("Playwright is not installed (dev extras: pip install -e '.[dev]')")
    executable = chromium_path()
    if executable is None:
        without(f"no Chromium: install Debian's chromium (bash run.sh system) or set "
                f"{CHROMIUM_ENV} to a Chromium binary")  # fmt: skip
    shots = [tmp_path / "screenshots"]
    shots[0].mkdir()
    if os.environ.get(SCREENSHOTS_ENV):
        shots.append(Path(os.environ[SCREENSHOTS_ENV]))
        shots[1].mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=executable, args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1100}, timeout=30_000,
        )  # fmt: skip
        try:
            yield Browser(context, shots)
        finally:
            context.close()


def test_a_person_loads_a_model_chats_and_sees_its_runner_die_and_restart(
    start_daemon: DaemonFactory, browser: Browser
) -> None:
    client, url = start_http(start_daemon)
    page = browser.page
    opened = page.goto(url + "/")
    assert opened is not None and opened.status == 200
    policy = opened.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy
    assert "connect-src 'self'" in policy and "unsafe" not in policy
    page.wait_for_selector('#conn[data-connected="true"]', timeout=STEP_MS)
    assert page.is_hidden("#key-panel")  # no key is set: nothing to ask

    # Load by reference, with its progress.
    page.fill("#load-ref", "builtin:tiny")
    page.click("#load-button")
    page.wait_for_selector('#load-progress[data-state="loaded"]', timeout=STEP_MS)
    assert int(page.get_attribute("#load-progress", "data-events") or 0) >= 1
    assert page.eval_on_selector("#load-bar", "bar => bar.value") == 1
    assert "tiny loaded" in page.text_content("#load-text")
    page.wait_for_selector('#model-rows tr[data-model="tiny"][data-state="ready"]',
                           timeout=STEP_MS)  # fmt: skip
    pid = runner(client, "tiny").pid
    assert page.text_content('tr[data-model="tiny"] td.mono') == str(pid)

    # The chat box answers.
    page.fill("#chat-input", "Hello, who are you?")
    page.click("#chat-send")
    page.wait_for_selector('#chat-log[data-state="done"]', timeout=STEP_MS)
    assert page.text_content("#chat-log .message.assistant").strip()

    # The memory timeline has points, and the runner's footprint stacked on it.
    page.wait_for_function("document.getElementById('chart').dataset.points >= 3",
                           timeout=STEP_MS)  # fmt: skip
    assert page.is_visible('#chart polygon[data-model="tiny"]')
    assert page.locator("#chart polyline.used").count() == 1
    assert page.locator("#chart line.threshold").count() == 1  # a line: no area to be visible
    # The log tail of the model shows what its runner wrote.
    page.wait_for_function("document.getElementById('log-lines').textContent"
                           ".includes('load_started')", timeout=STEP_MS)  # fmt: skip
    # A runner's record whose level is a number is shown, not dropped.
    record = """logText({ts: 0, line: '{"event": "x", "level": 30}'})"""
    assert page.evaluate(record).endswith("30      x ")
    # A new status stream (as after a reconnect to a restarted daemon, whose line numbers
    # start again at 0): the page reads the tail again and follows the new numbers.
    page.evaluate("document.getElementById('log-lines').dataset.seq = '1000000000';"
                  "onStatusEvent({event: 'history', data: JSON.stringify("
                  "{span_s: state.spanS, points: state.points})})")  # fmt: skip
    page.wait_for_function("() => Number(document.getElementById('log-lines').dataset.seq) < 1e9",
                           timeout=STEP_MS)  # fmt: skip
    browser.screenshot("loaded")

    # SIGKILL the runner: its death (with its cause class) and its restart, within 2 s.
    died = f'#event-list li[data-kind="runner_died"][data-pid="{pid}"]'
    restarted = '#event-list li[data-kind="restart_scheduled"][data-model="tiny"]'
    row = '#model-rows tr[data-model="tiny"][data-restarts="1"]'
    assert pid is not None
    killed_at = time.time()
    psutil.Process(pid).kill()
    page.wait_for_selector(died, timeout=STEP_MS)
    page.wait_for_selector(restarted, timeout=STEP_MS)
    page.wait_for_selector(row, timeout=STEP_MS)
    row_shown_s = time.time() - killed_at
    death_shown_s = int(page.get_attribute(died, "data-received-ms") or 0) / 1000 - killed_at
    restart_shown_s = int(page.get_attribute(restarted, "data-received-ms") or 0) / 1000 - killed_at
    last_exit = runner(client, "tiny").last_exit
    assert last_exit is not None and last_exit.signal == "SIGKILL"
    cause_class = last_exit.cause_class
    assert page.get_attribute(died, "data-cause-class") == cause_class
    assert cause_class in page.text_content(died)
    assert page.get_attribute(row, "data-cause-class") == cause_class
    assert "SIGKILL" in page.text_content(f"{row} td.exit")
    shown = {"death": death_shown_s, "restart": restart_shown_s, "row": row_shown_s}
    assert all(0 <= s <= SHOWN_WITHIN_S for s in (death_shown_s, restart_shown_s)), shown
    assert 0 <= row_shown_s <= ROW_WITHIN_S, shown
    page.wait_for_selector('#model-rows tr[data-model="tiny"][data-state="ready"]',
                           timeout=STEP_MS)  # fmt: skip
    # The log tail went on: the restarted runner's lines are there too.
    page.wait_for_function("() => document.getElementById('log-lines').textContent"
                           ".split('load_started').length > 2", timeout=STEP_MS)  # fmt: skip
    browser.screenshot("restarted")
    browser.no_errors()


def test_the_page_asks_for_the_key_once_and_keeps_it_for_the_tab(
    start_daemon: DaemonFactory, browser: Browser
) -> None:
    _, url = start_http(start_daemon, 'api_key = "s3cret"\n' + CONFIG)
    # Without the key the data routes refuse; the page itself holds no data.
    assert httpx.get(f"{url}/admin/status/stream", timeout=30).status_code == 401
    page = browser.page
    page.goto(url + "/")
    page.wait_for_selector("#key-panel:not([hidden])", timeout=STEP_MS)
    assert page.get_attribute('meta[name="mlx-supervisor-keys"]', "content") == "admin api same"
    assert "s3cret" not in page.content()
    page.fill("#key-input", "s3cret")
    page.click("#key-use")
    page.wait_for_selector('#conn[data-connected="true"]', timeout=STEP_MS)
    assert page.evaluate("sessionStorage.getItem('mlx-supervisor.admin-key')") == "s3cret"
    assert page.input_value("#key-input") == ""  # the key does not stay in the page
    # A load from the page carries it too.
    page.fill("#load-ref", "builtin:tiny")
    page.click("#load-button")
    page.wait_for_selector('#model-rows tr[data-model="tiny"][data-state="ready"]',
                           timeout=STEP_MS)  # fmt: skip
    browser.screenshot("with-key")
    # Reloaded, the tab still has it: no question this time.
    page.reload()
    page.wait_for_selector('#conn[data-connected="true"]', timeout=STEP_MS)
    assert page.is_hidden("#key-panel")
    browser.no_errors()


@pytest.mark.parametrize("cors", ["[]", '["*"]'])
def test_the_dashboard_routes_serve_their_own_origin_only(
    start_daemon: DaemonFactory, cors: str
) -> None:
    """The page's requests carry its own Origin (scheme://host:port it was
    loaded from, under an allowed name): served. Any other origin, another
    port of the same name included, is refused, even with every origin
    allowed to the model APIs (``http_cors_origins = ["*"]``), and so is a
    request a browser marks as another site's with no Origin."""
    client, url = start_http(start_daemon, f"http_cors_origins = {cors}\n" + CONFIG)
    port = int(url.rsplit(":", 1)[1])
    page = httpx.get(url + "/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    for asset in ("app.js", "app.css", "icon.svg"):
        fetched = httpx.get(f"{url}/dashboard/{asset}", timeout=30)
        assert fetched.status_code == 200, asset
        assert fetched.headers["x-content-type-options"] == "nosniff"
    own = [url, f"http://localhost:{port}"]
    hosts = [None, f"localhost:{port}"]
    for origin, host in zip(own, hosts, strict=True):
        headers = {"Origin": origin, **({"Host": host} if host else {})}
        pinned = httpx.post(f"{url}/admin/models/nothing/pin", json={}, headers=headers, timeout=30)
        assert pinned.status_code == 404, pinned.text  # past the guard: no such model
        logs = httpx.get(f"{url}/admin/models/nothing/logs", headers=headers, timeout=30)
        assert logs.status_code == 404 and logs.json()["error"]["code"] == "unknown_model"
    for origin in (f"http://localhost:{port + 1}", "http://attacker.example", "null",
                   url.replace("http://", "https://attacker.")):  # fmt: skip
        for method, path in (("POST", "/admin/models"), ("GET", "/admin/status/stream"),
                             ("GET", "/admin/models/tiny/logs")):  # fmt: skip
            refused = httpx.request(method, url + path, json={"model": "builtin:tiny"},
                                    headers={"Origin": origin}, timeout=30)  # fmt: skip
            assert refused.status_code == 403, (origin, path, refused.text)
            assert refused.json()["error"]["code"] == "origin_not_allowed"
    for site in ("cross-site", "same-site"):
        for path in ("/admin/status/stream", "/admin/models/tiny/logs"):
            refused = httpx.get(url + path, headers={"Sec-Fetch-Site": site}, timeout=30)
            assert refused.status_code == 403, (site, path, refused.text)
    assert client.status().runners == []  # nothing a refused page asked for happened


# --- the rings the page reads ---------------------------------------------------------


def test_the_memory_history_keeps_fifteen_minutes_of_points() -> None:
    now = [1000.0]
    monitor = MemoryMonitor(override_mb=None, threshold_pct=80.0, poll_s=1.0, footprint=lambda: 0,
                            read=lambda: SystemMemory(8 << 30, 6 << 30))  # fmt: skip
    history = MemoryHistory(monitor, lambda: {"tiny": 5 << 20}, clock=lambda: now[0])
    heard: list[float] = []
    stop = history.listen(lambda point: heard.append(point.ts))
    for _ in range(1000):
        history.record()
        now[0] += 1.0
    points = history.points()
    assert len(points) == 901 and points[-1].ts - points[0].ts == 900
    assert points[-1].used_bytes == 2 << 30 and points[-1].total_bytes == 8 << 30
    assert points[-1].threshold_pct == 80.0 and points[-1].runners == {"tiny": 5 << 20}
    assert history.points(after_ts=points[-3].ts) == points[-2:]
    assert len(heard) == 1000
    stop()
    now[0] += 3600  # the machine slept: what is older than the span goes
    history.record()
    assert len(history.points()) == 1 and len(heard) == 1000


def test_runner_logs_keep_each_models_last_lines_across_runners() -> None:
    logs = RunnerLogs(lines_per_model=3, models=2, clock=lambda: 5.0)
    woken: list[int] = []
    logs.listen(lambda: woken.append(logs.last_seq))
    for i in range(5):
        logs.add("a", f"a{i}")
    logs.add("b", "b0")
    assert [line.line for line in logs.tail("a")] == ["a2", "a3", "a4"]
    assert woken == [1, 2, 3, 4, 5, 6]
    lines, skipped = logs.after(4)
    assert [line.line for line in lines] == ["a4", "b0"] and skipped == 0
    logs.add("c", "c0")  # a third model: the one heard from longest ago ("a") goes
    assert logs.tail("a") == [] and [line.line for line in logs.tail("c")] == ["c0"]
    many = RunnerLogs(lines_per_model=2)  # the recent lines hold 4 x lines_per_model
    for i in range(20):
        many.add("m", str(i))
    lines, skipped = many.after(0)
    assert [line.seq for line in lines] == list(range(13, 21)) and skipped == 12

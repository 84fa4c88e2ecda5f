"""Fault boundaries of the daemon's own tasks: an unexpected error in accepting
connections or in keep-alive expiry is logged, and the daemon goes on.

Component tests: the errors they inject (an accept error the kernel gives
only rarely, a bug) cannot be had from a real daemon on demand.
"""

from __future__ import annotations

import errno
import signal
import time
from pathlib import Path

import anyio
import pytest
import structlog
from anyio.abc import SocketListener, SocketStream

from supervisor.config import ModelConfig, SupervisorConfig
from supervisor.daemon.main import serve_connections
from supervisor.registry.registry import ModelEntry, Registry
from supervisor.registry.restart import RestartIntensity, RestartTracker


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class FlakyListener:
    """A real unix listener whose next accepts fail with ``errors`` first."""

    def __init__(self, real: SocketListener, errors: list[Exception]) -> None:
        self.real = real
        self.errors = errors

    async def accept(self) -> SocketStream:
        if self.errors:
            raise self.errors.pop(0)
        return await self.real.accept()


@pytest.mark.anyio
async def test_an_unexpected_accept_error_is_logged_and_accepting_goes_on(tmp_path: Path) -> None:
    served = anyio.Event()

    async def handler(stream: SocketStream) -> None:
        await stream.send(b"served")
        await stream.aclose()
        served.set()

    path = tmp_path / "s.sock"
    async with await anyio.create_unix_listener(path) as real:
        listener = FlakyListener(real, [OSError(errno.EPROTO, "Protocol error"),
                                        RuntimeError("a bug in accept")])  # fmt: skip
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(serve_connections, listener, handler)
                client = await anyio.connect_unix(path)
                assert await client.receive() == b"served"
                await client.aclose()
                await served.wait()
                tg.cancel_scope.cancel()
        assert not listener.errors


def idle_entry(name: str, idle_s: float) -> ModelEntry:
    """A ready, idle model whose keep-alive ran out ``idle_s`` ago."""
    spec = ModelConfig(name=name, model="builtin:tiny", keep_alive_s=1.0)
    entry = ModelEntry(spec, RestartTracker("always", RestartIntensity()), state="ready")
    entry.keep_alive_s = 1.0
    entry.last_used = time.monotonic() - 1.0 - idle_s
    return entry


@pytest.mark.anyio
async def test_a_bug_in_keep_alive_expiry_is_logged_and_expiry_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    evicted: list[str] = []
    both = anyio.Event()

    async def evict(self: Registry, name: str, reason: str) -> None:
        evicted.append(name)
        del self.entries[name]
        if len(evicted) == 2:
            both.set()
        if name == "first":
            raise RuntimeError("a bug in the unload")

    monkeypatch.setattr(Registry, "_evict", evict)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            registry = Registry(SupervisorConfig(hot_spare=False, http_listen="off"), tg)
            registry.start_background()
            registry.entries["first"] = idle_entry("first", idle_s=2.0)
            registry.idle_changed()
            await anyio.wait_all_tasks_blocked()
            registry.entries["second"] = idle_entry("second", idle_s=1.0)
            registry.idle_changed()
            await both.wait()
            tg.cancel_scope.cancel()
    assert evicted == ["first", "second"]


class BrokenHandle:
    """A runner handle whose kill ladder fails with a bug."""

    alive = True
    pid = None
    log = structlog.get_logger("test")

    def __init__(self) -> None:
        self.signals: list[int] = []

    async def escalate(self, reason: str) -> list[str]:
        raise RuntimeError("a bug in the kill ladder")

    def signal(self, signum: int) -> None:
        self.signals.append(signum)


@pytest.mark.anyio
async def test_an_unload_that_fails_midway_still_forgets_the_model() -> None:
    # Else the name stays "stopping" for good: it can be neither loaded again
    # nor unloaded, and requests for it wait for a stop that never comes.
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            registry = Registry(SupervisorConfig(hot_spare=False, http_listen="off"), tg)
            entry = idle_entry("broken", idle_s=0.0)
            handle = entry.handle = BrokenHandle()  # type: ignore[assignment]
            registry.entries["broken"] = entry
            with pytest.raises(RuntimeError, match="kill ladder"):
                await registry.unload("broken")
            assert "broken" not in registry.entries
            assert entry.forgotten.is_set()
            assert handle.signals == [signal.SIGKILL]  # no runner outlives its forgotten model
            tg.cancel_scope.cancel()

"""The async client, and the promise that the daemon side never imports mlx."""

from __future__ import annotations

import subprocess
import sys

import anyio
import pytest

from supervisor.client import AsyncClient, Client, ClientError
from supervisor.daemon_process import DaemonProcess


def test_async_client_loads_generates_and_unloads(daemon: DaemonProcess) -> None:
    async def main() -> tuple[str, str]:
        client = AsyncClient(daemon.socket_path)
        loaded = await client.load("builtin:tiny")
        pieces = [piece async for piece in client.generate("tiny", "Hi", max_tokens=12)]
        status = await client.status()
        assert [r.name for r in status.runners] == ["tiny"]
        with pytest.raises(ClientError) as excinfo:
            await client.unload("missing")
        assert excinfo.value.code == "unknown_model"
        await client.unload(loaded.name)
        return "".join(pieces), loaded.name

    text, name = anyio.run(main)
    assert name == "tiny"
    # Same text as the sync client gets (greedy, same daemon-side path).
    sync = Client(daemon.socket_path)
    sync.load("builtin:tiny")
    expected, _ = sync.generate_text("tiny", "Hi", max_tokens=12)
    assert text == expected


def test_async_generate_abandoned_midway_leaves_runner_ready(daemon: DaemonProcess) -> None:
    async def main() -> str:
        client = AsyncClient(daemon.socket_path)
        await client.load("builtin:tiny")
        stream = client.generate("tiny", "Hi", max_tokens=100_000)
        async for _ in stream:
            break
        await stream.aclose()  # type: ignore[attr-defined]
        pieces = [p async for p in client.generate("tiny", "Hi", max_tokens=4)]
        assert 1 <= len(pieces) <= 4  # the first token alone, the rest maybe coalesced
        return "".join(pieces)

    text = anyio.run(main)
    expected, done = Client(daemon.socket_path).generate_text("tiny", "Hi", max_tokens=4)
    assert text == expected and done.generation_tokens == 4


def test_supervisor_side_never_imports_mlx() -> None:
    code = (
        "import sys\n"
        "import supervisor.cli, supervisor.daemon, supervisor.registry, supervisor.control\n"
        "import supervisor.client, supervisor.demo, supervisor.daemon_process, supervisor.service\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'runner'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

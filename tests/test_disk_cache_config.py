"""The prefix cache's disk tier, supervisor side: its config keys, where its
blocks go, the engine settings a runner gets, ``cache clear --disk-only``
and the status table's cell."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from conftest import DaemonFactory
from ipc.messages import (
    CacheCleared,
    CacheClearRequest,
    DiskCacheStats,
    LoadRequest,
    PrefixCacheStats,
    RunnerInfo,
    StatusReply,
    SupervisorInfo,
    SystemInfo,
)
from modelfiles.cache import cache_root
from supervisor.cli.main import build_parser
from supervisor.cli.render import cache_cleared_line, status_table
from supervisor.client import Client, commands
from supervisor.config import (
    KV_CACHE_DIR_ENV,
    ConfigError,
    ModelConfig,
    SupervisorConfig,
    kv_cache_dir,
    load_config,
)
from supervisor.registry.specs import engine_settings, merge_spec

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
GIB = 1 << 30


def config_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_the_disk_tier_is_on_with_4_gib_per_model_by_default() -> None:
    config = SupervisorConfig()
    assert (config.prefix_cache_disk_bytes, config.prefix_cache_dir) == (4 * GIB, None)
    assert ModelConfig(name="m", model="builtin:tiny").prefix_cache_disk_bytes is None


def test_disk_budgets_and_the_directory_decode_from_the_config(tmp_path: Path) -> None:
    config = load_config(config_file(tmp_path, """
prefix_cache_disk_bytes = 0
prefix_cache_dir = "~/blocks"

[[models]]
name = "m"
model = "builtin:tiny"
prefix_cache_disk_bytes = 1073741824
"""))  # fmt: skip
    assert (config.prefix_cache_disk_bytes, config.prefix_cache_dir) == (0, "~/blocks")
    assert config.models[0].prefix_cache_disk_bytes == GIB


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("prefix_cache_disk_bytes = -1", r"`int` >= 0 - at `\$.prefix_cache_disk_bytes`"),
        ('prefix_cache_disk_bytes = "4 GiB"', r"Expected `int`.* `\$.prefix_cache_disk_bytes`"),
        ("prefix_cache_disk_bytes = 1.5", r"Expected `int`.* `\$.prefix_cache_disk_bytes`"),
        ('prefix_cache_dir = ""', r"length >= 1 - at `\$.prefix_cache_dir`"),
        ("prefix_cache_dir = 3", r"Expected `str \| null`.* `\$.prefix_cache_dir`"),
        ('[[models]]\nname = "m"\nmodel = "builtin:tiny"\nprefix_cache_disk_bytes = -1',
         r"`int` >= 0 - at `\$.models\[0\].prefix_cache_disk_bytes`"),
    ],
)  # fmt: skip
def test_bad_disk_tier_values_are_errors_naming_the_key(
    tmp_path: Path, text: str, expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config(config_file(tmp_path, text + "\n"))


def test_the_shipped_config_documents_the_per_model_disk_budget(tmp_path: Path) -> None:
    text = (CONFIGS / "mlx-supervisor.toml").read_text()
    uncommented = text.replace("# [[models]]", "[[models]]")
    for key in ("name", "model", "prefix_cache_disk_bytes"):
        uncommented = uncommented.replace(f"# {key} ", f"{key} ")
    (model,) = load_config(config_file(tmp_path, uncommented)).models
    assert model.prefix_cache_disk_bytes == 8 * GIB
    assert "# prefix_cache_dir = " in text


def test_the_block_directory_comes_from_the_config_then_the_environment_then_the_user_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv(KV_CACHE_DIR_ENV, str(tmp_path / "from-env"))
    configured = SupervisorConfig(prefix_cache_dir="~/blocks")
    assert kv_cache_dir(configured) == tmp_path / "home" / "blocks"
    assert kv_cache_dir(SupervisorConfig()) == tmp_path / "from-env"
    monkeypatch.delenv(KV_CACHE_DIR_ENV)
    assert kv_cache_dir(SupervisorConfig()) == cache_root() / "kv"
    monkeypatch.setenv(KV_CACHE_DIR_ENV, "")  # empty: as if unset
    assert kv_cache_dir(SupervisorConfig()) == cache_root() / "kv"


def test_the_tests_keep_their_blocks_apart_from_the_session_cache() -> None:
    assert kv_cache_dir(SupervisorConfig()) != cache_root() / "kv"  # conftest's isolated_xdg


def test_a_runner_gets_the_model_s_disk_budget_else_the_daemon_s_and_the_directory(
    tmp_path: Path,
) -> None:
    config = SupervisorConfig(
        prefix_cache_disk_bytes=2 * GIB,
        prefix_cache_dir=str(tmp_path / "blocks"),
        models=[ModelConfig(name="small", model="builtin:tiny", prefix_cache_disk_bytes=GIB),
                ModelConfig(name="none", model="builtin:tiny", prefix_cache_disk_bytes=0)],
    )  # fmt: skip

    def settings(name: str) -> tuple[int, str | None]:
        engine = engine_settings(config, merge_spec(config, LoadRequest("builtin:tiny", name)))
        return engine.prefix_cache_disk_bytes, engine.prefix_cache_dir

    blocks = str(tmp_path / "blocks")
    assert settings("small") == (GIB, blocks)
    assert settings("none") == (0, blocks)  # the model's 0 wins over the daemon's budget
    assert settings("other") == (2 * GIB, blocks)


def test_a_distributed_group_gets_no_disk_tier() -> None:
    config = SupervisorConfig()
    alone = ModelConfig(name="m", model="builtin:tiny", ranks=1, prefix_cache_disk_bytes=GIB)
    assert engine_settings(config, alone).prefix_cache_disk_bytes == GIB
    for group in ({"ranks": 2}, {"hostfile": "/etc/mlx/hosts.json"}):
        spec = ModelConfig(name="m", model="builtin:tiny", prefix_cache_disk_bytes=GIB, **group)
        assert engine_settings(config, spec).prefix_cache_disk_bytes == 0, group


def test_cache_clear_takes_disk_only_to_the_request() -> None:
    parser = build_parser()
    assert parser.parse_args(["cache", "clear", "m", "--disk-only"]).disk_only is True
    assert parser.parse_args(["cache", "clear", "m"]).disk_only is False
    assert commands.clear_cache("m", disk_only=True).request == CacheClearRequest("m", True)
    assert commands.clear_cache("m").request == CacheClearRequest("m", False)


def test_cache_clear_prints_both_tiers_or_the_disk_alone() -> None:
    cleared = CacheCleared("m", entries=3, bytes=12 << 20, disk_entries=40, disk_bytes=200 << 20)
    assert cache_cleared_line(cleared) == (
        "m: prefix cache cleared (3 entries, 12.0 MiB in RAM; 40 blocks, 200.0 MiB on disk)"
    )
    assert cache_cleared_line(cleared, disk_only=True) == (
        "m: prefix cache cleared (40 blocks, 200.0 MiB on disk)"
    )


def test_status_shows_the_disk_tier_s_bytes_in_the_cache_cell() -> None:
    loaded = RunnerInfo("m", "builtin:x", 1, "ready", 1 << 20, 0.0, 0, None, batching=True)
    ram = PrefixCacheStats(entries=3, bytes=12 << 20, hits=4, misses=1)

    def cache_column(cache: PrefixCacheStats, kv_bits: int | None = None) -> str:
        info = msgspec.structs.replace(loaded, prefix_cache=cache, kv_bits=kv_bits)
        status = StatusReply(
            SupervisorInfo(1, "0", 1.0, "/s"), SystemInfo(1 << 30, 1 << 29), [info]
        )
        return status_table(status).splitlines()[-1]

    on = msgspec.structs.replace(ram, disk=DiskCacheStats("/kv/m", entries=40, bytes=200 << 20))
    assert "12.0 MiB, 3 (80% hits), disk 200.0 MiB " in cache_column(on)
    assert "12.0 MiB, 3 (80% hits), disk 200.0 MiB, kv 8-bit" in cache_column(on, kv_bits=8)
    off = msgspec.structs.replace(ram, disk=DiskCacheStats(reason="directory not writable"))
    for cache in (ram, off):
        assert "disk" not in cache_column(cache)


def test_cache_clear_disk_only_reaches_the_runner_and_the_log(
    start_daemon: DaemonFactory,
) -> None:
    daemon = start_daemon()
    client = Client(daemon.socket_path)
    client.load("builtin:tiny")
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "cache", "clear", "tiny", "--disk-only",
         "--socket", str(daemon.socket_path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"tiny: prefix cache cleared \(\d+ blocks, [\d.]+ \w+ on disk\)\n",
                        done.stdout), done.stdout  # fmt: skip
    cleared = client.clear_cache("tiny")

    def daemons_own() -> list[dict[str, object]]:
        return [r for r in daemon.events("prefix_cache_cleared") if r.get("source") != "runner"]

    # The reply can come before our reader thread has read the daemon's log line.
    daemon.wait_until(lambda: len(daemons_own()) == 2, timeout_s=10)
    (disk_only, both) = daemons_own()
    assert (disk_only["disk_only"], both["disk_only"]) == (True, False)
    assert (both["disk_entries"], both["disk_bytes"]) == (cleared.disk_entries, cleared.disk_bytes)

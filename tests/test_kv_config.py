"""A quantized KV cache (``kv_bits``, ``kv_group_size``) from the config or a
load request, through the daemon to the runner's load probe, and in status."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from conftest import DaemonFactory, runner
from ipc.messages import PrefixCacheStats, RunnerInfo, StatusReply, SupervisorInfo, SystemInfo
from supervisor.cli.render import status_table
from supervisor.client import Client, ClientError

# builtin:tiny's head_dim is 16, and mlx quantizes in groups of 32, 64 or 128
# along it: no group size fits, and the runner's probe at load says so.
PRELOADED = """
[[models]]
name = "tq"
model = "builtin:tiny"
kv_bits = 4
kv_group_size = 32
preload = true
"""


def test_a_kv_cache_the_model_cannot_quantize_fails_the_load_naming_head_dim_and_group(
    start_daemon: DaemonFactory,
) -> None:
    daemon = start_daemon(PRELOADED)
    client = Client(daemon.socket_path)

    with pytest.raises(ClientError) as excinfo:
        client.load("builtin:tiny", kv_bits=8)
    error = excinfo.value
    assert error.code == "load_failed"
    assert "kv_bits=8" in error.message
    assert re.search(r"\b16\b", error.message) and re.search(r"\b64\b", error.message), error
    assert "tiny" not in [r.name for r in client.status().runners]  # a first load: not kept

    # From the config: a preloaded model stays, failed with the reason, and its
    # status shows the KV cache it asked for.
    daemon.wait_until(lambda: runner(client, "tq").state == "failed")
    info = runner(client, "tq")
    assert (info.kv_bits, info.kv_group_size) == (4, 32)
    assert info.failure is not None and "kv_bits=4" in info.failure
    assert re.search(r"\b32\b", info.failure), info.failure
    assert "kv 4-bit" in status_table(client.status())
    (planned,) = [e for e in daemon.events("model_estimate") if e.get("model") == "tq"]
    assert (planned["kv_bits"], planned["kv_group_size"]) == (4, 32)

    # A distributed group: refused before any runner starts.
    with pytest.raises(ClientError) as excinfo:
        client.load("builtin:tiny", "pair", ranks=2, kv_bits=8)
    assert excinfo.value.code == "bad_request"
    assert "kv_bits with a distributed group" in excinfo.value.message


def test_status_shows_a_quantized_kv_cache_beside_the_prefix_cache() -> None:
    loaded = RunnerInfo("m", "builtin:x", 1, "ready", 1 << 20, 0.0, 0, None, batching=True)
    cache = PrefixCacheStats(entries=3, bytes=12 << 20, hits=4, misses=1)

    def cache_column(info: RunnerInfo) -> str:
        status = StatusReply(
            SupervisorInfo(1, "0", 1.0, "/s"), SystemInfo(1 << 30, 1 << 29), [info]
        )
        return status_table(status).splitlines()[-1]

    replace = msgspec.structs.replace
    quantized = replace(loaded, prefix_cache=cache, kv_bits=8, kv_group_size=64)
    assert "12.0 MiB, 3 (80% hits), kv 8-bit" in cache_column(quantized)
    assert "off, kv 4-bit" in cache_column(replace(loaded, kv_bits=4, kv_group_size=32))
    assert "kv" not in cache_column(replace(loaded, prefix_cache=cache))


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first run fetches builtin:smollm2 (93 MB)
def test_a_real_model_with_an_8_bit_kv_cache_still_answers_paris(
    start_daemon: DaemonFactory, smollm2_dir: Path
) -> None:
    """Greedy builtin:smollm2, its KV cache quantized to 8 bits, through the
    daemon: the same answer as with its own dtype's cache; and the second
    time, from its prefix cache (quantized too)."""
    client = Client(start_daemon().socket_path)
    client.load("builtin:smollm2", kv_bits=8)
    info = runner(client, "smollm2")
    assert (info.kv_bits, info.kv_group_size) == (8, 64)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    cached = []
    for _ in range(2):
        answer = client.generate("smollm2", messages=question, max_tokens=24)
        assert "".join(answer) == "The capital of France is Paris."
        assert answer.done is not None and answer.done.finish_reason == "stop"
        cached.append(answer.done.cached_tokens)
    assert cached[1] > cached[0]  # the second answer's prompt came from the prefix cache

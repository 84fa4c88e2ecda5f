"""The memory monitor: vm_stat parsing, thresholds, the override, the gate.

The vm_stat outputs below are real recordings pasted verbatim from public
threads (sources beside each). They are the one fake this file allows: this
machine is not a Mac, and the monitor needs controlled numbers.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable

import anyio
import pytest
from structlog.testing import capture_logs

from supervisor.memory.monitor import (
    GiB,
    MemoryMonitor,
    MemorySnapshot,
    MiB,
    SystemMemory,
    default_guard_bytes,
    default_threshold_pct,
    macos_available_bytes,
    override_mb,
    parse_vm_stat,
    read_system_memory,
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# Apple Silicon (16 KiB pages), a 16 GiB Mac deep in the compressor ("The system
# has 17179869184" follows it in the same capture). From
# https://github.com/whanyu1212/gem-dota/pull/173 (memory-pressure-1.txt).
VM_STAT_APPLE_SILICON = """\
Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                                     4229.
Pages active:                                 186123.
Pages inactive:                               184925.
Pages speculative:                               681.
Pages throttled:                                   0.
Pages wired down:                             198107.
Pages purgeable:                                  24.
"Translation faults":                     6085905557.
Pages copy-on-write:                       391952527.
Pages zero filled:                        2318477816.
Pages reactivated:                        1417078090.
Pages purged:                               61860720.
File-backed pages:                            133056.
Anonymous pages:                              238673.
Pages stored in compressor:                  1736474.
Pages occupied by compressor:                 436782.
Decompressions:                            950112330.
Compressions:                             1066060384.
Pageins:                                    86971767.
Pageouts:                                    1809283.
Swapins:                                     4693446.
Swapouts:                                    6168528.
"""
APPLE_SILICON_TOTAL = 17179869184

# Intel Mac (4 KiB pages), 16 GiB, with the compressor in use. From
# https://github.com/kamkor/akka-cluster-load-balancing/issues/2
VM_STAT_INTEL = """\
Mach Virtual Memory Statistics: (page size of 4096 bytes)
Pages free:                              264375.
Pages active:                           2027888.
Pages inactive:                          651659.
Pages speculative:                        23565.
Pages throttled:                              0.
Pages wired down:                        852647.
Pages purgeable:                          39328.
"Translation faults":                 880109291.
Pages copy-on-write:                   44871249.
Pages zero filled:                    433518664.
Pages reactivated:                      5346396.
Pages purged:                           1423915.
File-backed pages:                       379668.
Anonymous pages:                        2323444.
Pages stored in compressor:             2870604.
Pages occupied by compressor:            372004.
Decompressions:                        33640670.
Compressions:                          43459639.
Pageins:                               10427527.
Pageouts:                                 34549.
Swapins:                               32669611.
Swapouts:                              34330610.
"""

# Intel Mac (4 KiB pages), 32 GiB, mostly free. From
# https://github.com/wazuh/wazuh/issues/22113
VM_STAT_INTEL_IDLE = """\
Mach Virtual Memory Statistics: (page size of 4096 bytes)
Pages free:                             6127229.
Pages active:                            485320.
Pages inactive:                          628646.
Pages speculative:                       430715.
Pages throttled:                              0.
Pages wired down:                        715958.
Pages purgeable:                          11820.
"Translation faults":                  11477162.
Pages copy-on-write:                     356264.
Pages zero filled:                      7628050.
Pages reactivated:                         9561.
Pages purged:                              1423.
File-backed pages:                      1080348.
Anonymous pages:                         464333.
Pages stored in compressor:                   0.
Pages occupied by compressor:                 0.
Decompressions:                               0.
Compressions:                                 0.
Pageins:                                 280307.
Pageouts:                                     0.
Swapins:                                      0.
Swapouts:                                     0.
"""
INTEL_IDLE_TOTAL = 32 * GiB


def recorded(text: str, total: int) -> SystemMemory:
    """A recorded vm_stat turned into the reading read_system_memory makes of it."""
    pages = parse_vm_stat(text)
    return SystemMemory(total, macos_available_bytes(pages), pages)


def no_runners() -> int:
    return 0


# --- vm_stat ----------------------------------------------------------------


def test_vm_stat_apple_silicon_pages_become_bytes_with_16k_pages() -> None:
    pages = parse_vm_stat(VM_STAT_APPLE_SILICON)
    assert pages["free"] == 4229 * 16384
    assert pages["active"] == 186123 * 16384
    assert pages["inactive"] == 184925 * 16384
    assert pages["speculative"] == 681 * 16384
    assert pages["wired"] == 198107 * 16384
    assert pages["purgeable"] == 24 * 16384
    assert pages["compressed"] == 436782 * 16384
    assert pages["stored_in_compressor"] == 1736474 * 16384
    assert pages["file_backed"] == 133056 * 16384
    assert pages["anonymous"] == 238673 * 16384
    assert pages["translation_faults"] == 6085905557 * 16384
    assert pages["copy_on_write"] == 391952527 * 16384
    assert pages["swapouts"] == 6168528 * 16384
    assert len(pages) == 22  # every line but the header


def test_vm_stat_intel_pages_become_bytes_with_4k_pages() -> None:
    pages = parse_vm_stat(VM_STAT_INTEL)
    assert pages["free"] == 264375 * 4096
    assert pages["wired"] == 852647 * 4096
    assert pages["compressed"] == 372004 * 4096
    assert pages["pageins"] == 10427527 * 4096
    assert pages["throttled"] == 0


def test_compressed_pages_are_not_available() -> None:
    pages = parse_vm_stat(VM_STAT_APPLE_SILICON)
    available = macos_available_bytes(pages)
    # free + speculative + inactive + purgeable; 6.7 GiB in the compressor stay out
    assert available == (4229 + 681 + 184925 + 24) * 16384
    assert available < 3 * GiB < pages["compressed"]
    intel = parse_vm_stat(VM_STAT_INTEL)
    assert macos_available_bytes(intel) == (264375 + 23565 + 651659 + 39328) * 4096


def test_vm_stat_parser_refuses_text_without_a_page_size() -> None:
    with pytest.raises(ValueError, match="page size"):
        parse_vm_stat("Pages free: 12.\n")


def test_reading_this_machine_gives_sane_numbers() -> None:
    reading = read_system_memory()
    assert reading.total_bytes > 0
    assert 0 < reading.available_bytes <= reading.total_bytes
    if sys.platform == "darwin":
        assert "compressed" in reading.details


# --- thresholds, override, guard -------------------------------------------


@pytest.mark.parametrize(
    ("total", "pct"),
    [
        (8 * GiB, 70.0),
        (32 * GiB - 1, 70.0),
        (32 * GiB, 75.0),
        (64 * GiB - 1, 75.0),
        (64 * GiB, 80.0),
        (128 * GiB - 1, 80.0),
        (128 * GiB, 85.0),
        (512 * GiB, 85.0),
    ],
)
def test_threshold_tiers_switch_at_32_64_128_gib(total: int, pct: float) -> None:
    assert default_threshold_pct(total) == pct


def test_override_from_environment_wins_over_config() -> None:
    assert override_mb(16384, {"OVERRIDE_MEMORY_MB": "8192"}) == 8192
    assert override_mb(16384, {}) == 16384
    assert override_mb(None, {}) is None
    assert override_mb(4096, {"OVERRIDE_MEMORY_MB": "  "}) == 4096  # empty is unset


@pytest.mark.parametrize("bad", ["abc", "0", "-512", "1.5", "8G"])
def test_override_rejects_a_bad_environment_value(bad: str) -> None:
    with pytest.raises(ValueError, match="OVERRIDE_MEMORY_MB"):
        override_mb(None, {"OVERRIDE_MEMORY_MB": bad})


def test_override_rejects_a_non_positive_config_value() -> None:
    with pytest.raises(ValueError, match="memory_override_mb"):
        override_mb(0, {})


def test_guard_is_a_tenth_of_total_with_a_5_gib_floor() -> None:
    assert default_guard_bytes(64 * GiB, 64 * GiB) == 64 * GiB // 10
    assert default_guard_bytes(24 * GiB, 24 * GiB) == 5 * GiB
    assert default_guard_bytes(48 * GiB, 32 * GiB) == 5 * GiB  # override above the real machine


def test_guard_floor_shrinks_with_an_override() -> None:
    # 8 GiB simulated on 64 GiB: floor 5 * 8/64 = 0.625 GiB, a tenth is 0.8 GiB
    assert default_guard_bytes(8 * GiB, 64 * GiB) == 8 * GiB // 10
    # 4 GiB simulated on 16 GiB: floor 1.25 GiB beats a tenth (0.4 GiB)
    assert default_guard_bytes(4 * GiB, 16 * GiB) == 5 * GiB // 4


# --- snapshots ---------------------------------------------------------------


def test_describe_is_one_line_with_the_numbers() -> None:
    snapshot = MemorySnapshot(
        total_bytes=24 * GiB,
        available_bytes=int(24 * GiB * 0.513),
        real_total_bytes=24 * GiB,
        real_available_bytes=int(24 * GiB * 0.513),
        override_mb=None,
        threshold_pct=70.0,
        runners_bytes=0,
        taken_at=0.0,
    )
    assert snapshot.describe() == "12.3 GiB available of 24.0 GiB (48.7% used, threshold 70%)"


def test_without_override_the_real_machine_is_believed() -> None:
    reading = recorded(VM_STAT_APPLE_SILICON, APPLE_SILICON_TOTAL)
    monitor = MemoryMonitor(
        override_mb=None,
        threshold_pct=None,
        poll_s=1.0,
        footprint=lambda: 3 * GiB,
        read=lambda: reading,
    )
    snap = monitor.latest
    assert snap.total_bytes == snap.real_total_bytes == 16 * GiB
    assert snap.available_bytes == snap.real_available_bytes == 189859 * 16384
    assert snap.runners_bytes == 3 * GiB
    assert snap.threshold_pct == 70.0
    assert snap.pressure_pct == pytest.approx(100 * (1 - 189859 * 16384 / (16 * GiB)))
    assert snap.details["compressed"] == 436782 * 16384


def test_override_counts_only_our_runners_as_used() -> None:
    reading = recorded(VM_STAT_INTEL_IDLE, INTEL_IDLE_TOTAL)  # 27.5 GiB really available
    monitor = MemoryMonitor(
        override_mb=8192,
        threshold_pct=None,
        poll_s=1.0,
        footprint=lambda: 6 * GiB,
        read=lambda: reading,
    )
    snap = monitor.latest
    assert snap.total_bytes == 8192 * MiB
    assert snap.available_bytes == 2 * GiB  # total - runners, below the real figure
    assert snap.real_available_bytes == reading.available_bytes
    assert snap.override_mb == 8192
    assert snap.pressure_pct == 75.0
    assert snap.threshold_pct == 70.0  # the tier of the believed 8 GiB
    assert "override 8192 MB" in snap.describe()


def test_override_is_never_more_optimistic_than_the_real_machine() -> None:
    reading = recorded(VM_STAT_APPLE_SILICON, APPLE_SILICON_TOTAL)  # 2.9 GiB really available
    monitor = MemoryMonitor(
        override_mb=8192,
        threshold_pct=None,
        poll_s=1.0,
        footprint=lambda: 1 * GiB,
        read=lambda: reading,
    )
    assert monitor.latest.available_bytes == reading.available_bytes  # not 8 - 1 = 7 GiB


def test_fits_needs_room_below_the_threshold_and_in_available() -> None:
    reading = recorded(VM_STAT_INTEL_IDLE, INTEL_IDLE_TOTAL)
    snap = MemoryMonitor(
        override_mb=None,
        threshold_pct=None,
        poll_s=1.0,
        footprint=no_runners,
        read=lambda: reading,
    ).latest
    assert snap.threshold_pct == 75.0
    room_to_threshold = 24 * GiB - snap.used_bytes  # 75 % of 32 GiB
    assert snap.fits(room_to_threshold)
    assert not snap.fits(room_to_threshold + 1)  # still within available: the threshold binds
    assert room_to_threshold + 1 < snap.available_bytes

    everything = MemoryMonitor(
        override_mb=None,
        threshold_pct=100.0,
        poll_s=1.0,
        footprint=no_runners,
        read=lambda: reading,
    ).latest
    assert everything.fits(everything.available_bytes)
    assert not everything.fits(everything.available_bytes + 1)


def test_monitor_refuses_a_threshold_outside_0_to_100() -> None:
    reading = recorded(VM_STAT_INTEL_IDLE, INTEL_IDLE_TOTAL)
    with pytest.raises(ValueError, match="threshold"):
        MemoryMonitor(
            override_mb=None,
            threshold_pct=120.0,
            poll_s=1.0,
            footprint=no_runners,
            read=lambda: reading,
        )


def test_psutil_fallback_on_a_mac_is_logged_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # What read_system_memory returns on a Mac when vm_stat fails: no "compressed".
    reading = SystemMemory(16 * GiB, 8 * GiB, {"free": 2 * GiB, "inactive": 6 * GiB})
    monkeypatch.setattr(sys, "platform", "darwin")
    with capture_logs() as logs:
        monitor = MemoryMonitor(
            override_mb=None,
            threshold_pct=None,
            poll_s=1.0,
            footprint=no_runners,
            read=lambda: reading,
        )
        monitor.sample()
    assert [e["event"] for e in logs] == ["memory_vm_stat_unavailable"]


# --- the gate and the loop ---------------------------------------------------


def growing_reader(start: int, step: int) -> Callable[[], SystemMemory]:
    """Available memory that grows by ``step`` on every reading (memory being released)."""
    counter = itertools.count()

    def read() -> SystemMemory:
        return SystemMemory(16 * GiB, min(16 * GiB, start + step * next(counter)))

    return read


@pytest.mark.anyio
async def test_gate_opens_when_released_memory_comes_back() -> None:
    monitor = MemoryMonitor(
        override_mb=None,
        threshold_pct=None,
        poll_s=1.0,
        footprint=no_runners,
        read=growing_reader(1 * GiB, 1 * GiB),
    )
    met, snap = await monitor.wait_for(
        lambda s: s.available_bytes >= 4 * GiB, timeout_s=5.0, interval_s=0.01
    )
    assert met
    assert snap.available_bytes >= 4 * GiB
    assert monitor.latest is snap


@pytest.mark.anyio
async def test_gate_gives_up_after_the_timeout() -> None:
    monitor = MemoryMonitor(
        override_mb=None,
        threshold_pct=None,
        poll_s=1.0,
        footprint=no_runners,
        read=growing_reader(1 * GiB, 0),
    )
    started = time.monotonic()
    met, snap = await monitor.wait_for(
        lambda s: s.available_bytes >= 4 * GiB, timeout_s=0.3, interval_s=0.05
    )
    elapsed = time.monotonic() - started
    assert not met
    assert snap.available_bytes == 1 * GiB
    assert 0.3 <= elapsed < 2.0


@pytest.mark.anyio
async def test_pressure_crossing_is_logged_once_each_way() -> None:
    calm = SystemMemory(16 * GiB, 10 * GiB)  # 37.5 % used, threshold 70 %
    tight = recorded(VM_STAT_APPLE_SILICON, APPLE_SILICON_TOTAL)  # 82 % used
    readings = [calm, tight, tight, tight, calm, calm]
    calls = 0

    def read() -> SystemMemory:
        nonlocal calls
        reading = readings[min(calls, len(readings) - 1)]
        calls += 1
        return reading

    with capture_logs() as logs:
        monitor = MemoryMonitor(
            override_mb=None, threshold_pct=None, poll_s=0.01, footprint=no_runners, read=read
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(monitor.run)
            with anyio.fail_after(5):
                while calls < len(readings) + 2:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()

    events = [e for e in logs if e["event"].startswith("memory_pressure")]
    assert [e["event"] for e in events] == ["memory_pressure_high", "memory_pressure_normal"]
    high = events[0]
    assert high["log_level"] == "warning"
    assert high["pressure_pct"] == pytest.approx(81.9, abs=0.1)
    assert high["threshold_pct"] == 70.0
    assert high["available_bytes"] == tight.available_bytes
    assert not monitor.under_pressure


@pytest.mark.anyio
async def test_failed_reading_keeps_the_previous_snapshot_and_the_loop() -> None:
    good = SystemMemory(16 * GiB, 10 * GiB)
    calls = 0

    def read() -> SystemMemory:
        nonlocal calls
        calls += 1
        if 2 <= calls <= 4:
            raise OSError("vm_stat vanished")
        return good

    with capture_logs() as logs:
        monitor = MemoryMonitor(
            override_mb=None, threshold_pct=None, poll_s=0.01, footprint=no_runners, read=read
        )
        first = monitor.latest
        async with anyio.create_task_group() as tg:
            tg.start_soon(monitor.run)
            with anyio.fail_after(5):
                while calls < 3:
                    await anyio.sleep(0.005)
            assert monitor.latest is first  # a failed reading keeps what we had
            with anyio.fail_after(5):
                while calls < 6:
                    await anyio.sleep(0.005)
            tg.cancel_scope.cancel()

    assert monitor.latest is not first
    events = [e["event"] for e in logs]
    assert events.count("memory_reading_failed") == 1
    assert events.count("memory_reading_recovered") == 1


@pytest.mark.anyio
async def test_async_sample_reads_in_a_worker_thread() -> None:
    readers: list[threading.Thread] = []

    def read() -> SystemMemory:
        readers.append(threading.current_thread())
        return SystemMemory(16 * GiB, 10 * GiB)

    monitor = MemoryMonitor(
        override_mb=None, threshold_pct=None, poll_s=1.0, footprint=no_runners, read=read
    )
    snap = await monitor.sample_async()
    assert monitor.latest is snap
    assert readers[0] is threading.main_thread()  # __init__ samples synchronously
    assert readers[1] is not threading.main_thread()

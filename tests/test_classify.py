"""Death classes: which kind of exit a runner's ExitInfo describes.

The stderr lines are recorded real output pasted verbatim, each with its
source; the few built from MLX's own source (messages no public thread has
recorded yet) say so.
"""

from __future__ import annotations

import pytest

from ipc.messages import CauseClass, ExitAudit, ExitInfo
from supervisor.runners.exits import classify_exit, ended_by_failed_step

LIBCXX_ABORT = "libc++abi: terminating due to uncaught exception of type std::runtime_error: "

# https://github.com/ml-explore/mlx/pull/479 (mx.eye(28000) on an 8 GB Mac)
METAL_OOM = (
    LIBCXX_ABORT + "[METAL] Command buffer execution failed: Insufficient Memory "
    "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)"
)
# ADR-016 (shared/reference/001): a 49.9 GB vision model on a 68.7 GB Mac, older MLX
METAL_OOM_OLD = ["[METAL] Command buffer execution failed: Insufficient Memory", "Abort trap: 6"]
# https://github.com/jundot/omlx/issues/2029 (newer MLX ends the message with a period)
GPU_TIMEOUT = (
    LIBCXX_ABORT + "[METAL] Command buffer execution failed: Caused GPU Timeout Error "
    "(00000002:kIOGPUCommandBufferCallbackErrorTimeout)."
)
# https://github.com/lyogavin/airllm/issues/367
GPU_TIMEOUT_ZSH = [
    LIBCXX_ABORT + "[METAL] Command buffer execution failed: Caused GPU Timeout Error "
    "(00000002:kIOGPUCommandBufferCallbackErrorTimeout)",
    "zsh: abort      python3 ./test.py",
]
# https://github.com/jundot/omlx/issues/1387 (as the reporter wrapped it)
GPU_PREEMPTED = [
    "libc++abi: terminating due to uncaught exception of type std::runtime_error:",
    "[METAL] Command buffer execution failed: Impacting Interactivity",
    "(0000000e: kIOGPUCommandBufferCallbackErrorImpactingInteractivity)",
]
# https://github.com/ollama/ollama/issues/9567 (ggml's CUDA backend)
CUDA_OOM_GGML = [
    "CUDA error: out of memory",
    "  current device: 2, in function alloc at "
    "//ml/backend/ggml/ggml/src/ggml-cuda/ggml-cuda.cu:445",
    "  cuMemCreate(&handle, reserve_size, &prop, 0)",
]
# https://github.com/apache/mxnet/issues/5341 (its title)
CUDA_OOM_MALLOC = "cudaMalloc failed: out of memory"
# Built from MLX's source, not recorded: check_cuda_error() in
# mlx/backend/cuda/utils.cpp formats "{call} failed: {cudaGetErrorString}" and
# allocator.cpp calls cudaMallocAsync(&data, size, stream).
CUDA_OOM_MLX = "RuntimeError: cudaMallocAsync(&data, size, stream) failed: out of memory"
# https://github.com/ml-explore/mlx/issues/4276 (older MLX: the ring aborts)
RING_ABORT = [
    "[ring] Receiving from socket 51 failed with errno 14",
    "[ring] Receiving from socket 51 failed with errno 14",
    "[ring] Too many send/recv errors. Aborting...",
]
# Built from MLX's source, not recorded: mlx/distributed/ring/ring.cpp now
# fails the pending collectives with this runtime_error.
RING_LOST = [
    "[ring] Socket 12 was closed by the peer",
    "[ring] Too many send/recv errors. Failing pending tasks...",
    "RuntimeError: [ring] connection to a peer was lost",
]


def died(
    *,
    signal: str | None = None,
    code: int | None = None,
    tail: list[str] | None = None,
    cause: str = "",
    audit: ExitAudit | None = None,
) -> ExitInfo:
    if not cause:
        cause = f"killed by {signal}" if signal else f"exited with code {code}"
    return ExitInfo(code=code, signal=signal, cause=cause, stderr_tail=tail or [], audit=audit)


@pytest.mark.parametrize(
    ("tail", "expected"),
    [
        ([METAL_OOM], "metal_oom"),
        (METAL_OOM_OLD, "metal_oom"),
        ([GPU_TIMEOUT], "gpu_timeout"),
        (GPU_TIMEOUT_ZSH, "gpu_timeout"),
        (GPU_PREEMPTED, "gpu_timeout"),
        (CUDA_OOM_GGML, "cuda_oom"),
        ([CUDA_OOM_MALLOC], "cuda_oom"),
        ([CUDA_OOM_MLX], "cuda_oom"),
        (RING_ABORT, "peer_lost"),
        (RING_LOST, "peer_lost"),
    ],
)
def test_recorded_fatal_message_names_the_death(tail: list[str], expected: CauseClass) -> None:
    assert (
        classify_exit(died(signal="SIGABRT", tail=tail), requested=False, under_pressure=False)
        == expected
    )


def test_message_in_the_cause_counts_too() -> None:
    exit_info = died(code=1, cause=f"exited with code 1: {METAL_OOM}")
    assert classify_exit(exit_info, requested=False, under_pressure=False) == "metal_oom"


def test_gpu_error_wins_over_the_peer_loss_it_caused() -> None:
    tail = [*RING_ABORT, GPU_TIMEOUT]
    assert (
        classify_exit(died(signal="SIGABRT", tail=tail), requested=False, under_pressure=False)
        == "gpu_timeout"
    )


def test_requested_exit_is_requested_whatever_it_says() -> None:
    exit_info = died(signal="SIGKILL", tail=[METAL_OOM])
    assert classify_exit(exit_info, requested=True, under_pressure=True) == "requested"


def test_runner_audit_memory_guard_is_memory_guard() -> None:
    audit = ExitAudit(
        cause="MemoryGuardError: remaining memory 3.2 GB is below 5.0 GB",
        active_bytes=7 << 30,
        peak_bytes=8 << 30,
        cause_class="memory_guard",
    )
    exit_info = died(code=1, audit=audit, tail=[GPU_TIMEOUT])
    assert classify_exit(exit_info, requested=False, under_pressure=False) == "memory_guard"


def test_exit_status_73_is_memory_guard() -> None:
    assert classify_exit(died(code=73), requested=False, under_pressure=False) == "memory_guard"


@pytest.mark.parametrize("signal", ["SIGSEGV", "SIGBUS"])
def test_crash_signal_is_segfault(signal: str) -> None:
    assert classify_exit(died(signal=signal), requested=False, under_pressure=True) == "segfault"


def test_sigkill_under_pressure_is_oom_killed() -> None:
    assert (
        classify_exit(died(signal="SIGKILL"), requested=False, under_pressure=True) == "oom_killed"
    )


def test_sigkill_without_pressure_is_unknown() -> None:
    assert classify_exit(died(signal="SIGKILL"), requested=False, under_pressure=False) == "unknown"


def test_plain_failure_is_unknown() -> None:
    exit_info = died(code=1, tail=["Traceback (most recent call last):", "KeyError: 'model'"])
    assert classify_exit(exit_info, requested=False, under_pressure=True) == "unknown"


def test_metal_message_case_matters() -> None:
    # a person's sentence is not the driver's error
    exit_info = died(code=1, tail=["warning: insufficient memory for the cache, trimming"])
    assert classify_exit(exit_info, requested=False, under_pressure=False) == "unknown"


def test_a_group_step_that_raised_is_known_by_its_class_not_its_wording() -> None:
    # The rank's exit audit says the step raised: the request that ran it is
    # not retried (it would end the restarted group again). Words alone,
    # whoever wrote them, decide nothing.
    failed = ExitInfo(74, None, "rank 1: step failed: ValueError: bad shape",
                      audit=ExitAudit("step failed: ValueError: bad shape", 0, 0,
                                      cause_class="step_failed"))  # fmt: skip
    assert classify_exit(failed, requested=False, under_pressure=False) == "step_failed"
    assert ended_by_failed_step(failed)
    worded = ExitInfo(1, None, "RuntimeError: the prefill step failed to allocate")
    assert not ended_by_failed_step(worded)
    lost = ExitInfo(74, None, "rank 0: peer lost", audit=ExitAudit("peer lost", 0, 0,
                                                                  cause_class="peer_lost"))
    assert not ended_by_failed_step(lost)

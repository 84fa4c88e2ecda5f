"""What a runner's exit was: how it is described, and what kind of death.

:func:`describe_exit` turns a reaped runner's return code and last words into
an :class:`~ipc.messages.ExitInfo`; :func:`classify_exit` reads one (signal,
exit code, the runner's exit audit, the last lines of its stderr) and names a
:data:`~ipc.messages.CauseClass`. Memory classes (``metal_oom``,
``cuda_oom``, ``memory_guard``, ``oom_killed``) send the restart through
admission first.

The fatal messages come from MLX itself (``mlx/backend/metal/device.cpp``,
``mlx/backend/cuda/utils.cpp``, ``mlx/distributed/ring/ring.cpp``,
``mlx/distributed/jaccl``) and from the IOGPU driver's error names, which
Metal passes through verbatim. They are machine-written, so they are matched
case-sensitively.
"""

from __future__ import annotations

import re
import signal

from ipc.messages import CauseClass, ExitAudit, ExitInfo
from supervisor.system import signal_name

MEMORY_GUARD_EXIT_CODE = 73
"""Exit status the runner uses when its memory guard stopped a load."""

FATAL_MESSAGES: tuple[tuple[re.Pattern[str], CauseClass], ...] = (
    # Metal: the GPU could not get memory for a command buffer. Old MLX
    # printed the description alone, newer adds the IOGPU code.
    (re.compile(r"kIOGPUCommandBufferCallbackErrorOutOfMemory"), "metal_oom"),
    (re.compile(r"\[METAL\] Command buffer execution failed: Insufficient Memory"), "metal_oom"),
    # Metal: a command buffer ran too long. "Impacting Interactivity" is the
    # OS preempting a buffer that monopolised the GPU; same cause, same cure
    # (smaller prefill steps), so the same class.
    (re.compile(r"kIOGPUCommandBufferCallbackErrorTimeout"), "gpu_timeout"),
    (re.compile(r"kIOGPUCommandBufferCallbackErrorImpactingInteractivity"), "gpu_timeout"),
    (
        re.compile(r"\[METAL\] Command buffer execution failed: Caused GPU Timeout Error"),
        "gpu_timeout",
    ),
    # CUDA: MLX reports "<call> failed: <cudaGetErrorString>", which is
    # "out of memory" for cudaErrorMemoryAllocation / CUDA_ERROR_OUT_OF_MEMORY.
    (re.compile(r"cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY"), "cuda_oom"),
    (re.compile(r"CUDA error: out of memory|CUDA out of memory"), "cuda_oom"),
    (re.compile(r"\[CUDA\].*out of memory"), "cuda_oom"),
    (re.compile(r"\bcu[A-Za-z]*(?:\(.*\))? failed: out of memory"), "cuda_oom"),
    # A rank of a distributed group lost its peer. Checked last: when a
    # rank dies of a GPU error its peers see the socket close, so a tail with
    # both names the GPU error as the cause.
    (re.compile(r"\[ring\] connection to a peer was lost"), "peer_lost"),
    (re.compile(r"\[ring\] Too many send/recv errors"), "peer_lost"),
    (re.compile(r"\[ring\] Socket \d+ was closed by the peer"), "peer_lost"),
    # JACCL posts fail once the RDMA queue pair went to the error state,
    # which is what a vanished peer does to it.
    (re.compile(r"\[jaccl\] (?:Send|Recv) failed with error code"), "peer_lost"),
    (re.compile(r"NCCL error .*remote process exited or there was a network error"), "peer_lost"),
)
"""Pattern -> class, in priority order: the first pattern found anywhere in
the stderr tail or the cause wins."""

CRASH_SIGNALS = frozenset({"SIGSEGV", "SIGBUS"})


def describe_exit(
    returncode: int,
    audit: ExitAudit | None,
    stderr_tail: list[str],
    kill_cause: str | None = None,
) -> ExitInfo:
    """Build the ExitInfo of a reaped runner from its return code and last words.

    ``kill_cause`` is the supervisor's reason for killing it (a stall), which
    wins over the runner's own account.
    """
    tail = list(stderr_tail)
    if returncode < 0:
        name = signal_name(-returncode)
        cause = f"killed by {name}"
        if kill_cause:
            cause = f"{kill_cause} (killed by {name})"
        elif audit is not None:
            cause = f"{audit.cause} (then killed by {name})"
        try:
            description = signal.strsignal(-returncode)
        except ValueError:
            description = None
        return ExitInfo(None, name, cause, description, tail, audit=audit)
    if kill_cause:
        cause = f"{kill_cause} (exited with code {returncode})"
    elif audit is not None:
        cause = audit.cause
    else:
        cause = f"exited with code {returncode}"
        if returncode != 0 and tail:
            cause += f": {tail[-1][:200]}"
    return ExitInfo(returncode, None, cause, None, tail, audit=audit)


def ended_by_failed_step(exit_info: ExitInfo) -> bool:
    """Whether a rank (the first of its group to die) exited because a step
    raised there, as its exit audit says: the request that ran the step would
    end the restarted group again, so it is not retried."""
    audit = exit_info.audit
    return audit is not None and audit.cause_class == "step_failed"


def classify_exit(exit_info: ExitInfo, *, requested: bool, under_pressure: bool) -> CauseClass:
    """Name the kind of death ``exit_info`` describes.

    In order: an exit the supervisor asked for (unload, expiry, eviction,
    shutdown) is ``requested``; the runner's own memory guard (its exit audit
    says so, or exit status 73) is ``memory_guard``; a known fatal message in
    the stderr tail or the cause names its class (:data:`FATAL_MESSAGES`);
    SIGSEGV or SIGBUS is ``segfault``; SIGKILL while the system was under
    memory pressure is ``oom_killed``; anything else is ``unknown``.

    Args:
        exit_info: how the runner ended.
        requested: the supervisor asked it to stop.
        under_pressure: memory was past the threshold when it died. Pass
            False for a SIGKILL the supervisor sent itself (a stall), which
            is not an out-of-memory kill.
    """
    if requested:
        return "requested"
    audit = exit_info.audit
    if (audit is not None and audit.cause_class == "memory_guard") or (
        exit_info.code == MEMORY_GUARD_EXIT_CODE
    ):
        return "memory_guard"
    if ended_by_failed_step(exit_info):
        return "step_failed"
    text = "\n".join([exit_info.cause, *exit_info.stderr_tail])
    for pattern, cause_class in FATAL_MESSAGES:
        if pattern.search(text):
            return cause_class
    if exit_info.signal in CRASH_SIGNALS:
        return "segfault"
    if exit_info.signal == "SIGKILL" and under_pressure:
        return "oom_killed"
    return "unknown"

"""What the ranks of a sharded model hold on each machine, and whether a machine
has room for them."""

from __future__ import annotations

import msgspec

from supervisor.memory.estimate import ALLOCATOR_SHARE_OF_WEIGHTS, Estimate
from supervisor.memory.monitor import default_guard_bytes
from supervisor.units import format_bytes

__all__ = ["group_estimate", "room_problem"]


def room_problem(host: str, total: int, available: int, need: int, guard: int | None) -> str | None:
    """Why a machine cannot take a rank that needs ``need`` bytes, or None:
    it must keep its guard free (``guard``, else the daemon's default)."""
    guard = default_guard_bytes(total, total) if guard is None else guard
    if need <= available - guard:
        return None
    return (f"{host} has {format_bytes(available)} available and keeps {format_bytes(guard)} "
            f"free: not the {format_bytes(need)} one rank needs")  # fmt: skip


def group_estimate(estimate: Estimate, ranks: int, local: int | None = None) -> Estimate:
    """What the ``local`` ranks (default: all) of a ``ranks``-process group
    hold on this machine, for a model the estimate is for: the weights and
    the KV cache are split between the ranks, and so is the overhead that
    grows with the weights; each has its own activations and the rest of the
    overhead (runtime, tokenizer). One rank holds about
    ``(weights + kv + weights' overhead) / ranks + activation + overhead``.
    The headroom stays the same share of all but the runtime."""
    local = ranks if local is None else local
    if ranks <= 1:
        return estimate
    weights_share = min(round(ALLOCATOR_SHARE_OF_WEIGHTS * estimate.weights_bytes),
                        estimate.overhead_bytes)  # fmt: skip
    split = estimate.weights_bytes + estimate.kv_cache_bytes + estimate.vision_bytes
    activation = estimate.activation_bytes * local
    overhead = (estimate.overhead_bytes - weights_share) * local + weights_share * local // ranks
    runtime = estimate.runtime_bytes * local
    total = split * local // ranks + activation + overhead
    model_before = estimate.total_bytes - estimate.runtime_bytes
    headroom = estimate.headroom_bytes * (total - runtime) // model_before if model_before else 0
    return msgspec.structs.replace(
        estimate,
        weights_bytes=estimate.weights_bytes * local // ranks,
        kv_cache_bytes=estimate.kv_cache_bytes * local // ranks,
        vision_bytes=estimate.vision_bytes * local // ranks,
        activation_bytes=activation,
        overhead_bytes=overhead,
        total_bytes=total,
        runtime_bytes=runtime,
        headroom_bytes=headroom,
    )

"""mlx-lm's Muse Spark model on machines without Metal.

mlx-lm 0.32's ``muse_spark`` text model calls seven fused Metal kernels
(``mlx_lm.kernels``: the q/k norms with RoPE, the gated attention norm, the
expert routing and combine, the residual norm-add-norm). On any other backend
(Linux, CPU or CUDA) those calls raise "No Metal back-end". :func:`install`
puts in their place, inside ``mlx_lm.models.muse_spark`` only, the same
arithmetic written with plain mlx ops (fp32 math, rounded once to the
kernel's output type, as each kernel's docstring states): slower, but it
runs everywhere. On Metal nothing changes.

Whoever compares tokens with the runner installs the same (the tests' and
the bench's in-process mlx-lm, the bench's mlx_lm.server through
``python -c "import runner.muse_spark_cpu as m; m.install(); ..."``), so both
sides compute alike.
"""

from __future__ import annotations

import math

import mlx.core as mx

__all__ = ["install", "needed"]


def needed() -> bool:
    """Whether this machine lacks the Metal back-end muse_spark's kernels need."""
    return not mx.metal.is_available()


def install() -> None:
    """Use the portable ops in ``mlx_lm.models.muse_spark`` when Metal is
    missing (idempotent; a no-op on Metal)."""
    if not needed():
        return
    from mlx_lm.models import muse_spark

    muse_spark.qk_norm = qk_norm  # type: ignore[attr-defined]
    muse_spark.qk_norm_rope = qk_norm_rope  # type: ignore[attr-defined]
    muse_spark.rms_norm_sigmoid_gate = rms_norm_sigmoid_gate  # type: ignore[attr-defined]
    muse_spark.expert_routing = expert_routing  # type: ignore[attr-defined]
    muse_spark.post_expert_norm_combine = post_expert_norm_combine  # type: ignore[attr-defined]
    muse_spark.norm_add_norm = norm_add_norm  # type: ignore[attr-defined]
    muse_spark.pre_norm = pre_norm  # type: ignore[attr-defined]


def _rms(x: mx.array, eps: float) -> mx.array:
    """x (fp32) times its reciprocal root mean square over the last axis."""
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)


def _heads(
    qkvg: mx.array, *, n_heads: int, n_kv_heads: int, head_dim: int, eps: float,
    query_scale: float,
) -> tuple[mx.array, mx.array]:  # fmt: skip
    """The normed q (scaled) and k heads of each qkvg row, in qkvg's dtype."""
    dtype = qkvg.dtype
    rows = qkvg.shape[:-1]
    both = qkvg[..., : (n_heads + n_kv_heads) * head_dim]
    both = both.reshape(*rows, n_heads + n_kv_heads, head_dim).astype(mx.float32)
    normed = _rms(both, eps).astype(dtype)
    q = (normed[..., :n_heads, :].astype(mx.float32) * query_scale).astype(dtype)
    return q, normed[..., n_heads:, :]


def qk_norm(
    qkvg: mx.array, *, n_heads: int, n_kv_heads: int, head_dim: int, eps: float,
    query_scale: float,
) -> list[mx.array]:  # fmt: skip
    q, k = _heads(qkvg, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, eps=eps,
                  query_scale=query_scale)  # fmt: skip
    return [q, k]


def _rope(x: mx.array, positions: mx.array, base: float) -> mx.array:
    """Rotate neighbour pairs (2i, 2i + 1) of x (..., L, H, D) at positions (..., L)."""
    dim = x.shape[-1]
    exponent = -(mx.arange(dim // 2, dtype=mx.float32) / (dim // 2)) * math.log2(base)
    inv_freq = mx.power(mx.array(2.0, dtype=mx.float32), exponent)
    theta = positions.astype(mx.float32)[..., None, None] * inv_freq
    cos, sin = mx.cos(theta), mx.sin(theta)
    v = x.astype(mx.float32)
    even, odd = v[..., 0::2], v[..., 1::2]
    out = mx.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def qk_norm_rope(
    qkvg: mx.array, *, n_heads: int, n_kv_heads: int, head_dim: int, eps: float,
    query_scale: float, rope_base: float, offset: int | mx.array,
) -> list[mx.array]:  # fmt: skip
    q, k = _heads(qkvg, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, eps=eps,
                  query_scale=query_scale)  # fmt: skip
    length = qkvg.shape[-2]
    positions = mx.arange(length)
    if isinstance(offset, mx.array) and offset.size > 1:
        positions = positions[None] + offset.reshape(-1, 1)
    else:
        positions = positions + offset
    return [_rope(q, positions, rope_base), _rope(k, positions, rope_base)]


def rms_norm_sigmoid_gate(x: mx.array, gate: mx.array, *, eps: float) -> mx.array:
    """rms_norm(x) * sigmoid(gate) per head; x (B, H, L, D), gate and result (B, L, H * D)."""
    b, h, length, d = x.shape
    normed = _rms(x.astype(mx.float32), eps).transpose(0, 2, 1, 3).reshape(b, length, h * d)
    return (normed * mx.sigmoid(gate.astype(mx.float32))).astype(x.dtype)


def expert_routing(
    logits: mx.array, expert_bias: mx.array, *, top_k: int, multiplier: float,
    score_eps: float, route_scale: float,
) -> list[mx.array]:  # fmt: skip
    """The top_k experts by biased sigmoid score (ties to the lower index) and
    their unbiased scores, normalised to sum to route_scale."""
    scores = mx.sigmoid(logits.astype(mx.float32) * multiplier)
    biased = scores + expert_bias.astype(mx.float32)
    # A stable sort of the negated scores puts ties in index order.
    inds = mx.argsort(-biased, axis=-1)[..., :top_k].astype(mx.uint32)
    weights = mx.take_along_axis(scores, inds.astype(mx.int32), axis=-1)
    weights = weights / (mx.sum(weights, axis=-1, keepdims=True) + score_eps) * route_scale
    return [inds, weights]


def post_expert_norm_combine(
    experts: mx.array, weights: mx.array, *, norm_weight: mx.array, eps: float
) -> mx.array:
    """Norm each expert output (norm_weight scales its input), then their weighted sum."""
    dtype = experts.dtype
    scaled = experts.astype(mx.float32) * norm_weight.astype(mx.float32)
    normed = _rms(scaled, eps)
    w = weights.astype(dtype).astype(mx.float32)[..., None]
    return mx.sum(normed * w, axis=-2).astype(dtype)


def norm_add_norm(
    branch: mx.array, stream: mx.array, *, alpha: mx.array, beta: mx.array,
    post_weight: mx.array | None, post_eps: float, next_norm: object | None,
) -> tuple[mx.array, mx.array | None]:  # fmt: skip
    """stream * alpha + rms_norm(branch) * beta (fp32), and that sum pre-normed
    with ``next_norm`` (None without it)."""
    dtype = branch.dtype
    v = branch.astype(mx.float32)
    if post_weight is not None:
        v = (post_weight.astype(dtype).astype(mx.float32) * v).astype(dtype).astype(mx.float32)
    normed = _rms(v, post_eps).astype(dtype).astype(mx.float32)
    new_stream = alpha.astype(mx.float32) * stream.astype(mx.float32) + beta * normed
    if next_norm is None:
        return new_stream, None
    return new_stream, _pre(new_stream, next_norm, dtype)


def _pre(stream: mx.array, norm: object, dtype: mx.Dtype) -> mx.array:
    weight: mx.array = norm.weight  # type: ignore[attr-defined]
    eps: float = norm.eps  # type: ignore[attr-defined]
    return (_rms(stream, eps) * weight.astype(mx.float32)).astype(dtype)


def pre_norm(stream: mx.array, norm: object, *, dtype: mx.Dtype) -> mx.array:
    return _pre(stream.astype(mx.float32), norm, dtype)

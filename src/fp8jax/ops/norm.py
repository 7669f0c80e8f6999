"""LayerNorm and RMSNorm, computed in f32, with their backward from saved row statistics.

The forward returns the per-row statistics (mean and reciprocal standard
deviation) so fused ops can save them for the backward instead of a
normalized copy of the activations.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp

from fp8jax.ops import _partitioning
from fp8jax.quantize import check_high_precision

NORM_TYPES = ("layernorm", "rmsnorm")


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """Static settings of a normalization."""

    norm_type: str = "layernorm"
    zero_centered_gamma: bool = False
    epsilon: float = 1e-6


def check_norm_args(x, gamma, beta, config: NormConfig) -> None:
    """Raises a named TypeError/ValueError for anything the norm cannot take."""
    check_high_precision("x", x)
    if config.norm_type not in NORM_TYPES:
        raise ValueError(f"norm_type must be one of {NORM_TYPES}, got {config.norm_type!r}.")
    eps = config.epsilon
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps > 0:
        raise ValueError(f"epsilon must be a number > 0, got {eps!r}.")
    if x.ndim < 1:
        raise ValueError("x must have at least one axis (the hidden axis), got a scalar.")
    hidden = x.shape[-1]
    check_high_precision("gamma", gamma)
    if tuple(gamma.shape) != (hidden,):
        raise ValueError(
            f"gamma must have shape ({hidden},) to match x's hidden size, got {tuple(gamma.shape)}."
        )
    if beta is not None:
        if config.norm_type == "rmsnorm":
            raise ValueError("rmsnorm has no beta (it does not re-centre); pass beta=None.")
        check_high_precision("beta", beta)
        if tuple(beta.shape) != (hidden,):
            raise ValueError(
                f"beta must have shape ({hidden},) to match x's hidden size, "
                f"got {tuple(beta.shape)}."
            )


def _per_feature(v, ndim: int) -> jax.Array:
    """``(hidden,)`` as f32 ``(1, ..., 1, hidden)``: explicit, not rank promotion."""
    return _partitioning.broadcastable(v.astype(jnp.float32), ndim)


def effective_gamma(gamma, config: NormConfig, ndim: int) -> jax.Array:
    gamma = _per_feature(gamma, ndim)
    # Zero-centred gamma stores gamma - 1, so weight decay pulls it towards 1.
    return gamma + jnp.float32(1) if config.zero_centered_gamma else gamma


def normalize(x, gamma, beta, config: NormConfig):
    """Returns ``(y, mean, rstd)``: the f32 normalized output and per-row statistics.

    ``mean`` is None for rmsnorm. ``y = (x - mean) * rstd * gamma + beta``.
    """
    beta = None if beta is None else _per_feature(beta, x.ndim)
    return normalize_rows(
        x.astype(jnp.float32), effective_gamma(gamma, config, x.ndim), beta,
        config.norm_type == "layernorm", config.epsilon,
    )  # fmt: skip


def _row_mean(v, width: int | None):
    """Mean over the last axis, of its first ``width`` entries (the rest are zeros)."""
    if width is None:
        return jnp.mean(v, axis=-1, keepdims=True)
    return jnp.sum(v, axis=-1, keepdims=True) / jnp.float32(width)


def normalize_rows(x, gamma, beta, centred: bool, epsilon: float, width: int | None = None):
    """:func:`normalize`'s arithmetic on f32 rows: ``(y, mean, rstd)``, ``mean`` None uncentred.

    ``gamma`` (effective) and ``beta`` (or None) are f32 and broadcast
    against ``x``. The forward kernel (:mod:`fp8jax.ops.norm_forward`) runs
    the same code on a row at a time. ``width``: the row's true length where
    the kernel pads it with zeros to a power of two (None: all of it); ``x``,
    ``gamma`` and ``beta`` are zero past it, and so is ``y``.
    """
    if centred:
        mean = _row_mean(x, width)
        centred_x = x - mean
        if width is not None:
            columns = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
            centred_x = jnp.where(columns < width, centred_x, 0.0)
    else:
        mean, centred_x = None, x
    rstd = jax.lax.rsqrt(_row_mean(centred_x * centred_x, width) + epsilon)
    y = centred_x * rstd * gamma
    if beta is not None:
        y = y + beta
    return y, mean, rstd


def normalize_backward(dy, x, mean, rstd, gamma, beta, config: NormConfig, residual=None):
    """Gradients ``(dx, dgamma, dbeta)`` of :func:`normalize` from its saved statistics.

    ``residual``: a gradient added to ``dx`` in f32, before its one rounding
    to ``x.dtype`` (a pre-norm residual's, where the norm's input also feeds it).
    """
    dy = dy.astype(jnp.float32)
    # Without the barrier XLA recomputes the row mean from x inside the
    # fusion, a row reduction, which then cannot also take dgamma's column
    # sum: dy * xhat went to HBM in f32 (16384 x 4096: 256 MB written and read
    # back, in a deviceless H200 compile). From the saved statistics the
    # products fuse into the column reduction.
    mean, rstd = jax.lax.optimization_barrier((mean, rstd))
    gamma_32 = effective_gamma(gamma, config, x.ndim)
    dx, dy_xhat = row_gradients(dy, x.astype(jnp.float32), mean, rstd, gamma_32)
    rows = tuple(range(x.ndim - 1))
    dgamma = jnp.sum(dy_xhat, axis=rows).astype(gamma.dtype)
    dbeta = None if beta is None else jnp.sum(dy, axis=rows).astype(beta.dtype)
    if residual is not None:
        dx = dx + residual.astype(jnp.float32)
    return dx.astype(x.dtype), dgamma, dbeta


def row_gradients(dy, x, mean, rstd, gamma, width: int | None = None):
    """``(dx, dy * xhat)`` in f32 from f32 ``dy``, ``x`` and the saved row statistics.

    ``gamma`` is the effective scale, broadcastable to ``x``; ``mean`` is None
    for rmsnorm. Row by row, so the one-pass kernel
    (:mod:`fp8jax.ops.norm_backward`) computes the same from its blocks.
    ``width``: as for :func:`normalize_rows`; with ``dy`` and ``gamma`` zero
    past it, both products are zero there and ``dx`` there is unused.
    """
    xhat = (x - mean) * rstd if mean is not None else x * rstd
    dxhat = dy * gamma
    projection = xhat * _row_mean(dxhat * xhat, width)
    if mean is not None:
        dx = rstd * (dxhat - _row_mean(dxhat, width) - projection)
    else:
        dx = rstd * (dxhat - projection)
    return dx, dy * xhat


def layernorm(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None = None,
    *,
    norm_type: str = "layernorm",
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
) -> jax.Array:
    """LayerNorm or RMSNorm over the last axis, computed in f32, returned in ``x.dtype``.

    Args:
      x: activations, ``(..., hidden)``.
      gamma: scale, ``(hidden,)``.
      beta: shift, ``(hidden,)``, or None. RMSNorm takes no beta.
      norm_type: ``"layernorm"`` or ``"rmsnorm"``.
      zero_centered_gamma: if True the effective scale is ``1 + gamma``.
      epsilon: added to the variance; must be > 0.

    Returns:
      The normalized ``x``.

    Raises:
      ValueError: for an unknown norm_type, epsilon <= 0, or parameter shapes
        that do not match x's hidden size.

    Example:
      >>> import jax.numpy as jnp, fp8jax
      >>> x = jnp.array([[1.0, 2.0, 3.0, 4.0]])
      >>> y = fp8jax.layernorm(x, jnp.ones(4), jnp.zeros(4))
      >>> [round(v, 3) for v in y[0].tolist()]
      [-1.342, -0.447, 0.447, 1.342]
    """
    config = NormConfig(norm_type, zero_centered_gamma, epsilon)
    check_norm_args(x, gamma, beta, config)
    return norm(x, gamma, beta, config)


def norm(x, gamma, beta, config: NormConfig) -> jax.Array:
    """:func:`layernorm` on checked arguments, in ``x.dtype``.

    Its backward keeps ``x`` and the f32 row statistics only.
    """
    return _layernorm(x, gamma, beta, _NormOp(config, _partitioning.input_types(x, gamma, beta)))


@dataclasses.dataclass(frozen=True)
class _NormOp:
    norm: NormConfig
    inputs: tuple[_partitioning.InputType, ...]  # what each cotangent must match


# A custom_vjp so the backward keeps only x (in its own dtype) and the f32 row
# statistics. Plain autodiff of the f32 computation kept two f32 copies of x's
# size per norm: in a scanned GPT on the H200 they were stacked for all layers.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layernorm(x, gamma, beta, op: _NormOp):
    return normalize(x, gamma, beta, op.norm)[0].astype(x.dtype)


def _layernorm_fwd(x, gamma, beta, op: _NormOp):
    y, mean, rstd = normalize(x, gamma, beta, op.norm)
    return y.astype(x.dtype), (x, gamma, beta, mean, rstd)


def _layernorm_bwd(op: _NormOp, saved, g):
    x, gamma, beta, mean, rstd = saved
    cotangents = normalize_backward(g, x, mean, rstd, gamma, beta, op.norm)
    return _partitioning.match_cotangents(cotangents, None, op.inputs)[:3]


_layernorm.defvjp(_layernorm_fwd, _layernorm_bwd)

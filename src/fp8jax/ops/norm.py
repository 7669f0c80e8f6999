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

from fp8jax.formats import Fp8Format
from fp8jax.kernels import norm_backward, norm_forward, norm_rows
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
    # An infinite epsilon makes every rstd 0: the norm's output is beta, silently.
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 < eps < float("inf"):
        raise ValueError(
            f"epsilon must be a number > 0, got {eps!r}: a finite one, typically 1e-6 to 1e-5."
        )
    # Any truthy value would select 1 + gamma, the string "False" among them.
    if not isinstance(config.zero_centered_gamma, bool):
        raise TypeError(f"zero_centered_gamma must be a bool, got {config.zero_centered_gamma!r}.")
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
    return norm_rows.normalize_rows(
        x.astype(jnp.float32), effective_gamma(gamma, config, x.ndim), beta,
        config.norm_type == "layernorm", config.epsilon,
    )  # fmt: skip


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
    dx, dy_xhat = norm_rows.row_gradients(dy, x.astype(jnp.float32), mean, rstd, gamma_32)
    rows = tuple(range(x.ndim - 1))
    dgamma = jnp.sum(dy_xhat, axis=rows).astype(gamma.dtype)
    dbeta = None if beta is None else jnp.sum(dy, axis=rows).astype(beta.dtype)
    if residual is not None:
        dx = dx + residual.astype(jnp.float32)
    return dx.astype(x.dtype), dgamma, dbeta


def fused_normalize_backward(dy, x, mean, rstd, gamma, beta, config: NormConfig, residual=None):
    """:func:`normalize_backward` for the fused ops: in one kernel pass where it runs.

    Where :func:`fp8jax.kernels.norm_backward.decide` places the kernel, it
    reads ``dy``, ``x`` and ``residual`` once; else XLA's passes.
    """
    placement = norm_backward.decide(x)
    if not placement.kernel:
        # dx and the residual's gradient are summed in f32 and rounded once, as in the kernel.
        return normalize_backward(dy, x, mean, rstd, gamma, beta, config, residual)

    def rows(v):
        return None if v is None else v.reshape(-1, v.shape[-1])

    gamma_32 = effective_gamma(gamma, config, 2)
    dx, dgamma, dbeta = norm_backward.norm_backward(
        rows(dy), rows(x), rows(mean), rows(rstd), gamma_32, beta is not None,
        rows(residual), placement.row_axes,
    )  # fmt: skip
    dbeta = None if beta is None else dbeta.astype(beta.dtype)
    return dx.reshape(x.shape), dgamma.astype(gamma.dtype), dbeta


def _matrix_operands(x, gamma, beta, config: NormConfig):
    """``x`` as (rows, hidden), the effective gamma and beta as (1, hidden), and ``centred``."""
    centred = config.norm_type == "layernorm"
    beta = None if beta is None else beta.astype(jnp.float32).reshape(1, -1)
    return x.reshape(-1, x.shape[-1]), effective_gamma(gamma, config, 2), beta, centred


def output_maxima(x, gamma, beta, config: NormConfig, row_axes=(), residual=None):
    """The maxima of the norm's f32 output magnitude, one per kernel program's rows, alone.

    Current scaling's first pass: the kernel reads ``x`` and writes nothing
    else, and the scale from these maxima's maximum goes to
    :func:`normalize_and_cast`, which computes the same values again and
    casts them. Arguments as for :func:`normalize_and_cast`. With
    ``residual`` (shaped like ``x``) the norm is of ``x + residual`` and the
    result is ``(sum, maxima)``: the pass writes the sum, which the cast pass
    then reads, so the residual add costs no pass of its own.
    """
    matrix, gamma, beta, centred = _matrix_operands(x, gamma, beta, config)
    kwargs = {"centred": centred, "epsilon": config.epsilon, "row_axes": row_axes}
    if residual is None:
        return norm_forward.row_maxima(matrix, gamma, beta, **kwargs)
    total, maxima = norm_forward.row_maxima(matrix, gamma, beta, **kwargs,
                                            residual=residual.reshape(matrix.shape))  # fmt: skip
    return total.reshape(x.shape), maxima


def normalize_and_cast(x, gamma, beta, config: NormConfig, scale, fmt: Fp8Format, row_axes=(),
                       residual=None):  # fmt: skip
    """:func:`normalize`'s output cast to ``fmt`` at ``scale``, in one pass.

    Args:
      x: the norm's input, (..., hidden).
      gamma, beta: as for ``normalize`` (beta None for RMSNorm or none).
      config: the norm's settings.
      scale: the f32 scale of the output: delayed scaling's stored one, or
        current scaling's from :func:`output_maxima`.
      fmt: the FP8 format of the output.
      row_axes: the ``row_axes`` of :func:`fp8jax.kernels.norm_forward.decide`'s
        placement, which must be the kernel's.
      residual: None, or added to ``x`` (same shape and dtype) by the pass,
        which normalizes the sum and returns it last.

    Returns:
      ``(q, maxima, mean, rstd)``: the FP8 data in ``x``'s shape; f32 maxima
      of the f32 output's magnitude, one per kernel program's rows, whose
      maximum is its amax (of this device's rows, inside ``shard_map``); the
      statistics as ``normalize`` returns them (``mean`` None for RMSNorm);
      with ``residual``, then the sum ``x + residual`` in ``x``'s shape.
    """
    matrix, gamma, beta, centred = _matrix_operands(x, gamma, beta, config)
    rows = None if residual is None else residual.reshape(matrix.shape)
    q, *stats, maxima = norm_forward.cast_rows(
        matrix, gamma, beta, scale, fmt, centred=centred, epsilon=config.epsilon, row_axes=row_axes,
        residual=rows,
    )  # fmt: skip
    total = () if residual is None else (stats.pop().reshape(x.shape),)
    stats_shape = (*x.shape[:-1], 1)
    mean = stats.pop(0).reshape(stats_shape) if centred else None
    rstd = stats[0].reshape(stats_shape)
    return (q.reshape(x.shape), maxima, mean, rstd, *total)


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

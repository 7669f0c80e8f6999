"""The norm's row arithmetic: what the norm kernels and their XLA twins compute, row by row.

:func:`fp8jax.ops.norm.normalize` and its backward call the same functions on
whole arrays, the kernels (:mod:`fp8jax.kernels.norm_forward`,
:mod:`fp8jax.kernels.norm_backward`) on a block of rows, so that both paths
compute the same values. Plain ``jnp``, f32 in and out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_mean(v, width: int | None):
    """Mean over the last axis, of its first ``width`` entries (the rest are zeros)."""
    if width is None:
        return jnp.mean(v, axis=-1, keepdims=True)
    return jnp.sum(v, axis=-1, keepdims=True) / jnp.float32(width)


def normalize_rows(x, gamma, beta, centred: bool, epsilon: float, width: int | None = None):
    """The norm on f32 rows: ``(y, mean, rstd)``, ``mean`` None uncentred.

    ``gamma`` (effective) and ``beta`` (or None) are f32 and broadcast
    against ``x``. The forward kernel (:mod:`fp8jax.kernels.norm_forward`) runs
    the same code on a row at a time. ``width``: the row's true length where
    the kernel pads it with zeros to a power of two (None: all of it); ``x``,
    ``gamma`` and ``beta`` are zero past it, and so is ``y``.
    """
    if centred:
        mean = row_mean(x, width)
        centred_x = x - mean
        if width is not None:
            columns = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
            centred_x = jnp.where(columns < width, centred_x, 0.0)
    else:
        mean, centred_x = None, x
    rstd = jax.lax.rsqrt(row_mean(centred_x * centred_x, width) + epsilon)
    y = centred_x * rstd * gamma
    if beta is not None:
        y = y + beta
    return y, mean, rstd


def row_gradients(dy, x, mean, rstd, gamma, width: int | None = None):
    """``(dx, dy * xhat)`` in f32 from f32 ``dy``, ``x`` and the saved row statistics.

    ``gamma`` is the effective scale, broadcastable to ``x``; ``mean`` is None
    for rmsnorm. Row by row, so the one-pass kernel
    (:mod:`fp8jax.kernels.norm_backward`) computes the same from its blocks.
    ``width``: as for :func:`normalize_rows`; with ``dy`` and ``gamma`` zero
    past it, both products are zero there and ``dx`` there is unused.
    """
    xhat = (x - mean) * rstd if mean is not None else x * rstd
    dxhat = dy * gamma
    projection = xhat * row_mean(dxhat * xhat, width)
    if mean is not None:
        dx = rstd * (dxhat - row_mean(dxhat, width) - projection)
    else:
        dx = rstd * (dxhat - projection)
    return dx, dy * xhat

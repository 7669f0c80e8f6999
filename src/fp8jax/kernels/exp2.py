"""exp2 as a cubic on the FP32 pipes, for softmaxes whose ex2s outrun the SM's MUFU.

An H100/H200 SM retires 16 MUFU ``ex2`` a cycle against 128 FP32 FMAs, and
FP8 attention needs one ``ex2`` a score: at head_dim 128 a block's
exponentials take the MUFU as long as its two FP8 products take the tensor
cores at peak (docs/design.md#fp8-attention). :func:`exp2_cubic` computes
``2**x`` from FMAs and integer ops instead, so a kernel can send a share of
its scores there (FlashAttention-4's split of the exponentials):
``2**x = 2**n * 2**f`` with ``n = round(x)`` read from the low mantissa bits
of ``x + 1.5 * 2**23``, ``f = x - n`` in [-0.5, 0.5], ``2**f`` a cubic with
its constant term 1 (so integers give powers of two exactly), and ``n``
added to the cubic's exponent field as an integer: one max, three adds,
three FMAs, a shift and an integer add against one MUFU instruction.

Its relative error is at most :data:`CUBIC_ERROR` (2**-13.2), against
E4M3's 2**-4 rounding of the P it feeds: the coefficients are a minimax fit
of the relative error on [-0.5, 0.5] with the constant fixed at 1
(tests/kernels/test_exp2.py recomputes the bound on a dense grid).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

# 2**f ~= 1 + f * (C1 + f * (C2 + f * C3)) on [-0.5, 0.5], f32 values.
C1, C2, C3 = 0.6932829022407532, 0.2422109991312027, 0.05500893294811249
CUBIC_ERROR = 1.02e-4  # the largest relative error, rounding included
# x + MAGIC rounds x to an integer held in the sum's low mantissa bits.
MAGIC = 1.5 * 2.0**23
# Inputs are clamped here: with n >= -125 the cubic's exponent (126 or 127)
# plus n stays a normal float's; -inf gives 2**-125, which E4M3 flushes to 0.
FLOOR = -125.0


def exp2_cubic(x):
    """``2**x`` of f32 ``x`` <= 127 from FP32 and integer ops only; ``x`` below -125
    (``-inf`` included) gives about ``2**-125``."""
    x = jnp.maximum(x, FLOOR)
    t = x + MAGIC
    # x + (MAGIC - t), not x - (t - MAGIC): XLA's simplifier folds (x + c) - c to x,
    # which would leave f = 0; MAGIC - t = -round(x) is exact either way.
    f = x + (MAGIC - t)
    cubic = f * (f * (f * C3 + C2) + C1) + 1.0
    as_int = lambda v: lax.bitcast_convert_type(v, jnp.int32)  # noqa: E731
    return lax.bitcast_convert_type(as_int(cubic) + lax.shift_left(as_int(t), 23), jnp.float32)


def split_exp2(x, fma_columns: int, concatenate=None):
    """``2**x`` of f32 ``x``: MUFU's ``exp2`` for the first entries of its last axis,
    :func:`exp2_cubic` for the last ``fma_columns``.

    ``concatenate`` joins the two parts along the last axis (``jnp.concatenate``
    by default; a Mosaic GPU kernel passes its own, which moves no data).
    """
    if fma_columns == 0:
        return jnp.exp2(x)
    split = x.shape[-1] - fma_columns
    if split == 0:
        return exp2_cubic(x)
    join = concatenate or (lambda a, b: jnp.concatenate([a, b], axis=-1))
    return join(jnp.exp2(x[..., :split]), exp2_cubic(x[..., split:]))

"""RowwiseScaling's GEMM: FP8 operands scaled per row, the product rescaled in an epilogue.

Operands come as ``a`` (B, M, K) and ``b`` (B, N, K), both with the
contracted axis minor, as cuBLASLt's FP8 GEMM reads them
(:mod:`fp8jax.ops.fine_grained` brings every dot_general to that form). A
scale per row of ``a`` and per row of ``b`` is constant along K, so it
factors out of the sum: ``y[m, n] = sa[m] * sb[n] * sum_k qa[m, k] qb[n, k]``.
The GEMM takes the FP8 data as they are (a real FP8 tensor-core GEMM;
docs/design.md#why-fp8-operands-go-straight-into-dot_general) with no
scaling, and the outer product of the two ``scale_inv`` vectors multiplies
its output afterwards: an elementwise op XLA fuses into the consumer.

The backward contracts other axes, so it quantizes again along them: the
input gradient ``g . b`` contracts N, which takes ``b`` per K-row; the
weight gradient ``g^T . a`` contracts M, which takes ``a`` and ``g`` per
column. The forward saves ``a`` and ``b`` only in those FP8 layouts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8jax.ops import _partitioning
from fp8jax.ops.fine_config import FineDotConfig
from fp8jax.ops.fine_quantize import quantize_rows_and_columns
from fp8jax.ops.residuals import saved_as_bits
from fp8jax.recipes import RowwiseScaling


def gemm_dtype(out_dtype) -> np.dtype:
    """The dtype the FP8 GEMM writes before the scale epilogue.

    Unscaled, the product of two FP8 rows reaches ``448**2 * K`` (about
    3e9 for K = 16384): beyond float16's range, within bfloat16's. bfloat16
    output rounds once more (a relative 2**-9, against E4M3's 2**-4 per
    operand) and halves what the GEMM writes; float16 and float32 outputs
    are computed in float32 (docs/design.md#fine-grained-scaling).
    """
    return jnp.dtype(jnp.bfloat16) if jnp.dtype(out_dtype) == jnp.bfloat16 else np.float32


def scaled_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, precision) -> jax.Array:
    """``(a . b^T) * a_scale_inv * b_scale_inv^T``: a (B, M, K), b (B, N, K) FP8, scales (B, *, 1).

    A batch of one runs as a plain matrix product.
    """
    acc = gemm_dtype(out_dtype)
    if a.shape[0] == 1:
        y = lax.dot_general(a[0], b[0], (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=acc)[None]  # fmt: skip
    else:
        y = lax.dot_general(a, b, (((2,), (2,)), ((0,), (0,))), precision=precision,
                            preferred_element_type=acc)  # fmt: skip
    outer = a_scale_inv * jnp.swapaxes(b_scale_inv, 1, 2)
    return (y.astype(jnp.float32) * outer).astype(out_dtype)


def _column_reduction(recipe: RowwiseScaling):
    """The column maxima's max over ``recipe.amax_reduction_axes`` (in shard_map), or None.

    A column of an operand runs along its rows: tokens, split over the
    axes, for activations and gradients; a replicated weight's columns are
    the same on every device, where the reduction changes nothing.
    """
    if not recipe.amax_reduction_axes:
        return None
    return functools.partial(_partitioning.reduce_amax, recipe=recipe)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def row_dot(a, b, config: FineDotConfig):
    """``a (B, M, K) . b (B, N, K)^T`` -> (B, M, N), both scaled per row, FP8 both ways."""
    return _row_dot_fwd(a, b, config)[0]


def _row_dot_fwd(a, b, config: FineDotConfig):
    recipe, fmt = config.recipe, config.recipe.formats.forward
    # Each operand is cast twice from the array in its own dtype: XLA kept
    # the producer's f32 value for both casts otherwise
    # (docs/design.md#the-fine-grained-fused-ops).
    a, b = lax.optimization_barrier((a, b))
    # The backward GEMMs contract M (a's tokens) and N (b's rows): each operand
    # is saved quantized along the axis its backward GEMM contracts.
    reduce = _column_reduction(recipe)
    qa = quantize_rows_and_columns(a, fmt, recipe.margin, reduce_column_amax=reduce)
    qb = quantize_rows_and_columns(b, fmt, recipe.margin, rows_are_tokens=False,
                                   reduce_column_amax=reduce)  # fmt: skip
    y = scaled_gemm(qa.data, qa.scale_inv, qb.data, qb.scale_inv, config.out_dtype,
                    recipe.forward_precision)  # fmt: skip
    return y, (qa.transposed, qb.transposed)


def _row_dot_bwd(config: FineDotConfig, residuals, g):
    a_t, b_t = residuals  # FP8 copies quantized along M and N
    recipe, fmt = config.recipe, config.recipe.formats.backward
    g = lax.optimization_barrier(g)
    # Per token for the dgrad (it contracts N), per column for the wgrad (M).
    reduce = _column_reduction(recipe)
    qg = quantize_rows_and_columns(g, fmt, recipe.margin, reduce_column_amax=reduce)
    g_t = qg.transposed
    d_a = scaled_gemm(qg.data, qg.scale_inv, b_t.data, b_t.scale_inv, config.a_dtype,
                      recipe.dgrad_precision)  # fmt: skip
    d_b = scaled_gemm(g_t.data, g_t.scale_inv, a_t.data, a_t.scale_inv, config.b_dtype,
                      recipe.wgrad_precision)  # fmt: skip
    return _partitioning.match_cotangents((d_a, d_b), None, config.inputs)[:2]


row_dot.defvjp(*saved_as_bits(_row_dot_fwd, _row_dot_bwd))

"""Any dot_general under RowwiseScaling, BlockScaling or MXFP8Scaling, as a batch of products.

The fine-grained GEMMs (:mod:`fp8jax.ops.rowwise`, :mod:`fp8jax.ops.blockwise`,
:mod:`fp8jax.ops.mx`)
take ``a`` (B, M, K) and ``b`` (B, N, K): batch axes first, the free axes
merged into rows, the contracted axes merged into the minor axis, which is
where cuBLASLt's FP8 GEMM and the block kernel read K. Each operand is
brought there in high precision, where XLA fuses the transpose into the
pass that quantizes it; JAX differentiates the reshapes and transposes
around the custom_vjp. Under BlockScaling and MXFP8Scaling, M, N and K are
padded with zeros to multiples of 128 (zeros add nothing to a sum, and their
scale is 1).

The fused ops (``layernorm_dense``, ``layernorm_mlp``) take these recipes
as a norm followed by these GEMMs (:func:`unfused_layernorm_dense`): not
fused into one custom_vjp as the per-tensor recipes are.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from fp8jax.kernels.block_gemm import BLOCK
from fp8jax.ops import _partitioning, blockwise, mx, rowwise
from fp8jax.ops.fine_config import FineDotConfig
from fp8jax.recipes import PER_TENSOR


def dot_general(lhs, rhs, dims, recipe, out_dtype) -> jax.Array:
    """FP8 ``lax.dot_general(lhs, rhs, dims)`` under a fine-grained ``recipe``, in ``out_dtype``.

    ``dims`` are normalized (:func:`fp8jax.ops.dimensions.normalize`); the
    result is laid out as ``lax.dot_general`` lays it out.

    Over Explicit mesh axes the merges, transposes and GEMMs below have no
    sharding their types can state (the weight gradient contracts sharded
    tokens; a block view splits a sharded axis), so they run with the axes
    Auto, partitioned by XLA as under ``jit``, and the result takes the
    sharding the per-tensor recipes give it
    (:func:`fp8jax.ops._partitioning.dot_out_sharding`).
    """
    out_sharding = _partitioning.dot_out_sharding(lhs, rhs, dims)
    product = functools.partial(_dot_general, dims=dims, recipe=recipe, out_dtype=out_dtype)
    if out_sharding is None:
        return product(lhs, rhs)
    return jax.sharding.auto_axes(product, out_sharding=out_sharding)(lhs, rhs)


def _dot_general(lhs, rhs, *, dims, recipe, out_dtype) -> jax.Array:
    (lc, rc), (lb, rb) = dims
    lf = [i for i in range(lhs.ndim) if i not in lc and i not in lb]
    rf = [i for i in range(rhs.ndim) if i not in rc and i not in rb]
    batch = [lhs.shape[i] for i in lb]
    free_l, free_r = [lhs.shape[i] for i in lf], [rhs.shape[i] for i in rf]
    out_shape = (*batch, *free_l, *free_r)
    b_, m, n = math.prod(batch), math.prod(free_l), math.prod(free_r)
    k = math.prod(lhs.shape[i] for i in lc)
    if 0 in (b_, m, n, k):  # an empty operand: no GEMM, a zero (or empty) product
        return jnp.zeros(out_shape, out_dtype)
    a = jnp.transpose(lhs, (*lb, *lf, *lc)).reshape(b_, m, k)
    b = jnp.transpose(rhs, (*rb, *rf, *rc)).reshape(b_, n, k)
    return _product(a, b, recipe, jnp.dtype(out_dtype)).reshape(out_shape)


# The GEMM of each weight granularity a fine-grained recipe declares
# (recipe.granularity("kernel").kind), and whether its operands are padded to
# whole 128-blocks (the block kernel's tiles, cuDNN's MX scale layout).
_GEMMS = {
    "row": (rowwise.row_dot, False),
    "block": (blockwise.block_dot, True),  # BlockScaling: 128 x 128 weight blocks
    "tile": (mx.mx_dot, True),  # MXFP8Scaling: 1 x 32 blocks along K
}


def _product(a, b, recipe, out_dtype) -> jax.Array:
    kind = recipe.granularity("kernel").kind
    if kind not in _GEMMS:
        raise TypeError(
            f"recipe must be RowwiseScaling, BlockScaling or MXFP8Scaling here, got {recipe!r}."
        )
    gemm, padded = _GEMMS[kind]
    if not padded:
        config = FineDotConfig(recipe, out_dtype, jnp.dtype(a.dtype), jnp.dtype(b.dtype),
                               _partitioning.input_types(a, b))  # fmt: skip
        return gemm(a, b, config)
    _, m, k = a.shape
    n = b.shape[1]
    pad = lambda size: -size % BLOCK  # noqa: E731
    a = jnp.pad(a, ((0, 0), (0, pad(m)), (0, pad(k))))
    b = jnp.pad(b, ((0, 0), (0, pad(n)), (0, pad(k))))
    config = FineDotConfig(recipe, out_dtype, jnp.dtype(a.dtype), jnp.dtype(b.dtype),
                           _partitioning.input_types(a, b))  # fmt: skip
    return gemm(a, b, config)[:, :m, :n]


def is_fine(recipe) -> bool:
    """Whether ``recipe`` scales finer than per tensor (its GEMMs run here)."""
    return recipe.granularity("x") != PER_TENSOR


def dot(lhs, rhs, bias, dims, recipe, out_dtype, split=None):
    """:func:`dot_general`, plus a bias over the output's trailing axes, cut by ``split``.

    ``bias`` (checked by the caller) spans the rhs's free axes; its gradient
    is JAX's sum of the output gradient. ``split``: a
    :class:`~fp8jax.ops.split.Split` of the output, or None.
    """
    y = dot_general(lhs, rhs, dims, recipe, out_dtype)
    if bias is not None:
        y = y + _partitioning.broadcastable(bias.astype(y.dtype), y.ndim)
    return y if split is None else split.apply(y)

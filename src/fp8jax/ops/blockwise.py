"""BlockScaling's GEMMs, forward and backward, on the block-scaled FP8 GEMM.

Operands come as ``a`` (B, M, K), the activation, and ``b`` (B, N, K), the
weight with its contracted axis minor; every extent a multiple of 128
(:mod:`fp8jax.ops.fine_grained` pads). The activation is scaled per 1x128
tile along K and the weight per 128x128 block, which
:func:`~fp8jax.kernels.block_gemm.block_scaled_matmul` applies every 128 of K.

Backward: the input gradient ``g . b`` contracts N, the output gradient per
1x128 tile along N against the same weight blocks, transposed (a block's
scale serves both orientations). The weight gradient ``g^T . a`` contracts
M (tokens): both ``g`` and ``a`` are scaled per 1x128 tile along M. The
forward saves the weight's FP8 blocks and ``a`` quantized along M.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fp8jax.kernels.block_gemm import BLOCK, block_scaled_matmul
from fp8jax.ops import _partitioning
from fp8jax.ops.fine_config import FineDotConfig
from fp8jax.ops.fine_quantize import quantize_blocks, quantize_tiles_both_ways
from fp8jax.ops.residuals import saved_as_bits
from fp8jax.recipes import BlockScaling


def _tiles_both_ways(x, fmt, recipe: BlockScaling):
    return quantize_tiles_both_ways(x, fmt, BLOCK, recipe.margin, recipe.power_of_two_scales)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def block_dot(a, b, config: FineDotConfig):
    """``a (B, M, K) . b (B, N, K)^T`` -> (B, M, N) with block scales, FP8 both ways."""
    return _block_dot_fwd(a, b, config)[0]


def _block_dot_fwd(a, b, config: FineDotConfig):
    recipe, fmt = config.recipe, config.recipe.formats.forward
    # qa (B, M, K), scales (B, M, K / 128); its transposed copy (B, K, M) for
    # the wgrad, which contracts M.
    qa = _tiles_both_ways(a, fmt, recipe)
    qb = quantize_blocks(b, fmt, BLOCK, recipe.margin, recipe.power_of_two_scales)
    y = block_scaled_matmul(qa.data, qb.data, qa.scale_inv, qb.scale_inv, config.out_dtype,
                            b_blocks=True)  # fmt: skip
    return y, (qa.transposed, qb.fp8)


def _block_dot_bwd(config: FineDotConfig, residuals, g):
    a_t, b = residuals
    recipe, fmt = config.recipe, config.recipe.formats.backward
    # qg (B, M, N) for the dgrad, which contracts N; its transposed copy (B, N, M) for the wgrad.
    qg = _tiles_both_ways(g, fmt, recipe)
    g_t = qg.transposed
    # A block's scale serves the transposed weight: (B, K, N), (B, K/128, N/128).
    qb_t, sb_t = jnp.swapaxes(b.data, 1, 2), jnp.swapaxes(b.scale_inv, 1, 2)
    d_a = block_scaled_matmul(qg.data, qb_t, qg.scale_inv, sb_t, config.a_dtype, b_blocks=True)
    d_b = block_scaled_matmul(g_t.data, a_t.data, g_t.scale_inv, a_t.scale_inv, config.b_dtype)
    return _partitioning.match_cotangents((d_a, d_b), None, config.inputs)[:2]


block_dot.defvjp(*saved_as_bits(_block_dot_fwd, _block_dot_bwd))

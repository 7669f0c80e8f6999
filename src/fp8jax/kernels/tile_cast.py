"""BlockScaling's activation casts: 1x128 tiles along both axes of an operand, in one pass.

An activation ``x`` (tokens, K) or its gradient feeds two block-scaled GEMMs:
one contracting K, which takes ``x`` in 1x128 tiles along K, and the weight
gradient, contracting tokens, which takes ``x^T`` in 1x128 tiles along the
tokens (:mod:`fp8jax.ops.fine_grained`). Every such tile lies in one 128x128
block of ``x``, so one pass over the blocks gives both: each program reads a
block, takes the maxima of its 128 rows and of its 128 columns, and writes
the block cast per row, its transpose cast per column, and both sets of
``scale_inv``. Written in ``jnp``, XLA computed the two casts in two passes
and, in the TE-config layer's MLP, laid the activation out transposed in f32
for the second (docs/design.md#the-fine-grained-casts).

On NVIDIA GPUs this is a Pallas (Triton) kernel; elsewhere, with the
kernels off, or for shapes off the 128 grid, XLA computes the same values
(:func:`fp8jax.ops.fine_quantize.quantize_tiles` twice);
:mod:`fp8jax.kernels.dispatch` decides.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fp8jax.formats import Fp8Format
from fp8jax.kernels import dispatch
from fp8jax.quantize import quantize_with_scale
from fp8jax.scaling import group_scales

BLOCK = 128  # the tile length, BlockScaling's (fp8jax.kernels.block_gemm.BLOCK)
WARPS = 8


def fits(shape: tuple[int, ...], row_shards: int = 1) -> bool:
    """Whether a 2-D ``shape`` splits into whole 128x128 blocks, each device's rows too."""
    return len(shape) == 2 and shape[0] % (row_shards * BLOCK) == 0 and shape[1] % BLOCK == 0


def _kernel(fmt: Fp8Format, margin: float, power_of_two: bool,
            x_ref, q_ref, s_ref, qt_ref, st_ref):  # fmt: skip
    x = x_ref[...].astype(jnp.float32)
    a = jnp.abs(x)
    row_scale = group_scales(jnp.max(a, axis=1), fmt.max, margin, power_of_two)[:, None]
    col_scale = group_scales(jnp.max(a, axis=0), fmt.max, margin, power_of_two)[None, :]
    q_ref[...] = quantize_with_scale(x, fmt, row_scale).data
    qt_ref[...] = quantize_with_scale(x, fmt, col_scale).data.T
    s_ref[...] = 1.0 / row_scale
    st_ref[...] = (1.0 / col_scale).T


def _pallas(x, fmt: Fp8Format, margin: float, power_of_two: bool, interpret: bool = False):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pallas_triton

    rows, cols = x.shape
    params = {} if interpret else {"compiler_params": pallas_triton.CompilerParams(num_warps=WARPS)}
    return dispatch.pallas_call(
        functools.partial(_kernel, fmt, margin, power_of_two),
        grid=(rows // BLOCK, cols // BLOCK),
        in_specs=[pl.BlockSpec((BLOCK, BLOCK), lambda i, j: (i, j))],
        out_specs=[
            pl.BlockSpec((BLOCK, BLOCK), lambda i, j: (i, j)),
            pl.BlockSpec((BLOCK, 1), lambda i, j: (i, j)),
            pl.BlockSpec((BLOCK, BLOCK), lambda i, j: (j, i)),
            pl.BlockSpec((BLOCK, 1), lambda i, j: (j, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((rows, cols), fmt.dtype),
            jax.ShapeDtypeStruct((rows, cols // BLOCK), jnp.float32),
            jax.ShapeDtypeStruct((cols, rows), fmt.dtype),
            jax.ShapeDtypeStruct((cols, rows // BLOCK), jnp.float32),
        ],
        interpret=interpret,
        name="fp8jax_cast_tiles_both_ways",
        **params,
    )(x)


def _xla_tiles(x, fmt: Fp8Format, margin: float, power_of_two: bool):
    """``x`` (R, C) cast per 1 x BLOCK tile of its rows: fine_quantize.quantize_tiles's values."""
    rows, cols = x.shape
    tiles = jnp.abs(x.astype(jnp.float32)).reshape(rows, cols // BLOCK, BLOCK)
    scale = group_scales(jnp.max(tiles, axis=-1), fmt.max, margin, power_of_two)
    return quantize_with_scale(x, fmt, jnp.repeat(scale, BLOCK, axis=-1)).data, 1.0 / scale


def _xla(x, fmt: Fp8Format, margin: float, power_of_two: bool):
    # Not fine_quantize.quantize_tiles itself, which imports this module; the
    # tests check the two agree byte for byte.
    return (*_xla_tiles(x, fmt, margin, power_of_two), *_xla_tiles(x.T, fmt, margin, power_of_two))


def cast_tiles_both_ways(x, fmt: Fp8Format, margin: float = 0, power_of_two: bool = False,
                         row_axes: tuple[str, ...] = ()):  # fmt: skip
    """``x`` (R, C) and ``x^T`` cast per 1x128 tile: ``(q, scale_inv, q_t, scale_inv_t)``.

    ``q`` (R, C) with ``scale_inv`` (R, C / 128), ``q_t`` (C, R) with
    ``scale_inv_t`` (C, R / 128): what
    :func:`~fp8jax.ops.fine_quantize.quantize_tiles` gives for ``x`` and ``x^T``.
    ``row_axes``: mesh axes that split ``x``'s rows (and nothing else); each
    device then casts its own blocks. ``x`` must fit (:func:`fits`).
    """
    return dispatch.on_each_device(
        functools.partial(_pallas, fmt=fmt, margin=margin, power_of_two=power_of_two),
        functools.partial(_xla, fmt=fmt, margin=margin, power_of_two=power_of_two),
        (x,), 1, ("rows", "rows", "columns", "columns"), row_axes,
    )  # fmt: skip

"""RowwiseScaling's casts: an operand scaled per row and, transposed, per column, in two passes.

A rowwise GEMM operand ``x`` (rows, columns) is needed twice: scaled per row
for the GEMM that contracts its columns, and scaled per column, transposed,
for the backward GEMM that contracts its rows (:mod:`fp8jax.ops.fine_grained`).
Written in ``jnp``, XLA took the row maxima and the column maxima in two
reductions and wrote both FP8 copies through its transpose emitter: four
kernels, three reads of ``x`` (docs/design.md#the-fine-grained-casts). On NVIDIA
GPUs two Pallas (Triton) kernels do it in two reads:

* :func:`row_and_column_maxima`: ``max |x|`` of every row and every column,
  as per-tile partials (one row of partials per tile of columns, one per
  tile of rows) that XLA reduces;
* :func:`cast_both_ways`: ``x * row_scale`` cast to FP8 and
  ``(x * column_scale)^T`` cast to FP8, from one read of each tile.

Both cast exactly as :func:`fp8jax.quantize.quantize_with_scale`, so the bytes
are XLA's. Where the kernels do not run (the switch is off, another
platform, a shape off the tiles, arrays sharded other than by token rows)
XLA computes the same values: :mod:`fp8jax.kernels.dispatch` decides.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fp8jax.formats import Fp8Format
from fp8jax.kernels import dispatch
from fp8jax.quantize import quantize_with_scale

# Both kernels' tile and warps: the cast-transpose kernel's, the fastest of
# its measured shapes for the same reads and writes; a sweep of eight shapes
# for the maxima kernel found none faster (docs/design.md#the-fine-grained-casts).
TILE_ROWS, TILE_COLS, WARPS = 64, 128, 4


def fits(shape: tuple[int, ...], row_shards: int = 1) -> bool:
    """Whether a 2-D ``shape`` splits into whole tiles, each device's rows too."""
    return (
        len(shape) == 2 and shape[0] % (row_shards * TILE_ROWS) == 0 and shape[1] % TILE_COLS == 0
    )


def _maxima_kernel(x_ref, row_ref, col_ref):
    a = jnp.abs(x_ref[...].astype(jnp.float32))
    row_ref[...] = jnp.max(a, axis=1)[None, :]
    col_ref[...] = jnp.max(a, axis=0)[None, :]


def _compiler_params(interpret: bool) -> dict:
    from jax.experimental.pallas import triton as pallas_triton

    return {} if interpret else {"compiler_params": pallas_triton.CompilerParams(num_warps=WARPS)}


def _pallas_maxima(x, interpret: bool = False):
    """Per-tile partials: row maxima (column tiles, rows) and column maxima (row tiles, columns)."""
    from jax.experimental import pallas as pl

    rows, cols = x.shape
    grid = (rows // TILE_ROWS, cols // TILE_COLS)
    return dispatch.pallas_call(
        _maxima_kernel,
        grid=grid,
        in_specs=[pl.BlockSpec((TILE_ROWS, TILE_COLS), lambda i, j: (i, j))],
        out_specs=[
            pl.BlockSpec((1, TILE_ROWS), lambda i, j: (j, i)),
            pl.BlockSpec((1, TILE_COLS), lambda i, j: (i, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((grid[1], rows), jnp.float32),
            jax.ShapeDtypeStruct((grid[0], cols), jnp.float32),
        ],
        interpret=interpret,
        name="fp8jax_row_column_maxima",
        **_compiler_params(interpret),
    )(x)


def _xla_maxima(x):
    rows, cols = x.shape
    a = jnp.abs(x.astype(jnp.float32))
    row = jnp.max(a.reshape(rows, cols // TILE_COLS, TILE_COLS), axis=2).T
    col = jnp.max(a.reshape(rows // TILE_ROWS, TILE_ROWS, cols), axis=1)
    return row, col


def row_and_column_maxima(x: jax.Array, row_axes: tuple[str, ...] = ()):
    """``(max |x| per row, max |x| per column)`` of a 2-D ``x``, f32 (rows,) and (columns,).

    ``row_axes``: mesh axes that split ``x``'s rows (and nothing else); the
    kernel then runs on each device's rows and the column maxima are reduced
    over them. ``x`` must fit the tiles (:func:`fits`).
    """
    row, col = dispatch.on_each_device(
        _pallas_maxima, _xla_maxima, (x,), 1, ("columns", "rows"), row_axes
    )
    return jnp.max(row, axis=0), jnp.max(col, axis=0)


def _cast_kernel(fmt: Fp8Format, x_ref, row_scale_ref, col_scale_ref, q_ref, qt_ref):
    x = x_ref[...]
    q_ref[...] = quantize_with_scale(x, fmt, row_scale_ref[...]).data
    qt_ref[...] = quantize_with_scale(x, fmt, col_scale_ref[...]).data.T


def _pallas_cast(x, row_scale, col_scale, fmt: Fp8Format, interpret: bool = False):
    from jax.experimental import pallas as pl

    rows, cols = x.shape
    return dispatch.pallas_call(
        functools.partial(_cast_kernel, fmt),
        grid=(rows // TILE_ROWS, cols // TILE_COLS),
        in_specs=[
            pl.BlockSpec((TILE_ROWS, TILE_COLS), lambda i, j: (i, j)),
            pl.BlockSpec((TILE_ROWS, 1), lambda i, j: (i, 0)),
            pl.BlockSpec((1, TILE_COLS), lambda i, j: (0, j)),
        ],
        out_specs=[
            pl.BlockSpec((TILE_ROWS, TILE_COLS), lambda i, j: (i, j)),
            pl.BlockSpec((TILE_COLS, TILE_ROWS), lambda i, j: (j, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((rows, cols), fmt.dtype),
            jax.ShapeDtypeStruct((cols, rows), fmt.dtype),
        ],
        interpret=interpret,
        name="fp8jax_cast_rows_and_columns",
        **_compiler_params(interpret),
    )(x, row_scale, col_scale)


def _xla_cast(x, row_scale, col_scale, fmt: Fp8Format):
    q = quantize_with_scale(x, fmt, row_scale).data
    q_t = quantize_with_scale(x.T, fmt, col_scale.T).data
    return q, q_t


def cast_both_ways(x, row_scale, col_scale, fmt: Fp8Format, row_axes: tuple[str, ...] = ()):
    """``(x * row_scale, (x * col_scale)^T)`` cast to ``fmt``: (rows, cols) and (cols, rows).

    ``row_scale`` is f32 (rows, 1), ``col_scale`` f32 (1, cols). The bytes are
    :func:`~fp8jax.quantize.quantize_with_scale`'s. ``row_axes``: as in
    :func:`row_and_column_maxima`.
    """
    return dispatch.on_each_device(
        functools.partial(_pallas_cast, fmt=fmt), functools.partial(_xla_cast, fmt=fmt),
        (x, row_scale.astype(jnp.float32), col_scale.astype(jnp.float32)), 2,
        ("rows", "columns"), row_axes,
    )  # fmt: skip

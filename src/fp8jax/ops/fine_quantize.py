"""Fine-grained FP8 quantization: one scale per row, per 1xB tile or per BxB block.

The operands of the fine-grained GEMMs (:mod:`fp8jax.ops.fine_grained`)
come here, through :func:`fp8jax.ops.quantizing.quantize_operand` and
:func:`quantize`, as (batch, rows, columns) arrays whose last axis is the
one their GEMM contracts. Each function returns a
:class:`~fp8jax.ops.operand.QuantizedOperand`: the FP8 data in the array's
shape and the f32 ``scale_inv`` (``value ~= data * scale_inv``) of each
group, in the shape its :class:`~fp8jax.recipes.Granularity` gives (batch
axis in front), so the GEMMs can rescale products group by group; an
operand quantized both ways carries its transposed copy, with that copy's
own scales. No amax: these recipes keep no state. :func:`quantize_rows`,
:func:`quantize_tiles` and :func:`quantize_blocks` are plain ``jnp``, which XLA
fuses into the producer's kernels. An operand needed in both layouts goes
through :func:`quantize_rows_and_columns` or :func:`quantize_tiles_both_ways`,
which run Pallas kernels on the GPU where they can
(docs/design.md#the-fine-grained-casts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8jax.formats import Fp8Format
from fp8jax.kernels import dispatch, row_cast, tile_cast
from fp8jax.ops.operand import QuantizedOperand
from fp8jax.quantize import Fp8Array, quantize_with_scale
from fp8jax.recipes import Granularity
from fp8jax.scaling import group_scales

PER_ROW = Granularity("row")


def _scales(group_amax: jax.Array, fmt: Fp8Format, margin: float, power_of_two: bool):
    """Each group's scale from its amax; 1 for an all-zero or non-finite group."""
    return group_scales(group_amax, fmt.max, margin, power_of_two)


def quantize_rows(x: jax.Array, fmt: Fp8Format, margin: float = 0) -> QuantizedOperand:
    """``x`` scaled per row (last axis), ``scale_inv`` shaped (..., 1)."""
    row_amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)
    q = quantize_with_scale(x, fmt, _scales(row_amax, fmt, margin, False))
    return QuantizedOperand(q, None, granularity=PER_ROW)


def _both_ways(q: QuantizedOperand, q_t: QuantizedOperand) -> QuantizedOperand:
    """``q`` with ``q_t``'s FP8 copy (the transpose, its own scales) as its transposed one."""
    return QuantizedOperand(q.fp8, None, q_t.fp8, granularity=q.granularity)


def quantize_rows_and_columns(x: jax.Array, fmt: Fp8Format, margin: float = 0, *,
                              rows_are_tokens: bool = True,
                              reduce_column_amax=None) -> QuantizedOperand:  # fmt: skip
    """``x`` (B, R, C) scaled per row, and transposed, scaled per column.

    Returns what :func:`quantize_rows` gives for ``x``, with what it gives
    for ``swapaxes(x, 1, 2)`` (the same bytes) as the transposed copy. A
    batch of one whose shape fits the kernels' tiles runs the Pallas
    kernels of :mod:`fp8jax.kernels.row_cast` where
    :mod:`fp8jax.kernels.dispatch` lets them (``rows_are_tokens``: the rows
    are tokens, which data parallelism splits); elsewhere XLA.
    ``reduce_column_amax``: applied to the column maxima (B, C) before their
    scales are taken; inside ``shard_map`` over token axes, a ``pmax`` over
    them makes each column's scale the whole tensor's. Row maxima are never
    reduced: a row lies on one device.
    """
    placement = dispatch.decide(
        lambda shards: x.shape[0] == 1 and row_cast.fits(x.shape[1:], shards),
        rows_are_tokens=rows_are_tokens,
    )
    if not placement.kernel:
        x_t = jnp.swapaxes(x, 1, 2)
        if reduce_column_amax is None:
            return _both_ways(quantize_rows(x, fmt, margin), quantize_rows(x_t, fmt, margin))
        col_amax = jnp.max(jnp.abs(x_t.astype(jnp.float32)), axis=-1)
        col_scale = _scales(reduce_column_amax(col_amax), fmt, margin, False)[..., None]
        q_t = quantize_with_scale(x_t, fmt, col_scale)
        return QuantizedOperand(quantize_rows(x, fmt, margin).fp8, None, q_t, granularity=PER_ROW)
    x2 = x[0]
    row_amax, col_amax = row_cast.row_and_column_maxima(x2, placement.row_axes)
    if reduce_column_amax is not None:
        col_amax = reduce_column_amax(col_amax[None])[0]
    row_scale = _scales(row_amax, fmt, margin, False)[:, None]
    col_scale = _scales(col_amax, fmt, margin, False)[None, :]
    q, q_t = row_cast.cast_both_ways(x2, row_scale, col_scale, fmt, placement.row_axes)
    fp8 = Fp8Array(q[None], (1.0 / row_scale)[None], fmt)
    fp8_t = Fp8Array(q_t[None], (1.0 / col_scale).T[None], fmt)
    return QuantizedOperand(fp8, None, fp8_t, granularity=PER_ROW)


def quantize_tiles(x: jax.Array, fmt: Fp8Format, block: int, margin: float = 0,
                   power_of_two: bool = False) -> QuantizedOperand:  # fmt: skip
    """``x`` (..., C) scaled per 1 x ``block`` tile of its last axis.

    ``scale_inv`` is (..., C // block). ``C`` must be a multiple of ``block``.
    """
    *lead, cols = x.shape
    tiles = x.astype(jnp.float32).reshape(*lead, cols // block, block)
    scale = _scales(jnp.max(jnp.abs(tiles), axis=-1), fmt, margin, power_of_two)
    # The cast runs on x's own shape, each scale repeated over its tile: cast
    # in the tiled view, a transposed x (the weight gradient's operands) made
    # XLA write the FP8 data through an untiled transpose
    # (docs/design.md#the-forward-kernel-transposed-in-the-program).
    q = quantize_with_scale(x, fmt, jnp.repeat(scale, block, axis=-1))
    granularity = Granularity("tile", block, power_of_two)
    return QuantizedOperand(Fp8Array(q.data, 1.0 / scale, fmt), None, granularity=granularity)


def quantize_tiles_both_ways(x: jax.Array, fmt: Fp8Format, block: int, margin: float = 0,
                             power_of_two: bool = False, *,
                             rows_are_tokens: bool = True) -> QuantizedOperand:  # fmt: skip
    """``x`` (B, R, C) per 1 x ``block`` tile along C, and transposed, along R.

    Returns what :func:`quantize_tiles` gives for ``x``, with what it gives
    for ``swapaxes(x, 1, 2)`` as the transposed copy. A
    batch of one on the 128 grid runs the one-pass kernel of
    :mod:`fp8jax.kernels.tile_cast` where :mod:`fp8jax.kernels.dispatch` lets it
    (``rows_are_tokens``: the rows are tokens, which data parallelism
    splits); elsewhere XLA.
    """
    placement = dispatch.decide(
        lambda shards: x.shape[0] == 1 and block == tile_cast.BLOCK
        and tile_cast.fits(x.shape[1:], shards),
        rows_are_tokens=rows_are_tokens,
    )  # fmt: skip
    if not placement.kernel:
        x_t = jnp.swapaxes(x, 1, 2)
        return _both_ways(quantize_tiles(x, fmt, block, margin, power_of_two),
                          quantize_tiles(x_t, fmt, block, margin, power_of_two))  # fmt: skip
    q, s, q_t, s_t = tile_cast.cast_tiles_both_ways(x[0], fmt, margin, power_of_two,
                                                    placement.row_axes)  # fmt: skip
    return QuantizedOperand(Fp8Array(q[None], s[None], fmt), None,
                            Fp8Array(q_t[None], s_t[None], fmt),
                            granularity=Granularity("tile", block, power_of_two))  # fmt: skip


def quantize_blocks(x: jax.Array, fmt: Fp8Format, block: int, margin: float = 0,
                    power_of_two: bool = False) -> QuantizedOperand:  # fmt: skip
    """``x`` (B, R, C) scaled per ``block`` x ``block`` block.

    ``scale_inv`` is (B, R // block, C // block); both R and C must be
    multiples of ``block``. A block's scale serves the array and its
    transpose alike, which is why weights are scaled this way: the forward
    GEMM contracts them over one axis, the input-gradient GEMM over the other.
    """
    batch, rows, cols = x.shape
    blocks = x.astype(jnp.float32).reshape(batch, rows // block, block, cols // block, block)
    block_amax = jnp.max(jnp.abs(blocks), axis=(2, 4), keepdims=True)
    q = quantize_with_scale(blocks, fmt, _scales(block_amax, fmt, margin, power_of_two))
    fp8 = Fp8Array(q.data.reshape(x.shape), q.scale_inv[:, :, 0, :, 0], fmt)
    return QuantizedOperand(fp8, None, granularity=Granularity("block", block, power_of_two))


def quantize(x: jax.Array, fmt: Fp8Format, granularity: Granularity, margin: float = 0, *,
             transpose: bool = False, rows_are_tokens: bool = True,
             reduce_column_amax=None) -> QuantizedOperand:  # fmt: skip
    """``x`` (B, R, C) scaled per ``granularity`` along C; with ``transpose``, also along R.

    The one door to the functions above: ``transpose`` asks for the
    transposed copy, scaled along R, from the same pass
    (:func:`quantize_rows_and_columns`, :func:`quantize_tiles_both_ways`);
    a block's scales serve ``x`` and its transpose alike, so a block
    operand has none (swap the axes of its data and ``scale_inv``).
    ``rows_are_tokens`` and ``reduce_column_amax`` are the both-ways passes'.
    """
    kind, block, power_of_two = granularity.kind, granularity.block, granularity.power_of_two
    if kind == "row" and not power_of_two:
        if transpose:
            return quantize_rows_and_columns(x, fmt, margin, rows_are_tokens=rows_are_tokens,
                                             reduce_column_amax=reduce_column_amax)  # fmt: skip
        return quantize_rows(x, fmt, margin)
    if kind == "tile":
        if transpose:
            return quantize_tiles_both_ways(x, fmt, block, margin, power_of_two,
                                            rows_are_tokens=rows_are_tokens)  # fmt: skip
        return quantize_tiles(x, fmt, block, margin, power_of_two)
    if kind == "block" and not transpose:
        return quantize_blocks(x, fmt, block, margin, power_of_two)
    raise ValueError(
        "fine_quantize.quantize: granularity must be per row, per tile or (transpose=False) per "
        f"block, got {granularity!r} with transpose={transpose}."
    )

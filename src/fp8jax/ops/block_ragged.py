"""Block-scaled grouped GEMMs: :func:`fp8jax.ragged_dot` under ``BlockScaling``.

DeepSeek-V3's recipe on each expert: a token is scaled per 1x128 tile along
the axis its GEMM contracts, each expert's weight per 128x128 block, and
every 128-long slice of the contraction is taken in FP8, scaled and added
to an f32 accumulator (docs/design.md#fine-grained-scaling). Per group,
each GEMM is the dense block GEMM (:func:`fp8jax.ops.fine_grained.fine_dot` under BlockScaling)
on the group's rows:

* forward ``lhs . rhs[i]``: ``lhs`` per 1x128 tile along K, ``rhs[i]`` per
  128x128 block;
* dgrad ``g . rhs[i]^T``: ``g`` per 1x128 tile along N, the same weight
  blocks transposed (a block's scale serves both orientations);
* wgrad ``lhs_i^T . g_i``: contracts the group's tokens, so ``lhs`` and
  ``g`` are quantized again, per 128 tokens of each column. The token tiles
  start at each group's first row, so a tile never spans two experts; a
  group whose size is not a multiple of 128 ends in a short tile. The
  forward writes that copy of the activation (FP8, in group order: ``m``
  rows of ``k`` bytes, and ``floor(m / 128) + g`` rows of f32 scales) for the
  backward, as the dense recipe saves its transposed copy.

No row is padded in memory and no group is copied whole: the GEMMs run in
rounds, round ``j`` gathering the ``j``-th run of ``t`` 128-row tiles of
every group by index (rows past a group's end read as zero) and taking all
groups' runs as one batch of the dense block GEMM
(:func:`fp8jax.kernels.block_gemm.block_scaled_matmul`, batched over
experts). ``t`` (:func:`round_tiles`) is a quarter more than a balanced
share, so a balanced routing takes one round; the rounds are as many as
the largest group needs, known only at run time (a ``while`` loop), and
each computes ``g * t * 128`` rows, padding included. The forward and the
dgrad scatter each round's rows back to their output rows; the wgrad's
round contracts its ``t`` token tiles, promoting every 128 tokens, and
adds its f32 product to the experts' sums. K and N are padded with zeros to multiples of 128
(zeros add nothing, and their scale is 1).

Where the rounds' GEMMs run is :func:`~fp8jax.kernels.block_gemm.block_scaled_matmul`'s
choice: its Mosaic GPU kernel on one device for operands of one FP8 format
(``ALL_E4M3``, the recipe's default), XLA's per-slice FP8 dots otherwise.
Under a mesh the loop is partitioned by XLA as under ``jit``: no per-device
``shard_map`` as the per-tensor kernels have; FSDP-sharded expert weights
inside ``shard_map`` are quantized per shard and all-gathered in FP8.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8jax.kernels import grouped_gemm as gg
from fp8jax.kernels.block_gemm import BLOCK, block_scaled_matmul
from fp8jax.ops.fine_quantize import quantize_blocks, quantize_tiles
from fp8jax.ops.residuals import saved_as_bits
from fp8jax.quantize import quantize_with_scale
from fp8jax.scaling import group_scales


def tile_count(rows: int, groups: int) -> int:
    """The most token tiles ``groups`` groups of ``rows`` rows can need.

    ``sum ceil(s_i / 128) <= sum (floor(s_i / 128) + 1) <= floor(rows / 128) + groups``.
    """
    return rows // BLOCK + groups


def _groups(group_sizes: jax.Array, rows: int):
    """Each group's first row, size, first token tile and tile count (all [g], int32)."""
    ends = gg.group_ends(group_sizes, rows)
    sizes = jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))
    counts = (sizes + BLOCK - 1) // BLOCK
    return ends - sizes, sizes, jnp.cumsum(counts) - counts, counts


def token_tiles(group_sizes: jax.Array, rows: int) -> jax.Array:
    """Each grouped row's token tile (int32 [rows]); :func:`tile_count` for rows in no group.

    Tiles are numbered group by group, 128 rows from each group's first row.
    """
    starts, sizes, first_tile, _ = _groups(group_sizes, rows)
    groups = group_sizes.shape[0]
    # rows x groups integer compares in one fused pass, where a binary
    # search is a loop of small kernels (17 steps for DeepSeek's rows).
    row = jnp.arange(rows, dtype=jnp.int32)
    group = jnp.searchsorted(starts + sizes, row, side="right", method="compare_all")
    group = group.astype(jnp.int32)
    safe = jnp.minimum(group, groups - 1)
    tile = first_tile[safe] + (row - starts[safe]) // BLOCK
    return jnp.where(group < groups, tile, tile_count(rows, groups))


def quantize_token_tiles(x, tiles, num_tiles: int, fmt, margin: float, power_of_two: bool):
    """``x [rows, c]`` (group order) scaled per token tile and column.

    Returns ``(data [rows, c], scale_inv [num_tiles, c])``; rows in no tile
    (``tiles == num_tiles``) are cast at scale 1 and never read.
    """
    scale = group_scales(_tile_amax(x, tiles, num_tiles), fmt.max, margin, power_of_two)
    row_scale = jnp.concatenate([scale, jnp.ones((1, x.shape[1]), jnp.float32)])[tiles]
    return quantize_with_scale(x, fmt, row_scale).data, 1.0 / scale


def _tile_amax(x, tiles, num_tiles: int):
    """Each token tile's column amax, ``[num_tiles, c]`` f32; 0 for a tile no row is in.

    Tiles are numbered in row order (rows in no group last), so tile ``t``'s
    rows are a run of at most 128 from its first row. They are gathered by
    index as ``[num_tiles * 128, c]`` (rows past the run read as zero, which
    no max of absolute values notices) and reduced 128 rows at a time: a
    segment max is a scatter-max on the GPU, whose atomics serialize on each
    tile's rows. Flat rows, zero-filled by the gather itself, let XLA fuse
    the gather into the reduction; ``[num_tiles, 128]`` indices or a
    ``where`` after it wrote the gathered copy out first. An empty tile's
    amax is 0, where a segment max gives -inf: both give the scale 1.
    """
    rows, cols = x.shape
    if not rows:  # no row to gather
        return jnp.zeros((num_tiles, cols), jnp.float32)
    ids = jnp.arange(num_tiles, dtype=tiles.dtype)
    # num_tiles x rows integer compares in one fused pass, not a loop of small kernels.
    first, end = (jnp.searchsorted(tiles, ids, side=side, method="compare_all")
                  for side in ("left", "right"))  # fmt: skip
    row = first[:, None] + jnp.arange(BLOCK, dtype=first.dtype)[None, :]
    row = jnp.where(row < end[:, None], row, rows).reshape(-1)  # past x: read as 0
    tile = jnp.take(x, row, axis=0, mode="fill", fill_value=0).reshape(num_tiles, BLOCK, cols)
    return jnp.max(jnp.abs(tile.astype(jnp.float32)), axis=1)


def round_tiles(rows: int, groups: int) -> int:
    """Token tiles each group takes per round: a quarter more than a balanced share, at least 1.

    ``rows`` and ``groups`` are static, so a balanced routing takes one
    round (the wgrad then writes its f32 sum once), at the cost of a
    quarter of padding rows past the groups' ends; an expert that gets more
    takes more rounds.
    """
    return max(1, -(-5 * rows // (4 * groups * BLOCK)))


def _round_rows(starts, sizes, j, tiles: int):
    """Round ``j``'s grouped rows ([g, tiles * 128], clipped to row 0) and which are real."""
    offset = j * (tiles * BLOCK) + jnp.arange(tiles * BLOCK, dtype=jnp.int32)
    real = offset[None, :] < sizes[:, None]
    return jnp.where(real, starts[:, None] + offset[None, :], 0), real


def _gather(x, rows, real):
    """``x[rows]`` as [g, r, c], zeros where not ``real``."""
    taken = jnp.take(x, rows, axis=0)
    return jnp.where(real[..., None], taken, jnp.zeros((), x.dtype))


def _rounds(counts, tiles: int):
    """Rounds of ``tiles`` tiles a group that cover the largest group."""
    return (jnp.max(counts, initial=0) + tiles - 1) // tiles


def grouped_block_matmul(a, sa, b, sb, group_sizes, out_rows: int, out_dtype, *, rows: int,
                         read=None, write=None, tiles: int = 1) -> jax.Array:  # fmt: skip
    """``out[write[r]] = a[read[r]] . b[i]^T`` with block scales, for the rows ``r`` of group ``i``.

    ``a [., k]`` FP8 with ``sa [., k / 128]`` per 1x128 tile; ``b [g, n, k]``
    FP8 with ``sb [g, n / 128, k / 128]`` per block; ``rows`` grouped rows
    (``read``, ``write``: int [rows] maps, None for the rows themselves);
    ``tiles``: 128-row tiles a group per round (:func:`round_tiles`).
    Output rows no grouped row writes are zero.
    """
    starts, sizes, _, counts = _groups(group_sizes, rows)
    n = b.shape[1]

    def body(j, out):
        grouped, real = _round_rows(starts, sizes, j, tiles)
        source = grouped if read is None else read[grouped]
        y = block_scaled_matmul(_gather(a, source, real), b, jnp.take(sa, source, axis=0), sb,
                                out_dtype, b_blocks=True)  # fmt: skip
        target = grouped if write is None else write[grouped]
        # Padding rows go past the output (dropped), each to its own row, so
        # that every index is unique: XLA then stores the rows, where with
        # indices that may repeat it sets each 16-bit element by a 32-bit
        # compare-and-swap loop (its deviceless PTX for an H100).
        past = out_rows + jnp.arange(target.size, dtype=target.dtype).reshape(target.shape)
        target = jnp.where(real, target, past)
        return out.at[target.reshape(-1)].set(y.reshape(-1, n), mode="drop",
                                              unique_indices=True)  # fmt: skip

    out = jnp.zeros((out_rows, n), out_dtype)
    if not rows or not a.shape[0]:  # no rows to gather: the loop's takes need one
        return out
    return lax.fori_loop(0, _rounds(counts, tiles), body, out)


def grouped_block_wgrad(a, sa, b, sb, group_sizes, out_dtype, *, tiles: int = 1) -> jax.Array:
    """``out[i] = a[rows of i]^T . b[rows of i]``, promoted every token tile: ``[g, k, n]``.

    ``a [rows, k]``, ``b [rows, n]``: FP8 in group order, scaled per token
    tile (:func:`quantize_token_tiles`), ``sa [tiles, k]``, ``sb [tiles, n]``.
    A round contracts ``tiles`` token tiles of every group in one block GEMM
    (the tiles are its 128-wide slices of K); the first round's sum is the
    accumulator, later rounds add to it in f32. A single round writes
    ``out_dtype`` from the kernel.
    """
    rows, k = a.shape
    n, groups = b.shape[1], group_sizes.shape[0]
    starts, sizes, first_tile, counts = _groups(group_sizes, rows)
    last = sa.shape[0] - 1
    if not rows:  # no rows to gather: the loop's takes need one
        return jnp.zeros((groups, k, n), out_dtype)

    def product(j, dtype=jnp.float32):
        grouped, real = _round_rows(starts, sizes, j, tiles)
        # A group past its tiles reads zeros; any scale will do.
        run = j * tiles + jnp.arange(tiles, dtype=jnp.int32)
        tile = jnp.minimum(first_tile[:, None] + run[None, :], last)  # [g, t]
        a_j = jnp.swapaxes(_gather(a, grouped, real), 1, 2)  # [g, k, t * 128]
        b_j = jnp.swapaxes(_gather(b, grouped, real), 1, 2)  # [g, n, t * 128]
        sa_j, sb_j = jnp.swapaxes(sa[tile], 1, 2), jnp.swapaxes(sb[tile], 1, 2)  # [g, ., t]
        return block_scaled_matmul(a_j, b_j, sa_j, sb_j, dtype)

    rounds = _rounds(counts, tiles)

    def summed():
        acc = lax.fori_loop(1, rounds, lambda j, acc: acc + product(j), product(0))
        return acc.astype(out_dtype)

    if jnp.dtype(out_dtype) == jnp.float32:
        return summed()
    # One round (a balanced routing's): the kernel writes out_dtype itself,
    # the same rounding of the same f32 sum, without an f32 [g, k, n] written
    # and read back to cast it.
    return lax.cond(rounds > 1, summed, lambda: product(0, out_dtype))


def quantize_weight_blocks(rhs, fmt, recipe, gather: tuple = ()):
    """``rhs [g, k, n]`` per 128x128 block, laid out ``[g, n, k]``: ``(data, scale_inv)``.

    ``gather``: inside ``shard_map``, ``(axis of rhs, mesh axes)`` splitting
    it (FSDP): each device quantizes its shard's blocks (whole blocks: the
    caller checks the shard is a multiple of 128), then data and scales are
    all-gathered in FP8.
    """
    q = quantize_blocks(jnp.swapaxes(rhs, 1, 2), fmt, BLOCK, recipe.margin,
                        recipe.power_of_two_scales)  # fmt: skip
    data, scale_inv = q.data, q.scale_inv
    if gather:
        axis, axes = gather
        data = lax.all_gather(data, axes, axis=3 - axis, tiled=True)
        scale_inv = lax.all_gather(scale_inv, axes, axis=3 - axis, tiled=True)
    return data, scale_inv


def _tiles_along_k(x, fmt, recipe):
    q = quantize_tiles(x, fmt, BLOCK, recipe.margin, recipe.power_of_two_scales)
    return q.data, q.scale_inv


def _token_tiles(x, tiles, num_tiles, fmt, recipe):
    return quantize_token_tiles(x, tiles, num_tiles, fmt, recipe.margin,
                                recipe.power_of_two_scales)  # fmt: skip


def _grouped_rows(x, index, rows: int):
    """``x``'s grouped rows: ``x[index]``, or its first ``rows`` rows where ``index`` is None."""
    return x[:rows] if index is None else jnp.take(x, index, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _block_ragged(lhs, rhs, group_sizes, slots, config):
    return _fwd(lhs, rhs, group_sizes, slots, config)[0]


def _fwd(lhs, rhs, group_sizes, slots, config):
    recipe, fmt = config.recipe, config.recipe.formats.forward
    lhs_slots, out_slots = slots
    rows = lhs.shape[0] * config.repeats
    read = None if lhs_slots is None else lhs_slots // config.repeats
    a, sa = _tiles_along_k(lhs, fmt, recipe)
    b, sb = quantize_weight_blocks(rhs, fmt, recipe, config.rhs_gather)
    tiles = round_tiles(rows, group_sizes.shape[0])
    y = grouped_block_matmul(a, sa, b, sb, group_sizes, rows, config.out_dtype, rows=rows,
                             read=read, write=out_slots, tiles=tiles)  # fmt: skip
    # The wgrad's copy: the grouped rows, per 128 tokens of each column.
    num_tiles = tile_count(rows, group_sizes.shape[0])
    a_tok = _token_tiles(_grouped_rows(lhs, read, rows), token_tiles(group_sizes, rows),
                         num_tiles, fmt, recipe)  # fmt: skip
    return y, (a_tok, b, sb, group_sizes, slots)


def _bwd(config, residuals, g):
    (a_tok, sa_tok), b, sb, group_sizes, slots = residuals
    lhs_slots, out_slots = slots
    recipe, fmt = config.recipe, config.recipe.formats.backward
    rows = a_tok.shape[0]
    # dgrad: g per 1x128 tile along n, against each block transposed: [g, k, n].
    qg, sg = _tiles_along_k(g, fmt, recipe)
    b_t, sb_t = jnp.swapaxes(b, 1, 2), jnp.swapaxes(sb, 1, 2)
    tiles = round_tiles(rows, group_sizes.shape[0])
    d_lhs = grouped_block_matmul(qg, sg, b_t, sb_t, group_sizes, rows, config.lhs_dtype,
                                 rows=rows, read=out_slots, write=lhs_slots,
                                 tiles=tiles)  # fmt: skip
    if config.repeats > 1:  # a row of lhs sums its repeats' slots
        per_row = d_lhs.astype(jnp.float32).reshape(-1, config.repeats, d_lhs.shape[1])
        d_lhs = jnp.sum(per_row, axis=1).astype(config.lhs_dtype)
    g_tok, sg_tok = _token_tiles(_grouped_rows(g, out_slots, rows),
                                 token_tiles(group_sizes, rows), sa_tok.shape[0], fmt,
                                 recipe)  # fmt: skip
    d_rhs = grouped_block_wgrad(a_tok, sa_tok, g_tok, sg_tok, group_sizes, config.rhs_dtype,
                                tiles=tiles)  # fmt: skip
    if config.rhs_gather:  # each device keeps the summed gradient of its shard
        axis, axes = config.rhs_gather
        d_rhs = lax.psum_scatter(d_rhs, axes, scatter_dimension=axis, tiled=True)
    d_ints = jax.tree.map(lambda i: np.zeros(i.shape, jax.dtypes.float0), (group_sizes, slots))
    return d_lhs, d_rhs, *d_ints


_block_ragged.defvjp(*saved_as_bits(_fwd, _bwd))


def _pad(x, axis: int, multiple: int = BLOCK):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, -x.shape[axis] % multiple)
    return jnp.pad(x, widths)


def check_shard(owner: str, rhs_shape, gather: tuple) -> None:
    """Raises where FSDP-sharded expert weights do not split into whole 128x128 blocks.

    Each device quantizes its own shard (``rhs_shape``), so no block may span
    two devices and none may be padded: both of its matrix axes must be
    multiples of 128.
    """
    if gather and (rhs_shape[1] % BLOCK or rhs_shape[2] % BLOCK):
        raise ValueError(
            f"{owner}: under BlockScaling each device quantizes its shard of the expert "
            f"weights in whole {BLOCK}x{BLOCK} blocks, so both matrix axes of the shard must "
            f"be multiples of {BLOCK}; got a shard of shape {tuple(rhs_shape)} split along "
            f"axis {gather[0]}. Use sizes that are multiples of {BLOCK} (times the FSDP "
            "devices along the split axis)."
        )


def block_ragged_dot(lhs, rhs, group_sizes, slots, config) -> jax.Array:
    """:func:`fp8jax.ops.ragged_dot`'s product under BlockScaling (checked arguments).

    ``slots``: ``(lhs_slots, out_slots)``, int32 or None; ``config``: a
    :class:`fp8jax.ops.ragged_dot.RaggedConfig`. K and N are padded to
    multiples of 128 here, outside the custom_vjp, so JAX differentiates the
    pads and the crop; FSDP shards must hold whole blocks (:func:`check_shard`).
    """
    if config.rhs_gather:
        check_shard("fp8jax.ragged_dot", rhs.shape, config.rhs_gather)
        return _block_ragged(lhs, rhs, group_sizes, slots, config)
    n = rhs.shape[2]
    y = _block_ragged(_pad(lhs, 1), _pad(_pad(rhs, 1), 2), group_sizes, slots, config)
    return y[:, :n]

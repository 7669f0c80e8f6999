"""FP8 grouped GEMMs for :func:`fp8jax.ragged_dot`: a Pallas (Triton) kernel and its XLA twin.

A grouped GEMM multiplies each group of rows of ``a`` (rows sorted by
group) by its group's matrix. XLA lowers ``lax.ragged_dot`` to one dense
GEMM over all groups (a deviceless H100 compile, jax 0.10.2: lhs expanded to
``[m, g * k]``), ``g`` times the useful FLOPs, so on NVIDIA GPUs these
kernels run instead and do only the useful ones
(docs/design.md#grouped-expert-gemms).

Layout (:class:`Layout`): every group's rows are padded to whole row tiles
(``TILES.m``) in a static buffer of ``m + g * (TILES.m - 1)`` rows (rounded
up to a tile), so each row tile belongs to one group; the tile-to-group
table is computed by XLA from the group sizes. Padding rows are zero.

* :func:`grouped` (forward and dgrad): ``out[rows of group i] = a[rows] .
  b[i]^T`` for ``b`` laid out ``[g, n, k]`` (contracting axis minor, as
  FP8 tensor-core MMAs read both operands). One program per (row tile,
  column tile) loops over ``k`` and scales in its epilogue.
* :func:`grouped_transposed` (wgrad): ``out[i] = a_t[:, rows of i] .
  b_t[:, rows of i]^T`` for ``a_t [k, rows]`` and ``b_t [n, rows]``: one
  program per (group, output tile) loops over that group's row tiles.

Both operands of a kernel are FP8 of one format: JAX's Pallas Triton
lowering of ``dot_general`` refuses operands of two element types, so the
caller converts the E4M3 operand of a backward GEMM to the gradient's E5M2
(:mod:`fp8jax.ops.ragged_dot`). Elsewhere (the CPU tests) and with the
kernels off XLA computes the same products with ``lax.ragged_dot``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.kernels import triton_fp8_dot


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The kernels' tiling: rows per tile (the padding granularity), output
    columns per tile, the contraction step (FP8 MMAs on Hopper contract 32
    elements at a time), warps and software-pipelining stages (None: Triton's
    default). The wgrad kernel's output tiles are ``wgrad_k`` x ``wgrad_n``
    (rows of its ``[k, n]`` result by columns), on ``wgrad_warps`` warps, and
    it contracts ``m`` rows at a time.
    """

    m: int = 128
    n: int = 256
    k: int = 128
    warps: int = 8
    stages: int | None = 3
    # Its f32 accumulator is wgrad_k * wgrad_n values over 32 * wgrad_warps
    # threads: 256 x 256 on 8 warps would need 256 registers a thread for it alone.
    wgrad_k: int = 128
    wgrad_n: int = 256
    wgrad_warps: int = 8


# The tiling every kernel is traced with: the fastest of bench/moe.py --part tiles's
# seven on an H200 for both of its shapes, and of --part backward's four wgrad tiles
# (docs/design.md#grouped-expert-gemms).
TILES = Tiles()


@contextlib.contextmanager
def use_tiles(tiles: Tiles):
    """Traces the kernels with ``tiles`` inside (a function traced before keeps its own)."""
    global TILES
    before, TILES = TILES, tiles
    try:
        yield
    finally:
        TILES = before


def _compiler_params(interpret: bool, warps: int) -> dict:
    from jax.experimental.pallas import triton as pallas_triton

    if interpret:
        return {}
    stages = {} if TILES.stages is None else {"num_stages": TILES.stages}
    return {"compiler_params": pallas_triton.CompilerParams(num_warps=warps, **stages)}


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["row_group", "tile_group", "tile_start", "tile_count", "source", "dest"],
    meta_fields=["rows", "padded_rows"],
)
@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each row of a grouped operand lives in the tile-padded buffer.

    ``row_group [m]``: each row's group (``g`` for rows past the last group);
    ``tile_group [tiles]``: each row tile's group (``g`` for unused tiles);
    ``tile_start``, ``tile_count [g]``: each group's first row tile and count;
    ``source [padded_rows]``: the row each buffer row is read from (``rows``,
    a zero row, for padding); ``dest [m]``: each row's place in the buffer
    (``padded_rows``, a zero row, for rows in no group).
    """

    row_group: jax.Array
    tile_group: jax.Array
    tile_start: jax.Array
    tile_count: jax.Array
    source: jax.Array
    dest: jax.Array
    rows: int
    padded_rows: int


def group_ends(group_sizes: jax.Array, rows: int) -> jax.Array:
    """Each group's end row: the cumulative sizes, made non-decreasing and clipped to [0, rows].

    For valid sizes (non-negative, summing to at most ``rows``) these are the
    cumulative sums; otherwise (possible only inside ``jit``) a group with a
    negative size is empty and rows past ``rows`` are dropped.
    """
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.clip(lax.cummax(ends), 0, rows)


def effective_sizes(group_sizes: jax.Array, rows: int) -> jax.Array:
    """The group sizes :func:`group_ends` implies: ``group_sizes`` itself where valid."""
    ends = group_ends(group_sizes, rows)
    return jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))


def row_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
    """Each row's group, ``g`` for rows past the last group (which give zeros, as in lax)."""
    ends = group_ends(group_sizes, rows)
    rows_index = jnp.arange(rows, dtype=jnp.int32)
    return jnp.searchsorted(ends, rows_index, side="right").astype(jnp.int32)


def layout(group_sizes: jax.Array, rows: int, block_m: int | None = None) -> Layout:
    """The tile-padded :class:`Layout` of ``rows`` rows in groups of ``group_sizes``.

    ``block_m``: rows per tile, :data:`TILES`'s by default.
    """
    block_m = block_m or TILES.m
    groups = group_sizes.shape[0]
    ends = group_ends(group_sizes, rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    sizes = ends - starts
    tile_count = (sizes + block_m - 1) // block_m
    tile_end = jnp.cumsum(tile_count)
    tile_start = tile_end - tile_count
    padded_rows = _round_up(rows + groups * (block_m - 1), block_m)
    tiles = padded_rows // block_m
    tile_group = jnp.searchsorted(tile_end, jnp.arange(tiles, dtype=jnp.int32), side="right")
    tile_group = tile_group.astype(jnp.int32)
    # Buffer row p lies in tile p // block_m of group tile_group; its offset
    # in the group's padded rows maps back to the group's row, if any.
    p = jnp.arange(padded_rows, dtype=jnp.int32)
    p_group = tile_group[p // block_m]
    safe = jnp.minimum(p_group, groups - 1)
    offset = p - tile_start[safe] * block_m
    valid = (p_group < groups) & (offset < sizes[safe])
    source = jnp.where(valid, starts[safe] + offset, rows)
    row_group = row_groups(group_sizes, rows)
    r = jnp.arange(rows, dtype=jnp.int32)
    g_safe = jnp.minimum(row_group, groups - 1)
    dest = jnp.where(row_group < groups, tile_start[g_safe] * block_m + r - starts[g_safe],
                     padded_rows)  # fmt: skip
    return Layout(row_group, tile_group, tile_start.astype(jnp.int32),
                  tile_count.astype(jnp.int32), source, dest, rows, padded_rows)  # fmt: skip


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def to_padded(x: jax.Array, lay: Layout) -> jax.Array:
    """``x [m, ...]`` in the tile-padded buffer (zeros in the padding)."""
    zero = jnp.zeros((1, *x.shape[1:]), x.dtype)
    return jnp.concatenate([x, zero])[lay.source]


def from_padded(y: jax.Array, lay: Layout) -> jax.Array:
    """The rows of ``y`` (a padded buffer) back in ``x``'s order; zeros for rows in no group."""
    zero = jnp.zeros((1, *y.shape[1:]), y.dtype)
    return jnp.concatenate([y, zero])[lay.dest]


def _pad_axis(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    extra = _round_up(x.shape[axis], multiple) - x.shape[axis]
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _grouped_kernel(tiles: Tiles, k_steps, tg_ref, scale_ref, a_ref, b_ref, o_ref):
    from jax.experimental import pallas as pl

    group = tg_ref[0]
    j = pl.program_id(1)
    groups = b_ref.shape[0]

    @pl.when(group < groups)
    def _():
        def body(step, acc):
            k0 = pl.multiple_of(step * tiles.k, tiles.k)
            a = a_ref[:, pl.ds(k0, tiles.k)]
            b = b_ref[group, pl.ds(j * tiles.n, tiles.n), pl.ds(k0, tiles.k)]
            return triton_fp8_dot.accumulate(acc, a, b)

        acc = lax.fori_loop(0, k_steps, body, jnp.zeros((tiles.m, tiles.n), jnp.float32))
        o_ref[...] = (acc * scale_ref[0]).astype(o_ref.dtype)


def grouped_pallas(a_pad, b, tile_scale, lay: Layout, out_dtype, interpret: bool = False):
    """``a_pad [padded_rows, k] . b[group]^T`` per row tile, times its tile's scale.

    ``b``: ``[g, n, k]``; ``tile_scale [tiles]``: the epilogue's factor per
    row tile. Returns ``[padded_rows, n]`` (rows of unused tiles undefined).
    """
    from jax.experimental import pallas as pl

    t = TILES
    n = b.shape[1]
    a_pad = _pad_axis(a_pad, 1, t.k)
    b = _pad_axis(_pad_axis(b, 1, t.n), 2, t.k)
    k, n_pad = a_pad.shape[1], b.shape[1]
    grid = (lay.padded_rows // t.m, n_pad // t.n)
    out = pl.pallas_call(
        functools.partial(_grouped_kernel, t, k // t.k),
        grid=grid,
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (i,)),
            pl.BlockSpec((1,), lambda i, j: (i,)),
            pl.BlockSpec((t.m, k), lambda i, j: (i, 0)),
            pl.no_block_spec,
        ],
        out_specs=pl.BlockSpec((t.m, t.n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((lay.padded_rows, n_pad), out_dtype),
        interpret=interpret,
        name="fp8jax_grouped_gemm",
        **_compiler_params(interpret, t.warps),
    )(lay.tile_group, tile_scale.astype(jnp.float32), a_pad, b)
    return out[:, :n]


def _transposed_kernel(tiles: Tiles, start_ref, count_ref, scale_ref, a_ref, b_ref, o_ref):
    from jax.experimental import pallas as pl

    i, j = pl.program_id(1), pl.program_id(2)
    start = start_ref[0]

    def body(t, acc):
        r0 = pl.multiple_of((start + t) * tiles.m, tiles.m)
        a = a_ref[pl.ds(i * tiles.wgrad_k, tiles.wgrad_k), pl.ds(r0, tiles.m)]
        b = b_ref[pl.ds(j * tiles.wgrad_n, tiles.wgrad_n), pl.ds(r0, tiles.m)]
        return triton_fp8_dot.accumulate(acc, a, b)

    tile = (tiles.wgrad_k, tiles.wgrad_n)
    acc = lax.fori_loop(0, count_ref[0], body, jnp.zeros(tile, jnp.float32))
    o_ref[...] = (acc * scale_ref[0]).astype(o_ref.dtype)


def grouped_transposed_pallas(a_t, b_t, scale, lay: Layout, groups: int, out_dtype,
                              interpret: bool = False):  # fmt: skip
    """``out[i] = a_t[:, rows of i] . b_t[:, rows of i]^T * scale``: ``[g, k, n]``.

    ``a_t [k, padded_rows]``, ``b_t [n, padded_rows]``: the padded buffers
    transposed, so that both contract their minor axis. An empty group gives zeros.
    """
    from jax.experimental import pallas as pl

    t = TILES
    k, n = a_t.shape[0], b_t.shape[0]
    tk, tn = t.wgrad_k, t.wgrad_n
    a_t, b_t = _pad_axis(a_t, 0, tk), _pad_axis(b_t, 0, tn)
    grid = (groups, a_t.shape[0] // tk, b_t.shape[0] // tn)
    out = pl.pallas_call(
        functools.partial(_transposed_kernel, t),
        grid=grid,
        in_specs=[
            pl.BlockSpec((1,), lambda g, i, j: (g,)),
            pl.BlockSpec((1,), lambda g, i, j: (g,)),
            pl.BlockSpec((1,), lambda g, i, j: (0,)),
            pl.no_block_spec,
            pl.no_block_spec,
        ],
        out_specs=pl.BlockSpec((None, tk, tn), lambda g, i, j: (g, i, j)),
        out_shape=jax.ShapeDtypeStruct((groups, a_t.shape[0], b_t.shape[0]), out_dtype),
        interpret=interpret,
        name="fp8jax_grouped_gemm_wgrad",
        **_compiler_params(interpret, t.wgrad_warps),
    )(lay.tile_start, lay.tile_count, jnp.reshape(scale, (1,)).astype(jnp.float32), a_t, b_t)
    return out[:, :k, :n]


def grouped_xla(a, b, group_sizes, row_scale, out_dtype):
    """:func:`grouped_pallas`'s values from ``lax.ragged_dot`` on unpadded rows.

    ``a [m, k]``, ``b [g, n, k]``; ``row_scale [m]`` (zero for rows in no group).
    """
    y = lax.ragged_dot(a, jnp.swapaxes(b, 1, 2), group_sizes, preferred_element_type=jnp.float32)
    return (y * row_scale[:, None]).astype(out_dtype)


def grouped_transposed_xla(a, b, group_sizes, scale, out_dtype):
    """:func:`grouped_transposed_pallas`'s values: ``a [m, k]``, ``b [m, n]`` -> ``[g, k, n]``."""
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    y = lax.ragged_dot_general(a, b, group_sizes, dims, preferred_element_type=jnp.float32)
    return (y * scale).astype(out_dtype)


def useful_flops(rows: int, k: int, n: int) -> int:
    """The FLOPs of a grouped GEMM over ``rows`` grouped rows: 2 * rows * k * n."""
    return 2 * rows * k * n

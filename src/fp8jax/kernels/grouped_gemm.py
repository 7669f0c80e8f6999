"""FP8 grouped GEMMs for :func:`fp8jax.ragged_dot`: a Pallas (Triton) kernel and its XLA twin.

A grouped GEMM multiplies each group of rows of ``a`` (rows sorted by
group) by its group's matrix. XLA lowers ``lax.ragged_dot`` to one dense
GEMM over all groups (a deviceless H100 compile, jax 0.10.2: lhs expanded to
``[m, g * k]``), ``g`` times the useful FLOPs, so on NVIDIA GPUs these
kernels run instead and do only the useful ones
(docs/design.md#grouped-expert-gemms).

Layout (:class:`Layout`): the rows of each group, and the rows past the
last group, are split into whole row tiles (``current_tiles().m``) of a static grid of
``m + (g + 1) * (current_tiles().m - 1)`` places (rounded up to a tile), so each row
tile belongs to one group; XLA computes the tile-to-group table and each
place's row from the group sizes. Places past a group's rows are padding.

* :func:`grouped` (forward and dgrad): ``out[rows of group i] = a[rows] .
  b[i]^T`` for ``b`` laid out ``[g, n, k]`` (contracting axis minor, as
  FP8 tensor-core MMAs read both operands). One program per (row tile,
  column tile) reads its rows of ``a`` by index, loops over ``k``, scales
  in its epilogue and writes its rows of the output in place.
* :func:`grouped_transposed` (wgrad): ``out[i] = a[rows of i]^T .
  b[rows of i]``. A gather kernel first writes both operands into the
  places transposed (``[k, places]``, ``[n, places]``, zeros in padding),
  then one program per (group, output tile) loops over the group's row tiles.

Since every row is read and written by index, the index may go through a
map: a grouped row may read any row of ``a`` (``read``, a gather: an MoE
block's tokens, each read by its ``top_k`` slots) and land at any row of
the output (``write``, a permutation: the slots back in token order),
with no gathered or permuted copy (:func:`place_rows`).

Both operands of a kernel are FP8 of one format: JAX's Pallas Triton
lowering of ``dot_general`` refuses operands of two element types, so the
backward GEMMs read the gradient's E5M2 only: the caller casts the weights
to it as well and converts the saved E4M3 input (:mod:`fp8jax.ops.ragged_dot`).
Elsewhere (the CPU tests) and with the kernels off XLA computes the same
products with ``lax.ragged_dot``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.kernels import _options, dispatch, triton_fp8_dot


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


# The tiling every kernel is traced with by default: the fastest of bench/moe.py
# --part tiles's seven on an H200 for both of its shapes, and of --part backward's
# four wgrad tiles (docs/design.md#grouped-expert-gemms).
DEFAULT_TILES = Tiles()

# An option in the jit key (fp8jax.kernels._options): a function traced with
# one tiling is traced again under another, where a module global read at
# trace time would leave jit's cached trace on the old one.
_TILES = _options.option(
    "fp8jax_grouped_gemm_tiles",
    "The grouped-GEMM kernels' Tiles (fp8jax.kernels.grouped_gemm.use_tiles).",
    default=DEFAULT_TILES,
)
# Pallas interpret mode for the grouped-GEMM kernels and the experts' cast
# (tests, on the CPU), in the jit key as well.
_INTERPRET = _options.option(
    "fp8jax_grouped_gemm_interpret",
    "Whether fp8jax.ragged_dot's kernels run in Pallas interpret mode (tests, on the CPU).",
    default=False,
)


def current_tiles() -> Tiles:
    """The tiling the kernels are traced with here: :data:`DEFAULT_TILES` or :func:`use_tiles`'s."""
    return _TILES.value


def _check_tiles(tiles: Tiles) -> Tiles:
    if not isinstance(tiles, Tiles):
        raise TypeError(f"tiles must be a fp8jax.kernels.grouped_gemm.Tiles, got {tiles!r}.")
    return tiles


def use_tiles(tiles: Tiles):
    """A context manager: the kernels traced with ``tiles`` inside (part of the jit key)."""
    return _TILES(_check_tiles(tiles))


def set_tiles(tiles: Tiles) -> None:
    """Sets the kernels' tiling for the process, outside any :func:`use_tiles`."""
    _options.set_global(_TILES, _check_tiles(tiles))


def interpreting() -> bool:
    """Whether the kernels run in Pallas interpret mode here (:func:`interpret_kernels`)."""
    return bool(_INTERPRET.value)


def interpret_kernels(flag: bool = True):
    """A context manager: the kernels in Pallas interpret mode inside (tests, on the CPU)."""
    if not isinstance(flag, bool):
        raise TypeError(f"interpret_kernels: flag must be a bool, got {flag!r}.")
    return _INTERPRET(flag)


def _compiler_params(interpret: bool, warps: int) -> dict:
    from jax.experimental.pallas import triton as pallas_triton

    if interpret:
        return {}
    stages = {} if current_tiles().stages is None else {"num_stages": current_tiles().stages}
    return {"compiler_params": pallas_triton.CompilerParams(num_warps=warps, **stages)}


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["tile_group", "tile_start", "tile_count", "source"],
    meta_fields=["rows", "padded_rows"],
)
@dataclasses.dataclass(frozen=True)
class Layout:
    """Row tiles of a grouped operand: which rows each tile holds and whose they are.

    The ``g`` groups, then the rows past the last group (a group ``g`` whose
    outputs are zeros, as ``lax.ragged_dot`` gives), each padded to whole
    row tiles, fill ``padded_rows`` places. ``tile_group [tiles]``: each row
    tile's group (``g + 1`` for unused tiles); ``tile_start``,
    ``tile_count [g + 1]``: each group's first row tile and count;
    ``source [padded_rows]``: the row of the operand each place holds
    (``rows`` for padding).
    """

    tile_group: jax.Array
    tile_start: jax.Array
    tile_count: jax.Array
    source: jax.Array
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
    """The :class:`Layout` of ``rows`` rows in groups of ``group_sizes``.

    ``block_m``: rows per tile, :func:`current_tiles`'s by default.
    """
    block_m = block_m or current_tiles().m
    groups = group_sizes.shape[0] + 1  # the rows past the last group are one more
    ends = jnp.concatenate([group_ends(group_sizes, rows), jnp.full((1,), rows, jnp.int32)])
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    sizes = ends - starts
    tile_count = (sizes + block_m - 1) // block_m
    tile_end = jnp.cumsum(tile_count)
    tile_start = tile_end - tile_count
    padded_rows = _round_up(rows + groups * (block_m - 1), block_m)
    tiles = padded_rows // block_m
    tile_group = jnp.searchsorted(tile_end, jnp.arange(tiles, dtype=jnp.int32), side="right")
    tile_group = tile_group.astype(jnp.int32)
    # Place p lies in tile p // block_m of group tile_group; its offset in the
    # group's padded rows maps back to the group's row, if any.
    p = jnp.arange(padded_rows, dtype=jnp.int32)
    p_group = tile_group[p // block_m]
    safe = jnp.minimum(p_group, groups - 1)
    offset = p - tile_start[safe] * block_m
    valid = (p_group < groups) & (offset < sizes[safe])
    source = jnp.where(valid, starts[safe] + offset, rows)
    return Layout(tile_group, tile_start.astype(jnp.int32), tile_count.astype(jnp.int32),
                  source, rows, padded_rows)  # fmt: skip


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _pad_axis(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    extra = _round_up(x.shape[axis], multiple) - x.shape[axis]
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def place_rows(lay: Layout, index: jax.Array | None, limit: int) -> jax.Array:
    """Each place's row of an operand: ``index[row]`` of the grouped row it holds
    (the row itself where ``index`` is None), ``limit`` for padding.

    ``index [lay.rows]`` maps grouped rows to an operand's rows (a gather, or
    where an output row goes); ``limit``, the operand's row count, is past
    every row, so a kernel masks padding by ``row < limit``.
    """
    real = lay.source < lay.rows
    if index is None:
        return jnp.where(real, lay.source, limit)
    held = index.astype(jnp.int32)[jnp.minimum(lay.source, lay.rows - 1)]
    return jnp.where(real, held, limit)


def _tile_rows(rows_ref, limit: int):
    """A row tile's rows of an operand (``limit`` for padding), those rows made
    safe to read (row 0 for padding), and which places are real."""
    rows = rows_ref[...]
    real = rows < limit
    return rows, jnp.where(real, rows, 0), real


def _store_rows(o_ref, rows, real, j: int, tile, width: int):
    """``tile`` into output rows ``rows`` at column tile ``j``, where real and inside ``o_ref``.

    A masked-off place stores nothing on the GPU; in interpret mode its row
    index must not be one that a real place of the tile writes (the scatter
    would write both), so padding keeps its out-of-range index, which JAX's
    scatter drops.
    """
    from jax.experimental.pallas import triton as pallas_triton

    cols = j * width + lax.broadcasted_iota(jnp.int32, (1, width), 1)
    mask = real[:, None] & (cols < o_ref.shape[1])
    pallas_triton.store(o_ref.at[rows[:, None], cols], tile.astype(o_ref.dtype), mask=mask)


def _grouped_kernel(tiles: Tiles, k_steps, tg_ref, scale_ref, read_ref, write_ref, a_ref,
                    b_ref, o_ref):  # fmt: skip
    from jax.experimental import pallas as pl

    group = tg_ref[0]
    j = pl.program_id(1)
    groups = b_ref.shape[0]
    _, a_rows, _ = _tile_rows(read_ref, a_ref.shape[0])
    out_rows, _, real = _tile_rows(write_ref, o_ref.shape[0])

    @pl.when(group < groups)
    def _():
        def body(step, acc):
            k0 = pl.multiple_of(step * tiles.k, tiles.k)
            a = a_ref[a_rows, pl.ds(k0, tiles.k)]
            b = b_ref[group, pl.ds(j * tiles.n, tiles.n), pl.ds(k0, tiles.k)]
            return triton_fp8_dot.accumulate(acc, a, b)

        acc = lax.fori_loop(0, k_steps, body, jnp.zeros((tiles.m, tiles.n), jnp.float32))
        _store_rows(o_ref, out_rows, real, j, acc * scale_ref[0], tiles.n)

    @pl.when(group == groups)  # the rows past the last group
    def _():
        _store_rows(o_ref, out_rows, real, j, jnp.zeros((tiles.m, tiles.n)), tiles.n)


def grouped(a, b, group_sizes, per_group, out_dtype, interpret: bool = False, *,
            read=None, write=None):  # fmt: skip
    """``out[write[r]] = a[read[r]] . b[i]^T * per_group[i]`` for the rows ``r`` of group ``i``.

    ``b [g, n, k]``, ``per_group [g]`` (entries past ``g`` unused). The
    grouped rows are ``read``'s (``[m]``, indices into ``a [t, k]``; None:
    ``a``'s own ``m`` rows) and land at ``write[r]`` of the ``[m, n]``
    output (a permutation of ``range(m)``; None: row ``r``). Rows past the
    last group give zeros. Each program reads its row tile's rows of ``a`` by
    index and writes its output rows in place: no padded or permuted copy of
    either (docs/design.md#grouped-expert-gemms).
    """
    from jax.experimental import pallas as pl

    t = current_tiles()
    m, n = (a.shape[0] if read is None else read.shape[0]), b.shape[1]
    lay = layout(group_sizes, m)
    a_rows, out_rows = place_rows(lay, read, a.shape[0]), place_rows(lay, write, m)
    a = _pad_axis(a, 1, t.k)
    b = _pad_axis(_pad_axis(b, 1, t.n), 2, t.k)
    k = a.shape[1]
    last = per_group.shape[0] - 1
    tile_scale = per_group.astype(jnp.float32)[jnp.minimum(lay.tile_group, last)]
    return dispatch.pallas_call(
        functools.partial(_grouped_kernel, t, k // t.k),
        grid=(lay.padded_rows // t.m, b.shape[1] // t.n),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (i,)),
            pl.BlockSpec((1,), lambda i, j: (i,)),
            pl.BlockSpec((t.m,), lambda i, j: (i,)),
            pl.BlockSpec((t.m,), lambda i, j: (i,)),
            pl.no_block_spec,
            pl.no_block_spec,
        ],
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        interpret=interpret,
        name="fp8jax_grouped_gemm",
        **_compiler_params(interpret, t.warps),
    )(lay.tile_group, tile_scale, a_rows, out_rows, a, b)


# The transposing gather's tile: rows (places) x columns, and its warps.
GATHER_ROWS, GATHER_COLS, GATHER_WARPS = 128, 128, 4


def _gather_transposed_kernel(rows_ref, x_ref, o_ref):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pallas_triton

    _, x_rows, real = _tile_rows(rows_ref, x_ref.shape[0])
    cols = pl.program_id(1) * GATHER_COLS + lax.broadcasted_iota(jnp.int32, (1, GATHER_COLS), 1)
    mask = real[:, None] & (cols < x_ref.shape[1])
    tile = pallas_triton.load(x_ref.at[x_rows[:, None], cols], mask=mask,
                              other=jnp.zeros((), x_ref.dtype))  # fmt: skip
    o_ref[...] = tile.T


def gather_transposed(x, lay: Layout, multiple: int, interpret: bool = False, read=None):
    """``x``'s rows in ``lay``'s places, transposed: ``[c, padded_rows]``, zeros in padding.

    ``x [t, c]``; place ``p`` holds ``x[read[r]]`` for the grouped row ``r``
    it holds (``x[r]`` where ``read`` is None). ``c`` is padded with zero
    rows to a multiple of ``multiple``. One pass, where XLA's gather writing
    the transposed layout took 12 ms for 940 MB
    (docs/design.md#grouped-expert-gemms).
    """
    from jax.experimental import pallas as pl

    c_pad = _round_up(x.shape[1], max(multiple, GATHER_COLS))
    return dispatch.pallas_call(
        _gather_transposed_kernel,
        grid=(lay.padded_rows // GATHER_ROWS, c_pad // GATHER_COLS),
        in_specs=[pl.BlockSpec((GATHER_ROWS,), lambda i, j: (i,)), pl.no_block_spec],
        out_specs=pl.BlockSpec((GATHER_COLS, GATHER_ROWS), lambda i, j: (j, i)),
        out_shape=jax.ShapeDtypeStruct((c_pad, lay.padded_rows), x.dtype),
        interpret=interpret,
        name="fp8jax_grouped_gather_transposed",
        **_compiler_params(interpret, GATHER_WARPS),
    )(place_rows(lay, read, x.shape[0]), x)


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


def grouped_transposed(a, b, group_sizes, scale, out_dtype, interpret: bool = False, *,
                       read_a=None, read_b=None):  # fmt: skip
    """``out[i] = a[read_a[rows of i]]^T . b[read_b[rows of i]] * scale``: ``[g, k, n]``.

    The grouped rows are sorted by group; ``read_a`` and ``read_b`` (``[m]``,
    None: the operand's own rows) pick each one's row of ``a [., k]`` and
    ``b [., n]``.

    Both operands are first gathered into the padded places transposed
    (:func:`gather_transposed`), so that the kernel contracts their minor
    axis, as FP8 tensor-core MMAs read both operands; one program per
    (group, output tile) loops over the group's row tiles. An empty group
    gives zeros.
    """
    from jax.experimental import pallas as pl

    t = current_tiles()
    groups = group_sizes.shape[0]
    k, n = a.shape[1], b.shape[1]
    tk, tn = t.wgrad_k, t.wgrad_n
    m = a.shape[0] if read_a is None else read_a.shape[0]
    lay = layout(group_sizes, m)
    a_t = gather_transposed(a, lay, tk, interpret, read_a)
    b_t = gather_transposed(b, lay, tn, interpret, read_b)
    grid = (groups, a_t.shape[0] // tk, b_t.shape[0] // tn)
    out = dispatch.pallas_call(
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


def grouped_xla(a, b, group_sizes, row_scale, out_dtype, *, read=None, write=None):
    """:func:`grouped`'s values from ``lax.ragged_dot`` on unpadded rows.

    ``a [t, k]``, ``b [g, n, k]``; ``row_scale [m]`` (zero for rows in no
    group); ``read`` and ``write`` as in :func:`grouped` (here XLA's gather
    and scatter).
    """
    if read is not None:
        a = jnp.take(a, read, axis=0)
    y = lax.ragged_dot(a, jnp.swapaxes(b, 1, 2), group_sizes, preferred_element_type=jnp.float32)
    y = (y * row_scale[:, None]).astype(out_dtype)
    return y if write is None else jnp.zeros_like(y).at[write].set(y)


def grouped_transposed_xla(a, b, group_sizes, scale, out_dtype, *, read_a=None, read_b=None):
    """:func:`grouped_transposed`'s values: ``a [., k]``, ``b [., n]`` -> ``[g, k, n]``."""
    a = a if read_a is None else jnp.take(a, read_a, axis=0)
    b = b if read_b is None else jnp.take(b, read_b, axis=0)
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

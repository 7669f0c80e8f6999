"""FP8 cast of a GEMM operand, its transposed copy, column sums and maxima, in one pass.

cuBLASLt's FP8 GEMMs take only operands whose contracting axis is the minor
one, so each FP8 operand is needed in two layouts: a gradient ``g`` (tokens,
features) feeds the dgrad GEMM as itself and the wgrad GEMM transposed, an
input ``x`` the forward GEMM as itself and the wgrad GEMM transposed, and a
kernel (in, out) the dgrad GEMM as itself and the forward GEMM transposed.
XLA casts in one kernel and transposes the FP8 copy in another, moving
1-byte elements through its transpose emitter at about 2.3 TB/s; its
reductions with fused math run slower still.
On NVIDIA GPUs :func:`cast_transpose` is one Pallas (Triton) kernel that
reads the operand once and writes both FP8 copies, per-tile column sums (a
bias's gradient) and one maximum per tile (delayed scaling's amax); on the
H200 it takes about half the time of XLA's two kernels
(docs/design.md#cast-and-transpose-in-one-kernel). Elsewhere (the CPU tests)
XLA computes the same values.

The kernel sees whole arrays. Whether it runs, and on which rows, is
decided by :mod:`fp8jax.kernels.dispatch`: as is where the operand is local
to each device, on each device's rows inside ``shard_map`` where data
parallelism alone splits them (``row_axes``), and nowhere else (the callers
keep XLA's path).

A gradient that arrives in pieces (a fused QKV projection's, as cuDNN's
attention backward writes dq, dk and dv apart) is read from its pieces
(:class:`Interleaved`): XLA would first write the whole in bf16, a pass of
its own over the transformer layer's QKV gradient
(docs/design.md#the-fused-qkv-split-inside-the-op).

JAX 0.11 deprecates Pallas's Triton backend in favour of Mosaic GPU, and
warns (DeprecationWarning) when it lowers the kernel. Mosaic GPU in the JAX
versions fp8jax supports cannot express this kernel: it has no transpose of
a register array and no reduction over an axis (deviceless H100 compile,
jax 0.10.2). ``fp8jax.kernels.use_pallas(False)`` (default from
``FP8JAX_PALLAS``) turns the kernel off; a JAX without the Triton backend
turns it off with a warning. Either way XLA computes the same values.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fp8jax.formats import Fp8Format
from fp8jax.kernels import dispatch
from fp8jax.quantize import quantize_with_scale

# Tile rows x columns of g per program. 64 x 128 with 4 warps was the fastest
# of five shapes on the H200 (32-128 rows, 64-128 columns, 4-8 warps).
BLOCK_ROWS, BLOCK_COLS, WARPS = 64, 128, 4


def tiles_fit(shape: tuple[int, ...], tile: tuple[int, int] = (BLOCK_ROWS, BLOCK_COLS)) -> bool:
    """Whether ``shape`` is 2-D and splits into whole kernel tiles of ``tile``."""
    return len(shape) == 2 and shape[0] % tile[0] == 0 and shape[1] % tile[1] == 0


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["pieces"], meta_fields=["periods"]
)
@dataclasses.dataclass(frozen=True)
class Interleaved:
    """A (rows, periods * sum(widths)) matrix given as its pieces.

    Piece ``i`` is (rows, periods * widths[i]); each period of the whole
    holds the next ``widths[0]`` columns of piece 0, then piece 1's, and so on.
    A fused QKV's gradient (tokens, kv_heads, group + 2, head_dim) is the
    pieces dq, dk, dv with one period per key/value head.
    """

    pieces: tuple[jax.Array, ...]
    periods: int

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(p.shape[1] // self.periods for p in self.pieces)

    @property
    def shape(self) -> tuple[int, int]:
        return self.pieces[0].shape[0], self.periods * sum(self.widths)

    def joined(self) -> jax.Array:
        rows = self.pieces[0].shape[0]
        per_period = [p.reshape(rows, self.periods, -1) for p in self.pieces]
        return jnp.concatenate(per_period, axis=2).reshape(rows, -1)

    def tiles_fit(self) -> bool:
        """Whether every tile of the whole lies in one piece (and the whole fits tiles)."""
        tile = _tile(self)
        return tiles_fit(self.shape, tile) and all(w % tile[1] == 0 for w in self.widths)


def _tile(g: jax.Array | Interleaved) -> tuple[int, int]:
    """The kernel's (rows, columns) tile for ``g``.

    BLOCK_ROWS x BLOCK_COLS, but half as wide and twice as tall where pieces
    are not whole tiles wide: a head_dim of 64 (the ``small`` and ``medium``
    presets) puts 64 columns of dq, dk and dv in turn in each row of the QKV
    gradient. The tile keeps its size; a tile must lie in one piece.
    """
    if isinstance(g, Interleaved) and any(w % BLOCK_COLS for w in g.widths):
        return 2 * BLOCK_ROWS, BLOCK_COLS // 2
    return BLOCK_ROWS, BLOCK_COLS


def fits(g: jax.Array | Interleaved, row_shards: int = 1) -> bool:
    """Whether :func:`cast_transpose` takes ``g``: whole tiles, within one piece each.

    ``row_shards``: the devices ``g``'s rows are split over; each one's block
    of rows must fill whole tiles too.
    """
    if g.shape[0] % (row_shards * _tile(g)[0]):
        return False
    return g.tiles_fit() if isinstance(g, Interleaved) else tiles_fit(g.shape)


class CastTransposed(NamedTuple):
    """What :func:`cast_transpose` returns for a (rows, columns) array ``g``."""

    q: jax.Array  # (rows, columns), the FP8 cast
    q_t: jax.Array  # (columns, rows), its transpose (branch-major: see cast_transpose's branches)
    column_sums: jax.Array | None  # (columns,) f32 sums of g over its rows, if asked for
    maxima: jax.Array  # f32 maxima of |g| per tile (whose max is the amax), or the amax


def cast_tile(fmt: Fp8Format, g, scale, q_ref, qt_ref, sum_ref, max_ref, branches: int = 1):
    """One tile's outputs: q, its transpose, column sums and maxima (inside a Pallas kernel).

    ``sum_ref`` None: no column sums. ``branches`` > 1: ``qt_ref`` is a
    (branches, columns / branches, rows) block, each branch's transpose apart
    (:func:`branch_major`).
    """
    g = g.astype(jnp.float32)
    q = quantize_with_scale(g, fmt, scale).data
    q_ref[...] = q
    if branches == 1:
        qt_ref[...] = q.T
    else:
        for k, part in enumerate(split_branches(q, branches)):
            qt_ref[k] = part.T
    if sum_ref is not None:
        sum_ref[...] = jnp.sum(g, axis=0)[None, :]
    max_ref[...] = tile_max(g)


def split_branches(x, n: int) -> tuple[jax.Array, ...]:
    """The ``n`` interleaved branches of a (rows, n * columns) tile, each (rows, columns).

    Column ``n * c + k`` of ``x`` is column ``c`` of branch ``k``; n is 1 or 2
    (a gated pair). Inside a kernel too: Triton splits a last axis of two.
    """
    if n == 1:
        return (x,)
    _check_branches(n)
    rows, cols = x.shape
    a, b = jnp.split(x.reshape(rows, cols // 2, 2), 2, axis=2)
    return a.reshape(rows, cols // 2), b.reshape(rows, cols // 2)


def branch_major(q: jax.Array, n: int) -> jax.Array:
    """``q.T``, rows branch-major: row ``k * (columns / n) + c`` is column ``n * c + k`` of ``q``.

    The transposed copy a gated pre-activation's gradient (columns ``(ffn,
    n)``, interleaved) gives the wgrad GEMM, which then writes kernel_1's
    gradient as ``(hidden, n, ffn)``, the parameter's own layout
    (docs/design.md#the-interleaved-gated-pre-activation).
    """
    if n == 1:
        return q.T
    rows, cols = q.shape
    return jnp.transpose(q.reshape(rows, cols // n, n), (2, 1, 0)).reshape(cols, rows)


def _check_branches(n: int) -> None:
    if n not in (1, 2):
        raise ValueError(f"branches must be 1 or 2 (one activation or a gated pair), got {n}.")


def tile_max(g) -> jax.Array:
    """A tile's ``max |g|`` as a (1, 1) block (inside a Pallas kernel).

    One maximum per tile, not per column: the weights' and most gradients'
    maxima then number at most 8192, few enough for delayed scaling's
    update to reduce them in the kernel that reduces the amax histories
    (:func:`fp8jax.scaling.update_group`), where a separate reduction took a
    kernel or two each (deviceless H100 compile). Each kernel costs a
    synchronized step a few microseconds of launch
    (docs/design.md#the-delayed-scaling-state-as-a-cotangent).
    """
    # One axis at a time: under a mesh in context, JAX 0.11's Triton lowering
    # of a reduction over both axes fails (Explicit axes, seen live on an H200).
    return jnp.max(jnp.max(jnp.abs(g), axis=1, keepdims=True), axis=0, keepdims=True)


def _with_sum_ref(out_refs, column_sums: bool):
    """``(q_ref, qt_ref, sum_ref or None, max_ref)`` from the kernel's output refs."""
    if column_sums:
        return out_refs
    q_ref, qt_ref, max_ref = out_refs
    return q_ref, qt_ref, None, max_ref


def _kernel(fmt: Fp8Format, column_sums: bool, branches: int, g_ref, scale_ref, *out_refs):
    cast_tile(fmt, g_ref[...], scale_ref[0], *_with_sum_ref(out_refs, column_sums), branches)


def _pieces_kernel(fmt: Fp8Format, column_sums: bool, tiles_per_piece: tuple[int, ...], *refs):
    from jax.experimental import pallas as pl

    piece_refs, (scale_ref, *out_refs) = refs[: len(tiles_per_piece)], refs[len(tiles_per_piece) :]
    out_refs = _with_sum_ref(out_refs, column_sums)
    unit = pl.program_id(1) % sum(tiles_per_piece)
    start = 0
    for piece_ref, count in zip(piece_refs, tiles_per_piece, strict=True):
        # Only the piece this column tile lies in is read.
        @pl.when((unit >= start) & (unit < start + count))
        def _(piece_ref=piece_ref):
            cast_tile(fmt, piece_ref[...], scale_ref[0], *out_refs)

        start += count


def _piece_index_map(start: int, count: int, per_period: int):
    """Column tile ``j`` of the whole as a tile of one piece; clamped where it lies elsewhere."""

    def index(i, j):
        local = jnp.clip(j % per_period - start, 0, count - 1)
        return i, (j // per_period) * count + local

    return index


def _pallas_partials(g, scale, fmt: Fp8Format, interpret: bool = False, column_sums: bool = True,
                     branches: int = 1):  # fmt: skip
    """The kernel: q, q_t, column sums per tile of rows, one maximum per tile (:func:`_tile`).

    ``column_sums`` False: the sums are neither computed nor returned.
    ``branches`` > 1: q_t branch-major (:func:`branch_major`).
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pallas_triton

    rows, cols = g.shape
    tile_rows, tile_cols = _tile(g)
    grid = (rows // tile_rows, cols // tile_cols)
    if isinstance(g, Interleaved):
        if branches != 1:
            raise ValueError(f"a gradient in pieces has one branch, got branches={branches}.")
        tiles_per_piece = tuple(w // tile_cols for w in g.widths)
        kernel = functools.partial(_pieces_kernel, fmt, column_sums, tiles_per_piece)
        operands = g.pieces
        starts = [sum(tiles_per_piece[:k]) for k in range(len(tiles_per_piece))]
        piece_specs = [
            pl.BlockSpec((tile_rows, tile_cols),
                         _piece_index_map(start, count, sum(tiles_per_piece)))
            for start, count in zip(starts, tiles_per_piece, strict=True)
        ]  # fmt: skip
    else:
        kernel, operands = functools.partial(_kernel, fmt, column_sums, branches), (g,)
        piece_specs = [pl.BlockSpec((tile_rows, tile_cols), lambda i, j: (i, j))]
    params = {} if interpret else {"compiler_params": pallas_triton.CompilerParams(num_warps=WARPS)}
    q_t_spec, q_t_shape = transposed_block(tile_rows, tile_cols, rows, cols, branches)
    q, q_t, *rest = dispatch.pallas_call(
        kernel,
        grid=grid,
        in_specs=[*piece_specs, pl.BlockSpec((1,), lambda i, j: (0,))],
        out_specs=[
            pl.BlockSpec((tile_rows, tile_cols), lambda i, j: (i, j)),
            q_t_spec,
            *[pl.BlockSpec((1, tile_cols), lambda i, j: (i, j))] * column_sums,
            pl.BlockSpec((1, 1), lambda i, j: (i, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((rows, cols), fmt.dtype),
            jax.ShapeDtypeStruct(q_t_shape, fmt.dtype),
            *[jax.ShapeDtypeStruct((grid[0], cols), jnp.float32)] * column_sums,
            jax.ShapeDtypeStruct(grid, jnp.float32),
        ],
        interpret=interpret,
        name="fp8jax_cast_transpose",
        **params,
    )(*operands, scale.astype(jnp.float32).reshape(1))
    return (q, q_t.reshape(cols, rows), *rest)


def transposed_block(tile_rows: int, tile_cols: int, rows: int, cols: int, branches: int):
    """The transposed copy's BlockSpec and shape for a kernel over (rows, cols) in tiles.

    Branch-major (``branches`` 2), the copy is written as (branches, cols /
    branches, rows): each tile's branches go to their own rows, and the
    caller reshapes it to (cols, rows) for free.
    """
    from jax.experimental import pallas as pl

    if branches == 1:
        return pl.BlockSpec((tile_cols, tile_rows), lambda i, j: (j, i)), (cols, rows)
    n = branches
    spec = pl.BlockSpec((n, tile_cols // n, tile_rows), lambda i, j: (0, j, i))
    return spec, (n, cols // n, rows)


def _pallas(g, scale, fmt: Fp8Format, interpret: bool = False, column_sums: bool = True,
            branches: int = 1):  # fmt: skip
    q, qt, *partial_sums, partial_maxima = _pallas_partials(g, scale, fmt, interpret, column_sums,
                                                            branches)  # fmt: skip
    return q, qt, summed_partials(partial_sums), jnp.max(partial_maxima)


def summed_partials(partial_sums: list) -> jax.Array | None:
    """The column sums from a kernel's outputs after q and q_t: [] without sums, else [partials]."""
    return jnp.sum(partial_sums[0], axis=0) if partial_sums else None


def _xla(g, scale, fmt: Fp8Format, column_sums: bool = True, branches: int = 1):
    if isinstance(g, Interleaved):
        g = g.joined()
    q = quantize_with_scale(g, fmt, scale).data
    g32 = g.astype(jnp.float32)
    sums = jnp.sum(g32, axis=0) if column_sums else None
    return q, branch_major(q, branches), sums, jnp.max(jnp.abs(g32))


def xla_partials(g, scale, fmt: Fp8Format, tile: tuple[int, int] | None = None,
                 column_sums: bool = True, branches: int = 1):  # fmt: skip
    """:func:`_pallas_partials`'s values from XLA: sums per tile of rows, one maximum per tile.

    ``tile``: the kernel's (rows, columns) tile; :func:`_tile` by default.
    ``column_sums`` False: no sums, as from the kernel. ``branches``: as
    the kernel's (:func:`branch_major`).
    """
    tile = tile or _tile(g)
    if isinstance(g, Interleaved):
        g = g.joined()
    q = quantize_with_scale(g, fmt, scale).data
    q_t = branch_major(q, branches)
    g32 = g.astype(jnp.float32)
    maxima = tile_maxima(g32, tile)
    if not column_sums:
        return q, q_t, maxima
    sums = jnp.sum(g32.reshape(g.shape[0] // tile[0], tile[0], g.shape[1]), axis=1)
    return q, q_t, sums, maxima


def tile_maxima(x: jax.Array, tile: tuple[int, int]) -> jax.Array:
    """``max |x|`` of each ``tile`` of a 2-D ``x``: what the kernels' :func:`tile_max` write."""
    rows, cols = x.shape
    blocks = x.reshape(rows // tile[0], tile[0], cols // tile[1], tile[1])
    return jnp.max(jnp.abs(blocks), axis=(1, 3))


def cast_transpose(
    g: jax.Array | Interleaved, scale: jax.Array, fmt: Fp8Format, row_axes: tuple[str, ...] = (),
    *, column_sums: bool = True, branches: int = 1,
) -> CastTransposed:  # fmt: skip
    """The saturating FP8 cast of a 2-D ``g`` at ``scale``, its transpose, column sums and maxima.

    ``q`` holds exactly the bytes of ``quantize_with_scale(g, fmt, scale).data``;
    the column sums are f32 sums of ``g`` over its rows; the maxima, of
    ``|g|`` per tile, have ``max |g|`` as their maximum (delayed scaling's
    history entry, taken in the same pass and reduced where the history is
    updated; a scalar where XLA computes it). ``g``'s shape
    must split into whole tiles (:func:`tiles_fit`); an :class:`Interleaved`
    ``g`` is read from its pieces, each of whose widths must be whole tiles.
    ``row_axes``: mesh axes (of the mesh in context, ``Auto``) that split
    ``g``'s rows and nothing else: each device then casts its own rows.
    With the kernel switched off (:func:`fp8jax.kernels.enabled`) XLA computes the same
    values on every platform. ``column_sums`` False: ``column_sums`` is None,
    and the kernel does not compute them (a bias's gradient needs them; a
    GEMM's input or kernel does not, and they cost the kernel 6-12% on the
    H200; docs/design.md#cast-and-transpose-in-one-kernel). ``branches``
    2: ``g``'s columns are a gated pair's, interleaved, and ``q_t`` is
    branch-major (:func:`branch_major`), each branch's rows together; ``q``
    stays as ``g``.
    """
    _check_branches(branches)
    if branches != 1 and isinstance(g, Interleaved):
        raise ValueError(f"a gradient in pieces has one branch, got branches={branches}.")
    shards = dispatch.devices_along(row_axes)
    if not fits(g, shards):
        tile_rows, tile_cols = _tile(g)
        if row_axes and fits(g):
            raise ValueError(
                f"g's {g.shape[0]} rows split over mesh axes {tuple(row_axes)} ({shards} "
                f"devices) must leave each device a multiple of {tile_rows} rows."
            )
        if isinstance(g, Interleaved):
            raise ValueError(
                f"g's pieces must have widths (columns per period) multiples of {tile_cols} "
                f"and rows a multiple of {tile_rows}, got {g.shape[0]} rows and widths "
                f"{g.widths}."
            )
        raise ValueError(
            f"g must be 2-D with rows a multiple of {BLOCK_ROWS} and columns a multiple of "
            f"{BLOCK_COLS}, got shape {g.shape}."
        )
    if not dispatch.enabled():
        return CastTransposed(*_xla(g, scale, fmt, column_sums, branches))
    kwargs = {"fmt": fmt, "column_sums": column_sums, "branches": branches}
    outputs = dispatch.on_each_device(
        functools.partial(_pallas_partials, **kwargs), functools.partial(xla_partials, **kwargs),
        (g, scale.astype(jnp.float32)), 1,
        ("rows", "columns", *["rows"] * column_sums, "rows"), tuple(row_axes),
    )  # fmt: skip
    q, q_t, *partial_sums, maxima = outputs
    return CastTransposed(q, q_t, summed_partials(partial_sums), maxima)

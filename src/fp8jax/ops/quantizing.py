"""The one entry point that quantizes a GEMM operand: :func:`quantize_operand`.

Every op quantizes its operands here, under every recipe, and gets a
:class:`~fp8jax.ops.operand.QuantizedOperand` back whose ``scale_inv``'s
shape says what one scale covers. The per-tensor recipes' passes are
below; a fine-grained recipe's operand (per row, per tile, per block, MX)
goes to :func:`fp8jax.ops.fine_quantize.quantize` by the granularity the
recipe declares for its ``role``. What the caller says
about the operand (does a GEMM read it transposed, are its rows tokens,
does it need column sums, is its value costly to compute) picks the pass;
whether the Pallas cast kernel writes it is decided first, once, by
:func:`fp8jax.kernels.dispatch.decide`, and the pass follows that decision.

The scale is the stored one under delayed scaling (``state``), or comes
from the operand's own amax under current scaling (``state`` None).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.formats import Fp8Format
from fp8jax.kernels import cast_transpose, dispatch
from fp8jax.ops import _partitioning, fine_quantize
from fp8jax.ops.operand import QuantizedOperand, from_kernel, inverse
from fp8jax.ops.split import SplitGradient
from fp8jax.quantize import amax, quantize_with_scale
from fp8jax.recipes import PER_TENSOR, Recipe
from fp8jax.scaling import ScaleState, scale_from_amax


@dataclasses.dataclass(frozen=True)
class Recomputed:
    """A value :func:`quantize_operand` computes itself: ``compute(x, *shared)`` in ``dtype``.

    For delayed scaling's cast of costly math (an activation) where XLA
    computes it, with no high-precision copy in HBM
    (docs/design.md#the-activation-cast-where-it-is-computed).
    """

    compute: Callable
    x: jax.Array
    shared: tuple
    dtype: jnp.dtype


def quantize_operand(
    value: jax.Array | SplitGradient | Recomputed,
    fmt: Fp8Format,
    state: ScaleState | None,
    recipe: Recipe,
    *,
    role: str | None = None,
    rows_ndim: int | None = None,
    transpose: bool = False,
    rows_are_tokens: bool = False,
    column_sums: bool = False,
    stored: bool = False,
    transposed_branches: int = 1,
) -> QuantizedOperand:
    """Quantizes one GEMM operand, with its scale from ``state`` or (None) its own amax.

    Args:
      value: the operand; a :class:`~fp8jax.ops.split.SplitGradient` is read
        from its pieces where the cast kernel runs, and joined elsewhere; a
        :class:`Recomputed` is computed here (delayed scaling only).
      fmt, state, recipe: the FP8 format, the operand's ScaleState (None
        under current scaling) and the recipe.
      role: the operand's role in its GEMM (``"x"``, ``"kernel"`` or
        ``"grad"``), whose granularity the recipe declares
        (:meth:`fp8jax.recipes.RowwiseScaling.granularity`). Needed under a
        fine-grained recipe, whose operand comes as a (batch, rows, K)
        array and is quantized by :func:`_fine`; None: per tensor.
      rows_ndim: ``value``'s leading axes that are its rows, the rest its
        columns: for the transposed copy and the column sums.
      transpose: a GEMM reads the operand transposed to (columns, rows).
        Where :func:`fp8jax.kernels.dispatch.decide` lets the cast kernel run
        (:mod:`fp8jax.kernels.cast_transpose`, which needs whole tiles), it
        writes that copy in the same pass
        (docs/design.md#cast-and-transpose-in-one-kernel); elsewhere XLA
        quantizes and the operand has no transposed copy.
      rows_are_tokens: the rows are tokens (an activation or its gradient),
        which data parallelism splits: the kernel may then run on each
        device's rows (:func:`fp8jax.kernels.dispatch.decide`).
      column_sums: also sum ``value`` over its rows in f32 (a bias's
        gradient). XLA's pass for an unstored value then takes the amax as
        column maxima, so that one pass computes both
        (docs/design.md#the-bias-gradient-in-the-gradients-quantize-pass).
      stored: ``value``'s math is too costly to compute twice (an
        activation's gradient): it is written once, in its own dtype, and
        read back by the quantize pass (:func:`_stored`).
      transposed_branches: 2 for a gated pair's interleaved columns (last
        axis 2): the kernel's transposed copy is then branch-major
        (:func:`fp8jax.kernels.cast_transpose.branch_major`), (2 * columns / 2,
        rows), what kernel_1's wgrad reads to write the parameter's layout.

    Returns:
      A :class:`~fp8jax.ops.operand.QuantizedOperand`, its ``scale_inv``
      shaped by the granularity: () per tensor, (B, R, 1) per row,
      (B, R, K / t) per 1 x t tile (MX: t = 32, powers of two, E8M0 on the
      GPU), (B, R / 128, K / 128) per block.
    """
    granularity = PER_TENSOR if role is None else recipe.granularity(role)
    if granularity != PER_TENSOR:
        plain = not isinstance(value, (SplitGradient, Recomputed))
        if state is not None or rows_ndim is not None or column_sums or stored or not plain:
            state_text = "None" if state is None else "a ScaleState"
            raise ValueError(
                f"quantize_operand: a {type(recipe).__name__} operand is a plain (batch, rows, K) "
                "array, with no state, rows_ndim, column_sums or stored; got "
                f"value={type(value).__name__}, state={state_text}, rows_ndim={rows_ndim}, "
                f"column_sums={column_sums}, stored={stored}."
            )
        return _fine(value, fmt, recipe, granularity, transpose, rows_are_tokens)
    if recipe.granularity("x") != PER_TENSOR:
        raise ValueError(
            f"quantize_operand: {type(recipe).__name__} scales finer than per tensor, so it needs "
            "the operand's role= ('x', 'kernel' or 'grad'); got role=None."
        )
    if isinstance(value, Recomputed):
        if transpose or column_sums or stored or state is None:
            raise ValueError(
                "quantize_operand: a Recomputed value is cast with delayed scaling's stored scale "
                f"and nothing else; got state={'None' if state is None else 'a ScaleState'}, "
                f"transpose={transpose}, column_sums={column_sums}, stored={stored}."
            )
        return _recomputed(value, fmt, state, recipe)
    if (transpose or column_sums) and rows_ndim is None:
        raise ValueError("quantize_operand: transpose and column_sums need rows_ndim, got None.")
    if transposed_branches != 1 and (not transpose or value.shape[-1] != transposed_branches):
        raise ValueError(
            f"quantize_operand: transposed_branches={transposed_branches} needs transpose=True "
            f"and a last axis of that size, got transpose={transpose} and shape {value.shape}."
        )
    placement = _cast_placement(value, rows_ndim, rows_are_tokens) if transpose else dispatch.XLA
    if placement.kernel:
        return _cast_transposed(value, fmt, state, recipe, rows_ndim, placement.row_axes,
                                column_sums, transposed_branches)  # fmt: skip
    if isinstance(value, SplitGradient):
        value = value.joined()
    if stored:
        return _stored(value, fmt, state, recipe, rows_ndim if column_sums else None)
    if column_sums:
        return _with_column_sums(value, fmt, state, recipe, value.ndim - rows_ndim)
    x_amax = _partitioning.reduce_amax(amax(value), recipe)
    return QuantizedOperand(quantize_with_scale(value, fmt, _scale(x_amax, fmt, state, recipe)),
                            x_amax)  # fmt: skip


def _fine(value: jax.Array, fmt: Fp8Format, recipe: Recipe, granularity, transpose: bool,
          rows_are_tokens: bool) -> QuantizedOperand:  # fmt: skip
    """A fine-grained recipe's operand (B, R, K), scaled per ``granularity`` from its own values.

    These recipes keep no state. MXFP8Scaling has no margin: its scales are the
    smallest powers of two that keep each block in range. Column maxima
    (the transposed copy's, over token rows) are max-reduced over the
    recipe's ``amax_reduction_axes`` inside ``shard_map``; row maxima never
    are: a row lies on one device.
    """
    reduce = None
    if getattr(recipe, "amax_reduction_axes", ()):
        reduce = functools.partial(_partitioning.reduce_amax, recipe=recipe)
    return fine_quantize.quantize(value, fmt, granularity, getattr(recipe, "margin", 0),
                                  transpose=transpose, rows_are_tokens=rows_are_tokens,
                                  reduce_column_amax=reduce)  # fmt: skip


def amax_for_update(maxima: jax.Array, recipe: Recipe) -> jax.Array:
    """Delayed scaling's amax, for the state's update, from ``maxima`` (whose maximum it is).

    Where arrays are whole on each device the maxima go to the update as
    they are: :func:`fp8jax.scaling.update_group` reduces them with the
    histories, in one kernel for all of an op's tensors. Elsewhere they are
    reduced here, to a local maximum and an all-reduce: the update stacks
    and pads its inputs, for which the partitioner gathered sharded maxima
    in f32 (8 host devices, tensor parallelism).
    """
    if not dispatch.is_local():
        maxima = jnp.max(maxima)
    return _partitioning.reduce_amax(maxima, recipe)


def current_amax_and_scale(maxima: jax.Array, fmt: Fp8Format, recipe: Recipe):
    """Current scaling's ``(amax, scale)`` from a kernel's partial ``maxima``, over every device.

    For a kernel that needs the scale before it casts: ``maxima`` from a pass
    of its own (the norm's, docs/design.md#the-norms-forward-and-its-fp8-cast-in-one-kernel),
    or the magnitudes of a value XLA computes to reduce them (the
    activation's, docs/design.md#the-activation-inside-the-cast-kernels).
    """
    value_amax = _partitioning.reduce_amax(jnp.max(maxima), recipe)
    return value_amax, _scale(value_amax, fmt, None, recipe)


def _scale(x_amax, fmt: Fp8Format, state: ScaleState | None, recipe: Recipe) -> jax.Array:
    if state is None:
        return scale_from_amax(x_amax, fmt.max, recipe.margin, fallback=1.0)
    return state.scale


def _pinned(value, fmt: Fp8Format, state: ScaleState | None, recipe: Recipe):
    """``(value, amax, scale)``: the amax taken where ``value`` is written (:func:`_stored`).

    ``value`` may be a :class:`~fp8jax.ops.split.SplitGradient`, pinned piece by piece.
    """
    pieces = value.pieces if isinstance(value, SplitGradient) else (value,)
    value_amax = _partitioning.reduce_amax(functools.reduce(jnp.maximum, map(amax, pieces)),
                                           recipe)  # fmt: skip
    pieces = lax.optimization_barrier(pieces)
    if isinstance(value, SplitGradient):
        value = SplitGradient(pieces, value.axis)
    else:
        (value,) = pieces
    return value, value_amax, _scale(value_amax, fmt, state, recipe)


def _stored(value, fmt: Fp8Format, state, recipe: Recipe, sum_rows_ndim: int | None):
    """Quantizes ``value``, which is written to HBM once, in its own dtype.

    Left to itself, XLA writes an f32 intermediate of costly math (an
    activation's gradient) instead and, when the backward recomputes the
    same math, keeps it alive until then. The optimization barrier pins the
    one write to ``value``: the amax comes out of the fusion that computes
    it, and the quantize pass and the column sums read it back
    (docs/design.md#the-activation-cast-where-it-is-computed).
    """
    value, value_amax, scale = _pinned(value, fmt, state, recipe)
    q = quantize_with_scale(value, fmt, scale)
    sums = None
    if sum_rows_ndim is not None:
        sums = jnp.sum(value.astype(jnp.float32), axis=tuple(range(sum_rows_ndim)))
    return QuantizedOperand(q, value_amax, column_sums=sums)


def _with_column_sums(g, fmt: Fp8Format, state, recipe: Recipe, bias_ndim: int):
    """XLA's pass for an output gradient and its bias's gradient: column maxima and sums.

    The bias gradient is a sum over ``g``'s leading axes, a column
    reduction. Taking the amax as column maxima too lets XLA compute both,
    and under delayed scaling the FP8 copy, in one pass over ``g``; row
    maxima and a column sum are two reductions XLA cannot put in one
    kernel. The sum is in f32 where JAX's gradient of a bf16 bias add sums
    in bf16. Under delayed scaling the amax comes as column maxima.
    """
    leading = tuple(range(g.ndim - bias_ndim))
    g32 = g.astype(jnp.float32)
    if g.size == 0:  # an empty batch, or an empty bias: zero sums, amax 0 (no information)
        g_amax = _partitioning.reduce_amax(amax(g), recipe)
        q = quantize_with_scale(g, fmt, _scale(g_amax, fmt, state, recipe))
        return QuantizedOperand(q, g_amax, column_sums=jnp.zeros(g.shape[len(leading):],
                                                                 jnp.float32))  # fmt: skip
    # The barrier keeps XLA from merging the two maxima into one full
    # reduction, which it computes apart from the column sum.
    column_max = lax.optimization_barrier(jnp.max(jnp.abs(g32), axis=leading))
    if state is None:
        g_amax = _partitioning.reduce_amax(jnp.max(column_max), recipe)
    else:  # the update reduces the maxima (fp8jax.scaling.update_group)
        g_amax = amax_for_update(column_max, recipe)
    q = quantize_with_scale(g, fmt, _scale(g_amax, fmt, state, recipe))
    return QuantizedOperand(q, g_amax, column_sums=jnp.sum(g32, axis=leading))


def _recomputed(value: Recomputed, fmt: Fp8Format, state: ScaleState, recipe: Recipe):
    """Delayed scaling: the cast fused into the kernel that computes the value, without a copy.

    The stored scale is known before the value is, so no high-precision
    copy reaches HBM (:func:`_stored` writes one, which current scaling
    needs). One kernel cannot also take the amax: XLA will not feed costly
    math (an activation's tanh) to two consumers without writing it out in
    f32. So the amax comes from a second evaluation on ``x`` behind an
    optimization barrier, which XLA can neither merge with the first nor
    share with a backward recompute (the scale in the barrier keeps it apart
    from the backward's own barrier on ``x``).

    ``shared`` inputs (an activation's bias) stay common to both
    evaluations, and through them XLA puts the two in one kernel (GeGLU), or
    the amax into the backward kernel that reads the same inputs (gelu).
    Without a shared input it runs them as two kernels, which measured
    slower than :func:`_stored`; callers use this only with one.
    """
    compute, x, shared, dtype = value.compute, value.x, value.shared, value.dtype
    computed = compute(x, *shared).astype(dtype)
    x_again, _ = lax.optimization_barrier((x, state.scale))
    value_amax = _partitioning.reduce_amax(amax(compute(x_again, *shared).astype(dtype)), recipe)
    return QuantizedOperand(quantize_with_scale(computed, fmt, state.scale), value_amax)


def _as_matrix(value, rows_ndim: int) -> jax.Array | cast_transpose.Interleaved:
    """``value`` as the (rows, columns) matrix cast_transpose reads: from its pieces, if split."""
    if isinstance(value, SplitGradient):
        return value.interleaved(rows_ndim)
    return value.reshape(math.prod(value.shape[:rows_ndim]), -1)


def _cast_placement(value, rows_ndim: int, rows_are_tokens: bool) -> dispatch.Placement:
    """Where the cast kernel writes ``value`` and its transposed copy: the dispatcher's decision.

    A kernel's transposed copy is only read where arrays are whole on each
    device (:func:`fp8jax.ops.gemm.as_kernel_matrices`), so for a kernel
    (``rows_are_tokens`` False) it runs only there.
    """
    if math.prod(value.shape) == 0:  # a SplitGradient has a shape but no size
        return dispatch.XLA  # no tiles to fill; XLA's pass handles empty arrays
    # The matrix view is taken only once the mesh allows the kernel: Explicit
    # mesh axes refuse some reshapes.
    return dispatch.decide(
        lambda shards: cast_transpose.fits(_as_matrix(value, rows_ndim), shards),
        rows_are_tokens=rows_are_tokens,
    )


def _cast_transposed(value, fmt: Fp8Format, state, recipe: Recipe, rows_ndim: int,
                     row_axes: tuple[str, ...], column_sums: bool,
                     branches: int = 1) -> QuantizedOperand:  # fmt: skip
    """The cast kernel's pass: ``value`` and its transposed copy in FP8, and column sums if asked.

    Under delayed scaling the kernel also takes the amax, as per-tile
    maxima: the state's update reduces them with the histories, in one
    kernel for all of an op's tensors (:func:`fp8jax.scaling.update_group`).
    """
    if state is None:
        # Current scaling needs the amax before the cast: take it where value
        # is written (_stored).
        value, value_amax, scale = _pinned(value, fmt, state, recipe)
    else:
        scale = state.scale
    out = cast_transpose.cast_transpose(_as_matrix(value, rows_ndim), scale, fmt, row_axes,
                                        column_sums=column_sums, branches=branches)  # fmt: skip
    if state is not None:
        value_amax = amax_for_update(out.maxima, recipe)
    scale_inv = inverse(scale)
    q = out.q.reshape(value.shape)
    sums = None if out.column_sums is None else out.column_sums.reshape(value.shape[rows_ndim:])
    return from_kernel(q, scale_inv, fmt, value_amax, transposed=out.q_t, column_sums=sums)

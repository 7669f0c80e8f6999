"""FP8 dot_general and dense: FP8-typed operands straight into ``lax.dot_general``.

XLA's quantize->dequantize pattern matcher runs after Triton GEMM fusion and
simplifies the round trip away (zero FP8 GEMMs from it in a transformer
layer; docs/design.md#why-fp8-operands-go-straight-into-dot_general), so
nothing here relies on it: the operands handed to ``lax.dot_general`` are
already E4M3/E5M2 arrays, and the product is rescaled by
``scale_inv_lhs * scale_inv_rhs``, a scalar XLA folds into the cuBLASLt call.

Forward: x(E4M3) . w(E4M3). Backward: dgrad g(E5M2) . w(E4M3) and wgrad
x(E4M3) . g(E5M2). E5M2 x E5M2, which cuBLASLt rejects, never occurs. Only
the FP8 operands (1 byte per element) are saved for the backward.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8jax.formats import Fp8Format, is_fp8
from fp8jax.kernels import dispatch
from fp8jax.ops import _partitioning, cast_transpose, dimensions, fine_grained
from fp8jax.ops.split import Split, SplitGradient, make_split
from fp8jax.quantize import Fp8Array, amax, check_high_precision, quantize_with_scale
from fp8jax.recipes import DelayedScaling, Recipe, resolve_recipe
from fp8jax.scaling import DotScaleState, ScaleState, scale_from_amax, update_group


@dataclasses.dataclass(frozen=True)
class DotConfig:
    """Everything static about one FP8 dot_general; the custom_vjp's only static argument."""

    dimension_numbers: dimensions.DimensionNumbers
    recipe: Recipe
    out_dtype: np.dtype
    lhs_dtype: np.dtype
    rhs_dtype: np.dtype
    lhs_ndim: int
    # What each input's cotangent must match: shard_map axes, Explicit sharding.
    inputs: tuple[_partitioning.InputType, ...] = ()
    # Trailing output axes a bias spans (0 without one), and its dtype.
    bias_ndim: int = 0
    bias_dtype: np.dtype | None = None
    split: Split | None = None  # dense's output returned in pieces


def quantize_operand(
    x: jax.Array, fmt: Fp8Format, state: ScaleState | None, recipe
) -> tuple[Fp8Array, jax.Array]:
    """Quantizes with the stored scale (delayed) or ``x``'s own amax (current)."""
    x_amax = _partitioning.reduce_amax(amax(x), recipe)
    return quantize_with_scale(x, fmt, _scale(x_amax, fmt, state, recipe)), x_amax


def _scale(x_amax, fmt: Fp8Format, state: ScaleState | None, recipe) -> jax.Array:
    if state is None:
        return scale_from_amax(x_amax, fmt.max, recipe.margin, fallback=1.0)
    return state.scale


def quantize_computed(
    compute, inputs: tuple, fmt: Fp8Format, state: ScaleState | None, recipe, dtype
) -> tuple[Fp8Array, jax.Array]:
    """Quantizes ``compute(*inputs)``, rounded to ``dtype`` first.

    For a tensor that is cheap to compute inside an op (the normalized
    input): XLA fuses the computation into both the amax and the quantize
    pass, so the value never reaches HBM in high precision. Costly math (an
    activation) goes through :func:`quantize_stored` instead.
    """
    return quantize_operand(compute(*inputs).astype(dtype), fmt, state, recipe)


def quantize_stored(
    value: jax.Array, fmt: Fp8Format, state: ScaleState | None, recipe
) -> tuple[Fp8Array, jax.Array, jax.Array]:
    """Quantizes ``value``, which is written to HBM once, in its own dtype.

    For a tensor whose math is too costly to recompute in both the amax and
    the quantize pass: an activation (its f32 math) and its gradient.
    Left to itself, XLA writes an f32 intermediate of that math instead and,
    when the backward recomputes the same math, keeps it alive until then.
    The optimization barrier pins the one write to ``value``: the amax comes
    out of the fusion that computes it, and the quantize pass reads it back.
    Measured for ``layernorm_mlp`` fwd+bwd (SwiGLU, 16384 tokens, hidden
    4096, ffn 16384): the HBM traffic of a deviceless H200 compile fell from
    20.9 to 16.4 GiB, and on the H200 the block went from 1.55x to 1.68x
    BF16 (delayed scaling).

    Returns ``(q, amax, value)``, ``value`` as stored, for other readers.
    """
    value, value_amax, scale = _pinned(value, fmt, state, recipe)
    return quantize_with_scale(value, fmt, scale), value_amax, value


def _pinned(value, fmt: Fp8Format, state: ScaleState | None, recipe):
    """``(value, amax, scale)``: the amax taken where ``value`` is written (quantize_stored).

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


def quantize_transposed(
    value: jax.Array, fmt: Fp8Format, state: ScaleState | None, recipe, rows_ndim: int,
    *, rows_are_tokens: bool = False, column_sums: bool = False,
) -> tuple[Fp8Array, Fp8Array, jax.Array, jax.Array | None] | None:  # fmt: skip
    """Quantizes ``value`` in one pass that also writes its transposed FP8 copy (and column sums).

    ``value``'s leading ``rows_ndim`` axes are its rows, the rest its
    columns. cuBLASLt's FP8 GEMMs read both operands with the contracting
    axis minor, so a kernel feeds its forward GEMM transposed and its dgrad
    GEMM as itself, and an output gradient feeds its dgrad GEMM as itself
    and its wgrad GEMM transposed. Left to XLA, the cast and the transpose
    are two kernels (with the bias sums and amax in a third or in the cast's);
    here they are one (:func:`fp8jax.ops.cast_transpose.cast_transpose`),
    which under delayed scaling also takes the amax. That kernel needs whole
    tiles, and can be switched off (``FP8JAX_PALLAS=0``); where it does not
    run this returns None and the caller quantizes with XLA. On the H200 it
    shortened the MLP blocks' and the transformer layer's steps
    (docs/design.md#cast-and-transpose-in-one-kernel).

    ``rows_are_tokens``: ``value`` is an activation or its gradient, whose
    token rows data parallelism splits. Where only data parallelism splits
    arrays (:func:`fp8jax.sharding.data_parallel_axes`), the kernel then runs
    on each device's rows. A kernel's transposed copy is only read where
    arrays are whole on each device (:func:`_as_kernel_matrices`), so for a
    kernel it runs only there.

    A :class:`~fp8jax.ops.split.SplitGradient` ``value`` is read from its
    pieces, where every piece's share of a row fills whole kernel tiles.

    ``column_sums``: also sum ``value`` over its rows (a bias's gradient).

    Returns ``(q, q_t, amax, column_sums)``: ``q`` in ``value``'s shape, ``q_t``
    as (columns, rows), ``column_sums`` (f32) in the columns' shape, or None
    unless asked for. Under delayed scaling ``amax`` is the kernel's per-tile
    maxima, whose maximum is the amax: the state's update reduces them with
    the histories, in one kernel for all of an op's tensors
    (:func:`fp8jax.scaling.update_group`).
    """
    if math.prod(value.shape) == 0:  # a SplitGradient has a shape but no size
        return None  # no tiles to fill; the XLA path handles empty arrays
    row_axes = cast_kernel_row_axes(rows_are_tokens)
    if row_axes is None:
        return None  # before any reshape: Explicit mesh axes refuse some
    shards = dispatch.devices_along(row_axes)
    if not cast_transpose.fits(_as_matrix(value, rows_ndim), shards):
        return None
    if state is None:
        # Current scaling needs the amax before the cast: take it where value
        # is written (quantize_stored).
        value, value_amax, scale = _pinned(value, fmt, state, recipe)
    else:
        scale = state.scale
    out = cast_transpose.cast_transpose(_as_matrix(value, rows_ndim), scale, fmt, row_axes,
                                        column_sums=column_sums)  # fmt: skip
    if state is not None:
        value_amax = amax_for_update(out.maxima, recipe)
    scale_inv = 1.0 / scale.astype(jnp.float32)  # as quantize_with_scale computes it
    return (
        Fp8Array(out.q.reshape(value.shape), scale_inv, fmt),
        Fp8Array(out.q_t, scale_inv, fmt),
        value_amax,
        None if out.column_sums is None else out.column_sums.reshape(value.shape[rows_ndim:]),
    )


def amax_for_update(maxima: jax.Array, recipe) -> jax.Array:
    """Delayed scaling's amax, for the state's update, from ``maxima`` (whose maximum it is).

    Where arrays are whole on each device the maxima go to the update as
    they are: :func:`fp8jax.scaling.update_group` reduces them with the
    histories, in one kernel for all of an op's tensors. Elsewhere they are
    reduced here, to a local maximum and an all-reduce: the update stacks
    and pads its inputs, for which the partitioner gathered sharded maxima
    in f32 (8 host devices, tensor parallelism).
    """
    if not _kernel_is_local():
        maxima = jnp.max(maxima)
    return _partitioning.reduce_amax(maxima, recipe)


def cast_kernel_row_axes(rows_are_tokens: bool) -> tuple[str, ...] | None:
    """The mesh axes the cast kernel splits its rows over here: () for whole arrays, None for none.

    Token rows split by data parallelism alone go to one kernel per device;
    the decision is :func:`fp8jax.kernels.dispatch.row_axes`'s.
    """
    return dispatch.row_axes(rows_are_tokens)


def _as_matrix(value, rows_ndim: int) -> jax.Array | cast_transpose.Interleaved:
    """``value`` as the (rows, columns) matrix cast_transpose reads: from its pieces, if split."""
    if isinstance(value, SplitGradient):
        return value.interleaved(rows_ndim)
    return value.reshape(math.prod(value.shape[:rows_ndim]), -1)


def quantize_output_gradient(
    g: jax.Array, fmt: Fp8Format, state: ScaleState | None, recipe, rows_ndim: int | None,
    bias_ndim: int = 0,
) -> tuple[Fp8Array, Fp8Array | None, jax.Array, jax.Array | None]:  # fmt: skip
    """Quantizes a GEMM's output gradient for its dgrad and wgrad GEMMs, and sums a bias's.

    ``rows_ndim``: ``g``'s leading (token) axes, which the wgrad GEMM
    contracts, or None for any other wgrad; ``bias_ndim``: the trailing axes
    a bias spans (0 without one). With :func:`quantize_transposed`'s kernel
    the wgrad GEMM gets ``g``'s transposed FP8 copy (pass it to
    :func:`wgrad_over_tokens`); without it, :func:`quantize_gradient`. A
    :class:`~fp8jax.ops.split.SplitGradient` ``g`` is joined first where the
    kernel does not read its pieces.

    Returns ``(g_q, g_t or None, amax, bias_gradient or None)``, the last in f32.
    """
    if rows_ndim is not None and bias_ndim in (0, g.ndim - rows_ndim):
        transposed = quantize_transposed(g, fmt, state, recipe, rows_ndim, rows_are_tokens=True,
                                         column_sums=bias_ndim > 0)  # fmt: skip
        if transposed is not None:
            return transposed
    if isinstance(g, SplitGradient):
        g = g.joined()
    g_q, g_amax, d_bias = quantize_gradient(g, fmt, state, recipe, bias_ndim)
    return g_q, None, g_amax, d_bias


def wgrad_over_tokens(
    lhs: Fp8Array, g: Fp8Array, kernel_shape, dtype, recipe, *, lhs_transposed: bool = False,
    g_transposed: bool = False,
) -> jax.Array:  # fmt: skip
    """``lhs^T . g`` summed over the token axes: the wgrad of a kernel of ``kernel_shape``.

    Each operand comes as itself, tokens leading (``lhs``: tokens x the
    kernel's contracted axes, ``g``: tokens x its free axes), or transposed
    to (features, tokens) by :func:`quantize_transposed`; at least one of
    them transposed. cuBLASLt's FP8 GEMM wants the tokens as the minor axis
    of both, so XLA transposes only an operand that comes as itself.
    """
    if not (lhs_transposed or g_transposed):
        raise ValueError("wgrad_over_tokens needs lhs or g transposed to (features, tokens).")
    total = math.prod(kernel_shape)
    depth = lhs.shape[0] if lhs_transposed else total // g.shape[0]
    lhs_matrix = lhs.data if lhs_transposed else lhs.data.reshape(-1, depth)
    g_matrix = g.data if g_transposed else g.data.reshape(-1, total // depth)
    dims = (((1 if lhs_transposed else 0,), (1 if g_transposed else 0,)), ((), ()))
    return scaled_dot(
        Fp8Array(lhs_matrix, lhs.scale_inv, lhs.format),
        Fp8Array(g_matrix, g.scale_inv, g.format),
        dims, dtype, recipe.wgrad_precision,
    ).reshape(kernel_shape)  # fmt: skip


def backward_dots(
    dims, lhs_ndim: int, lhs_q, rhs_q: Fp8Array, g_q: Fp8Array, lhs_dtype, rhs_dtype, recipe,
    *, lhs_t: Fp8Array | None = None, g_t: Fp8Array | None = None,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """dgrad and wgrad of ``dot_general(lhs, rhs, dims)``, both FP8.

    ``lhs_t``, ``g_t``: lhs's and the gradient's FP8 copies transposed to
    (features, tokens), where :func:`quantize_transposed` made them; only
    when ``dims`` contract lhs's trailing axes against the kernel's leading
    ones (:func:`kernel_contraction`). The wgrad GEMM then reads them as
    they are (:func:`wgrad_over_tokens`); with ``lhs_t``, ``lhs_q`` may be None.
    """
    d_lhs = dgrad_dot(dims, lhs_ndim, rhs_q, g_q, lhs_dtype, recipe,
                      like=None if lhs_q is None else lhs_q.data)  # fmt: skip
    if lhs_t is None and g_t is None:
        wg = dimensions.wgrad(dims, lhs_ndim, rhs_q.data.ndim)
        d_rhs = scaled_dot(lhs_q, g_q, wg.dimension_numbers, rhs_dtype, recipe.wgrad_precision,
                           wg.permutation, like=rhs_q.data)  # fmt: skip
        return d_lhs, d_rhs
    d_rhs = wgrad_over_tokens(
        lhs_q if lhs_t is None else lhs_t, g_q if g_t is None else g_t, rhs_q.shape, rhs_dtype,
        recipe, lhs_transposed=lhs_t is not None, g_transposed=g_t is not None,
    )  # fmt: skip
    return d_lhs, d_rhs


def dgrad_dot(dims, lhs_ndim: int, rhs_q: Fp8Array, g_q: Fp8Array, lhs_dtype, recipe, like=None):
    """The dgrad GEMM of ``dot_general(lhs, rhs, dims)``: lhs's gradient, in ``lhs_dtype``."""
    dg = dimensions.dgrad(dims, lhs_ndim, rhs_q.data.ndim)
    return scaled_dot(g_q, rhs_q, dg.dimension_numbers, lhs_dtype, recipe.dgrad_precision,
                      dg.permutation, like=like)  # fmt: skip


def quantize_in_both_layouts(
    value: jax.Array, fmt: Fp8Format, state: ScaleState | None, recipe, rows_ndim: int | None,
    *, rows_are_tokens: bool = False,
) -> tuple[Fp8Array, Fp8Array | None, jax.Array]:  # fmt: skip
    """Quantizes a GEMM operand that its two GEMMs read in different layouts.

    A kernel contracted on its leading axes (``rows_ndim`` of them) is read
    transposed by the forward GEMM and as itself by the dgrad GEMM; an input
    contracted on its trailing axes (``rows_ndim`` the leading, token axes)
    as itself by the forward GEMM and transposed by the wgrad GEMM.
    ``rows_ndim`` None: the operand is contracted otherwise
    (:func:`kernel_contraction`). ``rows_are_tokens``: the input's case
    (:func:`quantize_transposed`).

    Returns ``(q, q_t, amax)``: ``q_t`` the (columns, rows) copy from
    :func:`quantize_transposed`'s kernel, or None where it does not run; a
    kernel's then goes to :func:`scaled_dot` as ``kernel_t``.
    """
    transposed = None
    if rows_ndim is not None:
        transposed = quantize_transposed(value, fmt, state, recipe, rows_ndim,
                                         rows_are_tokens=rows_are_tokens)  # fmt: skip
    if transposed is None:
        q, value_amax = quantize_operand(value, fmt, state, recipe)
        return q, None, value_amax
    q, q_t, value_amax, _ = transposed
    return q, q_t, value_amax


def quantize_recomputed(
    compute, x: jax.Array, shared: tuple, fmt: Fp8Format, state: ScaleState, recipe, dtype
) -> tuple[Fp8Array, jax.Array]:
    """Delayed scaling: quantizes ``compute(x, *shared)`` (rounded to ``dtype``) without a copy.

    The stored scale is known before the value is, so the FP8 cast fuses
    into the kernel that computes the value and no high-precision copy
    reaches HBM (:func:`quantize_stored` writes one, which current scaling
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
    slower than :func:`quantize_stored`; callers use this only with one
    (docs/design.md#the-activation-cast-where-it-is-computed).

    Returns ``(q, amax)``.
    """
    value = compute(x, *shared).astype(dtype)
    x_again, _ = lax.optimization_barrier((x, state.scale))
    value_amax = _partitioning.reduce_amax(amax(compute(x_again, *shared).astype(dtype)), recipe)
    return quantize_with_scale(value, fmt, state.scale), value_amax


def quantize_gradient(
    g: jax.Array, fmt: Fp8Format, state: ScaleState | None, recipe, bias_ndim: int = 0
) -> tuple[Fp8Array, jax.Array, jax.Array | None]:
    """Quantizes an output gradient ``g`` and, with a bias, sums the bias's gradient.

    ``bias_ndim``: how many trailing axes of ``g`` the bias spans (0: no bias).
    The bias gradient is a sum over ``g``'s leading axes, a column reduction.
    Taking the amax as column maxima too lets XLA compute both, and under
    delayed scaling the FP8 copy, in one pass over ``g``; row maxima and a
    column sum are two reductions XLA cannot put in one kernel
    (docs/design.md#the-bias-gradient-in-the-gradients-quantize-pass).
    The sum is in f32 where JAX's gradient of a bf16 bias add sums in bf16.

    Returns ``(q, amax, bias_gradient)``, the last in f32, or None without a bias.
    Under delayed scaling the amax may come as maxima (:func:`quantize_transposed`).
    """
    if bias_ndim == 0:
        return (*quantize_operand(g, fmt, state, recipe), None)
    leading = tuple(range(g.ndim - bias_ndim))
    g32 = g.astype(jnp.float32)
    if g.size == 0:  # an empty batch, or an empty bias: zero sums, amax 0 (no information)
        q, g_amax = quantize_operand(g, fmt, state, recipe)
        return q, g_amax, jnp.zeros(g.shape[g.ndim - bias_ndim :], jnp.float32)
    # The barrier keeps XLA from merging the two maxima into one full
    # reduction, which it computes apart from the column sum.
    column_max = lax.optimization_barrier(jnp.max(jnp.abs(g32), axis=leading))
    if state is None:
        g_amax = _partitioning.reduce_amax(jnp.max(column_max), recipe)
    else:  # the update reduces the maxima (fp8jax.scaling.update_group)
        g_amax = amax_for_update(column_max, recipe)
    q = quantize_with_scale(g, fmt, _scale(g_amax, fmt, state, recipe))
    return q, g_amax, jnp.sum(g32, axis=leading)


def scaled_dot(
    a: Fp8Array, b: Fp8Array, dims, out_dtype, precision, permutation=None, like=None,
    kernel_t: Fp8Array | None = None,
) -> jax.Array:  # fmt: skip
    """``dot_general(a.data, b.data) * a.scale_inv * b.scale_inv`` in ``out_dtype``.

    ``like``: for a gradient, its primal, whose sharding it takes over
    Explicit mesh axes (see :mod:`fp8jax.ops._partitioning`). ``kernel_t``:
    ``b`` as the (free, contracted) matrix, from :func:`quantize_in_both_layouts`.
    """
    b_t = None if kernel_t is None else kernel_t.data
    matrices = _as_kernel_matrices(a.data, b.data, dims, b_t)
    if matrices is None:
        a_data, b_data, gemm_dims, out_shape = a.data, b.data, dims, None
    else:
        a_data, b_data, out_shape = matrices
        gemm_dims = (((a_data.ndim - 1,), (1,)), ((), ()))
    out_sharding = _partitioning.dot_out_sharding(a_data, b_data, gemm_dims, like, permutation)
    y = lax.dot_general(
        a_data, b_data, gemm_dims, precision=precision, preferred_element_type=out_dtype,
        out_sharding=out_sharding,
    )  # fmt: skip
    if out_shape is not None:
        y = y.reshape(out_shape)
    y = y * (a.scale_inv * b.scale_inv).astype(out_dtype)
    return y if permutation is None else jnp.transpose(y, permutation)


def kernel_contraction(dims, a_ndim: int, kernel_ndim: int) -> int | None:
    """How many leading kernel axes ``dims`` contracts against ``a``'s trailing ones, or None.

    None for any other form: batch axes, a kernel with no free axis, no
    contracted axis (an outer product: the backward of a rank-1 operand's
    dot), or contracted axes elsewhere.
    """
    (a_contract, k_contract), (a_batch, k_batch) = dims
    n = len(k_contract)
    if a_batch or k_batch or kernel_ndim == n or n == 0:
        return None
    if tuple(k_contract) != tuple(range(n)):
        return None
    if tuple(a_contract) != tuple(range(a_ndim - n, a_ndim)):
        return None
    return n


def _as_kernel_matrices(a: jax.Array, kernel: jax.Array, dims, kernel_t=None):
    """``(a, kernel)`` as a matrix product with the kernel transposed in the program, or None.

    cuBLASLt's FP8 GEMM takes only operands whose contracting axis is minor
    in memory, so a kernel contracted on its leading axes (every forward
    GEMM) needs a transposed FP8 copy. Left to XLA (jaxlib 0.11.2), the GEMM
    rewriter makes it with an untiled ``kLoop`` transpose between ``{0,1}``
    layouts at about 0.3 TB/s on the H200, where tiled transposes move FP8 at
    about 2.4 TB/s.
    Here the kernel is viewed as a (contracting, free) matrix and transposed
    explicitly; the optimization barrier keeps the algebraic simplifier from
    folding the transpose back into the dot. XLA then writes the transposed
    copy from the quantize fusion itself
    (docs/design.md#the-forward-kernel-transposed-in-the-program). A transpose
    of the three-dimensional kernel without the matrix view stayed slow: XLA
    gave it a layout that made it a bitcast. ``kernel_t``, the
    transposed matrix where :func:`quantize_in_both_layouts` made one, is used as is.

    Returns ``(a_matrix, kernel_transposed, result_shape)``, or None when
    the kernel is not contracted on its leading axes against ``a``'s trailing
    ones (:func:`kernel_contraction`), or when it may be sharded
    (:func:`_kernel_is_local`).
    """
    n = kernel_contraction(dims, a.ndim, kernel.ndim)
    if n is None or not _kernel_is_local():
        return None
    depth = math.prod(kernel.shape[:n])
    free = kernel.shape[n:]
    if kernel_t is None:
        kernel_t = lax.optimization_barrier(kernel.reshape(depth, math.prod(free)).T)
    a_matrix = a.reshape(*a.shape[: a.ndim - n], depth) if n > 1 else a
    return a_matrix, kernel_t, (*a.shape[: a.ndim - n], *free)


def _kernel_is_local() -> bool:
    """Whether arrays are whole on each device: every mesh axis manual or of size 1.

    Under a mesh with ``Auto`` or ``Explicit`` axes the kernel's matrix view
    costs collectives. Merging (2, ffn) with ``ffn`` split by tensor
    parallelism is not a block sharding, so GSPMD all-gathers the kernel (8
    host devices); under FSDP, XLA gathers the transposed copy apart from the
    one the backward reads, an FP8 all-gather more per kernel and step
    (``tests/test_train.py``). A ``pallas_call``
    (:mod:`fp8jax.ops.cast_transpose`) has no partitioning rule at all: XLA
    gathers its operands in high precision (the FSDP dense of
    ``tests/verify``), unless it runs inside ``shard_map``
    (:func:`cast_kernel_row_axes`). Inside ``shard_map`` every array is local.

    With no mesh in context (``jax.set_mesh``, :func:`fp8jax.sharding.use_mesh`),
    a ``jit`` may still get sharded inputs, which tracing cannot see; then
    arrays count as whole only where the process has one GPU (or none: the
    deviceless compiles). Trace sharded programs under their mesh.
    """
    return dispatch.is_local()


# The bias is an input here, not added after: its gradient then comes out of
# the pass that quantizes the output gradient (quantize_gradient).
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fp8_dot(lhs, rhs, bias, state, config: DotConfig):
    return _fp8_dot_fwd(lhs, rhs, bias, state, config)[0]


def _fp8_dot_fwd(lhs, rhs, bias, state, config: DotConfig):
    recipe, fmt = config.recipe, config.recipe.formats.forward
    dims = config.dimension_numbers
    n_contract = kernel_contraction(dims, lhs.ndim, rhs.ndim)
    tokens_ndim = None if n_contract is None else lhs.ndim - n_contract
    lhs_q, lhs_t, lhs_amax = quantize_in_both_layouts(
        lhs, fmt, state and state.x, recipe, tokens_ndim, rows_are_tokens=True
    )
    rhs_q, rhs_t, rhs_amax = quantize_in_both_layouts(rhs, fmt, state and state.kernel, recipe,
                                                      n_contract)  # fmt: skip
    y = scaled_dot(lhs_q, rhs_q, dims, config.out_dtype, recipe.forward_precision, kernel_t=rhs_t)
    y = add_bias(y, bias, config.bias_ndim)
    if config.split is not None:
        y = config.split.apply(y)
    amaxes = (lhs_amax, rhs_amax) if state is not None else None
    # The wgrad GEMM reads lhs transposed: where that copy exists, only it is saved.
    lhs_saved = lhs_q if lhs_t is None else None
    return y, (lhs_saved, lhs_t, rhs_q, state, amaxes)


def _fp8_dot_bwd(config: DotConfig, residuals, g):
    lhs_q, lhs_t, rhs_q, state, amaxes = residuals
    recipe, dims = config.recipe, config.dimension_numbers
    lhs_ndim, rhs_ndim = config.lhs_ndim, rhs_q.data.ndim
    n_contract = kernel_contraction(dims, lhs_ndim, rhs_ndim)
    if config.split is not None:
        g = SplitGradient(tuple(g), config.split.axis)
    g_q, g_t, g_amax, d_bias = quantize_output_gradient(
        g, recipe.formats.backward, state and state.grad, recipe,
        None if n_contract is None else lhs_ndim - n_contract, config.bias_ndim,
    )  # fmt: skip
    d_lhs, d_rhs = backward_dots(dims, lhs_ndim, lhs_q, rhs_q, g_q, config.lhs_dtype,
                                 config.rhs_dtype, recipe, lhs_t=lhs_t, g_t=g_t)  # fmt: skip
    new_state = None
    if state is not None:
        new_state = update_group(state, (*amaxes, g_amax), recipe)
    d_bias = None if d_bias is None else d_bias.astype(config.bias_dtype)
    return _partitioning.match_cotangents((d_lhs, d_rhs, d_bias), new_state, config.inputs)


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def check_state(state, recipe, group=DotScaleState) -> None:
    """Raises unless ``state`` is what ``recipe`` needs: None, or a matching ``group``."""
    if not isinstance(recipe, DelayedScaling):
        if state is not None:
            raise ValueError(
                f"state must be None with {type(recipe).__name__}, which keeps no state; "
                f"got a {type(state).__name__}. Pass recipe=DelayedScaling(...) to use it."
            )
        return
    if state is None:
        raise ValueError(
            "DelayedScaling needs state: create it once with "
            "fp8jax.init_state(recipe) and carry it through the train step."
        )
    if not isinstance(state, group):
        raise TypeError(
            f"state must be a {group.__name__} from "
            f"fp8jax.init_state(recipe{'' if group is DotScaleState else ', ' + group.__name__}), "
            f"got {type(state).__name__}."
        )
    expected = (recipe.amax_history_len,)
    scale_states, _ = jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda node: isinstance(node, ScaleState)
    )
    for path, scale_state in scale_states:
        dtypes = tuple(jnp.result_type(a).name for a in scale_state)
        if dtypes != ("float32", "float32"):
            raise TypeError(
                f"state{jax.tree_util.keystr(path)} must hold float32 (amax_history, scale), "
                f"got {dtypes}: cast only parameters to a lower precision, not the "
                "fp8_state collection."
            )
        shape = jnp.shape(scale_state.amax_history)
        if shape != expected:
            raise ValueError(
                f"state{jax.tree_util.keystr(path)}.amax_history has shape {shape}, "
                f"but the recipe's amax_history_len needs {expected}."
            )


def _out_dtype(preferred_element_type, default):
    if preferred_element_type is None:
        return jnp.dtype(default)
    dtype = jnp.dtype(preferred_element_type)
    if not jnp.issubdtype(dtype, jnp.floating) or is_fp8(dtype):
        raise TypeError(
            "preferred_element_type must be a high-precision float dtype "
            f"(bfloat16, float16 or float32), got {dtype}."
        )
    return dtype


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    *,
    recipe: Recipe | None = None,
    state: DotScaleState | None = None,
    preferred_element_type=None,
) -> jax.Array:
    """FP8 ``lax.dot_general``: E4M3 forward, E5M2 gradients, FP8 GEMMs both ways.

    Args:
      lhs: high-precision activations (float32, bfloat16 or float16).
      rhs: high-precision kernel.
      dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch,
        rhs_batch))`` as in ``lax.dot_general``; negative axes are allowed.
      recipe: :class:`~fp8jax.CurrentScaling` (default) or
        :class:`~fp8jax.DelayedScaling`.
      state: the :class:`~fp8jax.scaling.DotScaleState` from
        ``fp8jax.init_state(recipe)``; required by DelayedScaling, None
        otherwise. Its gradient is the updated state.
      preferred_element_type: output dtype; defaults to ``lhs.dtype``.

    Returns:
      The product, laid out as ``lax.dot_general`` lays it out.

    Raises:
      TypeError: for integer or FP8 inputs, a bad recipe or state type.
      ValueError: for dimension numbers that do not fit the shapes, or a
        state that does not match the recipe.

    Example:
      >>> import jax, jax.numpy as jnp, fp8jax
      >>> x = jax.random.normal(jax.random.key(0), (4, 32, 64))
      >>> w = jax.random.normal(jax.random.key(1), (4, 64, 16))
      >>> y = fp8jax.dot_general(x, w, (((2,), (1,)), ((0,), (0,))))
      >>> y.shape, y.dtype
      ((4, 32, 16), dtype('float32'))
    """
    check_high_precision("lhs", lhs)
    check_high_precision("rhs", rhs)
    dims = dimensions.normalize(dimension_numbers, lhs.shape, rhs.shape)
    out_dtype = _out_dtype(preferred_element_type, lhs.dtype)
    return _dot(lhs, rhs, None, dims, recipe, state, out_dtype)


def _dot(lhs, rhs, bias, dims, recipe, state, out_dtype, split: Split | None = None):
    """:func:`dot_general` on checked inputs, plus a bias over the output's trailing axes."""
    recipe = resolve_recipe(recipe)
    check_state(state, recipe)
    if fine_grained.is_fine(recipe):  # scales per row or block: GEMMs of their own
        return fine_grained.dot(lhs, rhs, bias, dims, recipe, out_dtype, split)
    config = DotConfig(
        dimension_numbers=dims,
        recipe=recipe,
        out_dtype=jnp.dtype(out_dtype),
        lhs_dtype=jnp.dtype(lhs.dtype),
        rhs_dtype=jnp.dtype(rhs.dtype),
        lhs_ndim=lhs.ndim,
        inputs=_partitioning.input_types(lhs, rhs, bias, state),
        bias_ndim=0 if bias is None else bias.ndim,
        bias_dtype=None if bias is None else jnp.dtype(bias.dtype),
        split=split,
    )
    return _fp8_dot(lhs, rhs, bias, state, config)


def dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    contracting_dims=((-1,), (0,)),
    *,
    recipe: Recipe | None = None,
    state: DotScaleState | None = None,
    split: Sequence[int] | None = None,
    split_axis: int = -2,
) -> jax.Array:
    """FP8 dense layer: ``x . kernel + bias`` with FP8 GEMMs forward and backward.

    Args:
      x: activations, any rank, float32/bfloat16/float16.
      kernel: weights; the contracted axes come first by default.
      bias: optional, shaped like the kernel's non-contracted axes.
      contracting_dims: ``(x_axes, kernel_axes)`` to contract.
      recipe: CurrentScaling (default) or DelayedScaling.
      state: DelayedScaling state from ``fp8jax.init_state(recipe)``.
      split, split_axis: return the output as a tuple of pieces of these
        sizes along that feature axis, as ``fp8jax.layernorm_dense`` does (a
        fused QKV projection: the backward casts the pieces' gradients
        without writing their sum; :mod:`fp8jax.ops.split`).

    Returns:
      ``x``'s batch axes followed by the kernel's free axes, in ``x.dtype``
      (a tuple of pieces with ``split``).

    Example:
      >>> import jax, jax.numpy as jnp, fp8jax
      >>> x = jax.random.normal(jax.random.key(0), (2, 8, 64), jnp.bfloat16)
      >>> w = jax.random.normal(jax.random.key(1), (64, 32), jnp.float32) * 0.1
      >>> fp8jax.dense(x, w, jnp.zeros((32,))).dtype
      dtype(bfloat16)
    """
    check_high_precision("x", x)
    check_high_precision("kernel", kernel)
    dims = dimensions.normalize((contracting_dims, ((), ())), x.shape, kernel.shape)
    free = [d for i, d in enumerate(kernel.shape) if i not in dims[0][1]]
    check_bias(bias, tuple(free))
    batch = [d for i, d in enumerate(x.shape) if i not in dims[0][0]]
    pieces = make_split(split, split_axis, (*batch, *free), len(free))
    return _dot(x, kernel, bias, dims, recipe, state, x.dtype, pieces)


def check_bias(bias: jax.Array | None, expected: tuple[int, ...]) -> None:
    """Raises unless ``bias`` is None or a high-precision array of the kernel's output shape."""
    if bias is None:
        return
    check_high_precision("bias", bias)
    if tuple(bias.shape) != tuple(expected):
        raise ValueError(
            f"bias must have the kernel's output shape {tuple(expected)}, got {tuple(bias.shape)}."
        )


def add_bias(y: jax.Array, bias: jax.Array | None, n_out_axes: int) -> jax.Array:
    """``y + bias`` over ``y``'s last ``n_out_axes`` axes (the kernel's output axes)."""
    if bias is None:
        return y
    check_bias(bias, y.shape[y.ndim - n_out_axes :])
    return y + _partitioning.broadcastable(bias.astype(y.dtype), y.ndim)

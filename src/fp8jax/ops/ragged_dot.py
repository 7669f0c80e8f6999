"""FP8 ``ragged_dot``: grouped expert GEMMs with one scale per expert, FP8 forward and backward.

``lax.ragged_dot(lhs, rhs, group_sizes)`` multiplies the rows of ``lhs``
(sorted by group) by their group's matrix ``rhs[i]``; a Mixture-of-Experts
layer runs its experts this way. Here all three GEMMs take FP8 operands:

* forward: ``lhs`` (E4M3) . ``rhs[i]`` (E4M3);
* dgrad: the output gradient (E5M2) . ``rhs[i]^T``;
* wgrad: ``lhs_i^T`` . the gradient's rows of group ``i``.

Scales. Each expert's weights get their own scale (the amax of ``rhs[i]``,
a scale vector ``[g]``): experts' weights can differ by orders of magnitude,
and one scale for all would push a small expert's weights into E4M3's
subnormals or to zero. The activations (and the output gradient) get one
scale per tensor: a token's values do not depend on the expert it is routed
to, so per-group amaxes would differ little, and a single scale keeps the
epilogue a product of two factors (tests/ops/test_ragged_dot.py checks a
nearly dead expert, weights 1e-4 times the others, within the E4M3 budget).
Scaling is current (each tensor's own amax); DelayedScaling is refused.

The GEMMs (:mod:`fp8jax.kernels.grouped_gemm`,
docs/design.md#grouped-expert-gemms): on NVIDIA GPUs a Pallas Triton
kernel that does only the useful FLOPs; XLA's own ``lax.ragged_dot`` expands
to one dense GEMM over all groups (``g`` times the work). Elsewhere and with
the kernels off (:mod:`fp8jax.kernels.dispatch`) ``lax.ragged_dot`` on the
same FP8 operands computes the same values (the CPU has no FP8 GEMM; XLA
upcasts there).

A backward GEMM multiplies an E5M2 gradient by an E4M3 operand; JAX's
Pallas Triton lowering takes one element type per dot, so the E4M3 operand
is converted to E5M2 at its scale (E5M2's range holds E4M3's; the mantissa
rounds from 3 bits to 2). Both paths do so, so they compute the same values.
With ``fp8jax.ALL_E4M3`` no conversion happens.

Rows past ``sum(group_sizes)`` give zeros, as in ``lax.ragged_dot``, and
get zero gradients.

Sharding: where data parallelism alone splits the token rows
(:func:`fp8jax.kernels.data_parallel`, entered by
:func:`fp8jax.sharding.use_mesh`), each device runs the kernels on its own
rows inside ``shard_map``, with its share of each group; the FP8 weights are
whole there, so FSDP-sharded weights are all-gathered in FP8, and the
weights' gradient is summed over the devices. Under any other mesh (tensor
or expert parallelism; expert parallelism with an all-to-all is not
implemented) the GEMMs take ``lax.ragged_dot``, with a warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from fp8jax.formats import Fp8Format, is_fp8
from fp8jax.kernels import dispatch
from fp8jax.kernels import grouped_gemm as gg
from fp8jax.ops import _partitioning
from fp8jax.ops.residuals import saved_as_bits
from fp8jax.quantize import amax, check_high_precision, quantize_with_scale
from fp8jax.recipes import DelayedScaling, Recipe, resolve_recipe
from fp8jax.scaling import scale_from_amax

# Tests set this to run the kernels in Pallas interpret mode on the CPU.
_INTERPRET = False


@contextlib.contextmanager
def interpret_kernels():
    """Runs the grouped-GEMM kernels in Pallas interpret mode inside (tests, on the CPU)."""
    global _INTERPRET
    before, _INTERPRET = _INTERPRET, True
    try:
        yield
    finally:
        _INTERPRET = before


@dataclasses.dataclass(frozen=True)
class RaggedConfig:
    """Everything static about one FP8 ragged_dot."""

    recipe: Recipe
    out_dtype: np.dtype
    lhs_dtype: np.dtype
    rhs_dtype: np.dtype


def _kernel_mode(rows: int) -> tuple[str, tuple[str, ...]]:
    """The grouped GEMMs' path and the mesh axes splitting their rows.

    "interpret" (tests), "kernel" (Pallas on CUDA, XLA elsewhere; with axes:
    on each device's rows inside ``shard_map``) or "xla".
    """
    if rows == 0:  # nothing to multiply; the kernels' row-index loads need a row
        return "xla", ()
    if _INTERPRET:
        return "interpret", ()
    axes = dispatch.row_axes(rows_are_tokens=True)
    if axes is None or rows % dispatch.devices_along(axes):
        if dispatch.enabled():
            warnings.warn(
                "fp8jax.ragged_dot: the grouped-GEMM kernel runs on whole arrays or on each "
                "device's rows under data parallelism (rows divisible by the devices); here "
                f"({rows} rows, mesh {dict(jax.sharding.get_abstract_mesh().shape)}) the GEMMs "
                "take lax.ragged_dot, which XLA's GPU backend expands to one dense GEMM over "
                "all groups.",
                RuntimeWarning,
                stacklevel=4,
            )
        return "xla", ()
    return "kernel", axes


def _run(pallas_fn, xla_fn, operands, n_rows: int, reduce: bool = False):
    """``pallas_fn`` or ``xla_fn`` on ``operands`` (group sizes third, the first ``n_rows`` split).

    Where data parallelism alone splits token rows (:mod:`fp8jax.kernels.dispatch`),
    each device runs the grouped GEMM on its own rows inside ``shard_map``:
    its group sizes are the global groups clipped to its rows, the other
    operands (the FP8 weights, gathered in FP8 where sharded) are whole, and
    ``reduce`` sums the results over the devices (the weights' gradient).
    """
    mode, axes = _kernel_mode(operands[0].shape[0])
    if mode == "interpret":
        return pallas_fn(*operands, interpret=True)
    if mode == "xla":
        return xla_fn(*operands)

    def call(*ops):
        return jax.lax.platform_dependent(*ops, cuda=pallas_fn, default=xla_fn)

    if not axes:
        return call(*operands)
    rows = operands[0].shape[0]

    def local(*ops):
        local_rows = ops[0].shape[0]
        first = jax.lax.axis_index(axes) * local_rows
        ends = jnp.clip(gg.group_ends(ops[2], rows) - first, 0, local_rows)
        sizes = jnp.diff(ends, prepend=jnp.zeros((1,), ends.dtype))
        out = call(*ops[:2], sizes, *ops[3:])
        return jax.lax.psum(out, axes) if reduce else out

    split = P(axes)
    in_specs = (split,) * n_rows + (P(),) * (len(operands) - n_rows)
    return jax.shard_map(local, in_specs=in_specs, out_specs=P() if reduce else split,
                         check_vma=False)(*operands)  # fmt: skip


def _grouped(a, b, group_sizes, a_scale_inv, b_scale_inv, out_dtype):
    """``a [m, k] . b[i]^T`` per group (``b [g, n, k]``), times ``a_scale_inv * b_scale_inv[i]``."""
    per_group = jnp.concatenate([a_scale_inv * b_scale_inv, jnp.zeros((1,), jnp.float32)])

    def pallas_fn(a, b, group_sizes, per_group, interpret=False):
        return gg.grouped(a, b, group_sizes, per_group, out_dtype, interpret)

    def xla_fn(a, b, group_sizes, per_group):
        m = a.shape[0]
        row_scale = per_group[gg.row_groups(group_sizes, m)]
        return gg.grouped_xla(a, b, gg.effective_sizes(group_sizes, m), row_scale, out_dtype)

    return _run(pallas_fn, xla_fn, (a, b, group_sizes, per_group), 1)


def _grouped_wgrad(a, b, group_sizes, scale_inv, groups, out_dtype):
    """``out[i] = a[rows of i]^T . b[rows of i] * scale_inv``: ``[g, k, n]``."""

    def pallas_fn(a, b, group_sizes, scale_inv, interpret=False):
        return gg.grouped_transposed(a, b, group_sizes, scale_inv, out_dtype, interpret)

    def xla_fn(a, b, group_sizes, scale_inv):
        sizes = gg.effective_sizes(group_sizes, a.shape[0])
        return gg.grouped_transposed_xla(a, b, sizes, scale_inv, out_dtype)

    return _run(pallas_fn, xla_fn, (a, b, group_sizes, scale_inv), 2, reduce=True)


def quantize_per_expert(
    rhs: jax.Array, forward: Fp8Format, backward: Fp8Format, recipe
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``rhs [g, k, n]`` cast for both of its GEMMs, each expert at its own scale.

    Returns ``(forward_t, backward, scale_inv [g])``: ``forward_t [g, n, k]``
    in ``forward`` (the forward GEMM contracts ``k``, the minor axis there)
    and ``[g, k, n]`` in ``backward`` for the dgrad GEMM (one element type
    per kernel dot), both rounded once from ``rhs`` at the same scale. XLA
    writes both from one read of ``rhs``, where converting the forward's
    FP8 copy took another write and read of it
    (docs/design.md#grouped-expert-gemms).
    """
    expert_amax = jnp.max(jnp.abs(rhs.astype(jnp.float32)).reshape(rhs.shape[0], -1), axis=1)
    scale = scale_from_amax(expert_amax, forward.max, recipe.margin, fallback=1.0)
    scale_b = scale.reshape(-1, *[1] * (rhs.ndim - 1))
    forward_t = quantize_with_scale(jnp.swapaxes(rhs, 1, 2), forward, scale_b).data
    return forward_t, quantize_with_scale(rhs, backward, scale_b).data, 1.0 / scale


def _quantize_tensor(x: jax.Array, fmt: Fp8Format, recipe) -> tuple[jax.Array, jax.Array]:
    """``x`` in ``fmt`` at one scale from its amax: ``(data, scale_inv)``."""
    x_amax = _partitioning.reduce_amax(amax(x), recipe)
    scale = scale_from_amax(x_amax, fmt.max, recipe.margin, fallback=1.0)
    return quantize_with_scale(x, fmt, scale).data, 1.0 / scale


def as_format(data: jax.Array, fmt: Fp8Format) -> jax.Array:
    """FP8 ``data`` in ``fmt`` at the same scale (E4M3 -> E5M2 rounds the mantissa; no overflow)."""
    if data.dtype == fmt.dtype:
        return data
    return data.astype(jnp.float32).astype(fmt.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fp8_ragged(lhs, rhs, group_sizes, config: RaggedConfig):
    return _fwd(lhs, rhs, group_sizes, config)[0]


def _fwd(lhs, rhs, group_sizes, config: RaggedConfig):
    recipe, fmt = config.recipe, config.recipe.formats.forward
    lhs_q, lhs_si = _quantize_tensor(lhs, fmt, recipe)
    rhs_t, rhs_b, rhs_si = quantize_per_expert(rhs, fmt, recipe.formats.backward, recipe)
    y = _grouped(lhs_q, rhs_t, group_sizes, lhs_si, rhs_si, config.out_dtype)
    return y, (lhs_q, lhs_si, rhs_b, rhs_si, group_sizes)


def _bwd(config: RaggedConfig, residuals, g):
    lhs_q, lhs_si, rhs_b, rhs_si, group_sizes = residuals
    recipe, fmt = config.recipe, config.recipe.formats.backward
    g_q, g_si = _quantize_tensor(g, fmt, recipe)
    # dgrad: g [m, n] . rhs[i]^T, rhs laid out [g, k, n] contracts its minor n.
    d_lhs = _grouped(g_q, rhs_b, group_sizes, g_si, rhs_si, config.lhs_dtype)
    d_rhs = _grouped_wgrad(as_format(lhs_q, fmt), g_q, group_sizes, lhs_si * g_si,
                           rhs_b.shape[0], config.rhs_dtype)  # fmt: skip
    d_sizes = np.zeros(group_sizes.shape, jax.dtypes.float0)
    return d_lhs, d_rhs, d_sizes


_fp8_ragged.defvjp(*saved_as_bits(_fwd, _bwd))


def _check(lhs, rhs, group_sizes) -> None:
    check_high_precision("lhs", lhs)
    check_high_precision("rhs", rhs)
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be 2-D [m, k] (rows sorted by group), got shape {lhs.shape}.")
    if rhs.ndim != 3:
        raise ValueError(
            f"rhs must be 3-D [g, k, n] (one matrix per group), got shape {rhs.shape}."
        )
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"lhs's contracting size k={lhs.shape[1]} must equal rhs's (axis 1), got rhs shape "
            f"{rhs.shape}."
        )
    dtype = getattr(group_sizes, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(
            f"group_sizes must be an integer array [g] (int32), got "
            f"{'a ' + type(group_sizes).__name__ if dtype is None else 'dtype ' + str(dtype)}."
        )
    if jnp.ndim(group_sizes) != 1 or group_sizes.shape[0] != rhs.shape[0]:
        raise ValueError(
            f"group_sizes must have shape ({rhs.shape[0]},), one size per group of rhs, got "
            f"shape {jnp.shape(group_sizes)}."
        )
    if isinstance(group_sizes, jax.core.Tracer):
        return
    sizes = np.asarray(group_sizes)
    if (sizes < 0).any():
        raise ValueError(f"group_sizes must be >= 0, got {sizes.tolist()}.")
    if sizes.sum() > lhs.shape[0]:
        raise ValueError(
            f"group_sizes must sum to at most lhs's {lhs.shape[0]} rows, got sum {sizes.sum()} "
            f"({sizes.tolist()})."
        )


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    recipe: Recipe | None = None,
    state=None,
    preferred_element_type=None,
) -> jax.Array:
    """FP8 ``lax.ragged_dot``: grouped GEMMs, E4M3 forward, E5M2 gradients, a scale per group.

    ``out[r] = lhs[r] . rhs[i]`` for the rows ``r`` of group ``i``: group 0
    owns the first ``group_sizes[0]`` rows, group 1 the next, and so on.

    Args:
      lhs: ``[m, k]`` high-precision rows, sorted by group.
      rhs: ``[g, k, n]`` high-precision matrices, one per group (expert).
      group_sizes: ``[g]`` integer rows per group. Concrete sizes must be
        >= 0 and sum to at most ``m``; rows past the sum give zeros (as in
        ``lax.ragged_dot``). Inside ``jit`` they cannot be checked: a
        negative size then counts as an empty group and rows past ``m`` are
        dropped.
      recipe: :class:`~fp8jax.CurrentScaling` (the default); each expert's
        weights get their own scale, ``lhs`` and the output gradient one each.
      state: must be None (DelayedScaling is not supported by this op).
      preferred_element_type: output dtype; defaults to ``lhs.dtype``.

    Returns:
      ``[m, n]`` in ``preferred_element_type``.

    Raises:
      TypeError: for non-float operands, FP8 operands or non-integer group sizes.
      ValueError: for wrong ranks or shapes, bad concrete group sizes, or a
        DelayedScaling recipe or a state.

    Example:
      >>> import jax, jax.numpy as jnp, fp8jax
      >>> x = jax.random.normal(jax.random.key(0), (6, 64))
      >>> w = jax.random.normal(jax.random.key(1), (3, 64, 32))
      >>> fp8jax.ragged_dot(x, w, jnp.array([2, 0, 4], jnp.int32)).shape
      (6, 32)
    """
    _check(lhs, rhs, group_sizes)
    recipe = resolve_recipe(recipe)
    if isinstance(recipe, DelayedScaling) or state is not None:
        raise ValueError(
            "fp8jax.ragged_dot supports CurrentScaling only (state=None): per-expert delayed "
            f"scaling would need a state per expert; got recipe {type(recipe).__name__} and "
            f"state {type(state).__name__}."
        )
    out_dtype = lhs.dtype if preferred_element_type is None else jnp.dtype(preferred_element_type)
    if not jnp.issubdtype(out_dtype, jnp.floating) or is_fp8(out_dtype):
        raise TypeError(
            "preferred_element_type must be a high-precision float dtype (bfloat16, float16 "
            f"or float32), got {out_dtype}."
        )
    config = RaggedConfig(recipe, jnp.dtype(out_dtype), jnp.dtype(lhs.dtype),
                          jnp.dtype(rhs.dtype))  # fmt: skip
    return _fp8_ragged(lhs, rhs, group_sizes.astype(jnp.int32), config)

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
Scaling is current (each tensor's own amax). Under ``BlockScaling``
(DeepSeek-V3's recipe) tokens and gradients are scaled per 1x128 tile and
each expert's weights per 128x128 block instead, with the FP32 promotion
every 128 of the contraction (:mod:`fp8jax.ops.block_ragged`); every other
recipe is refused by name (:func:`check_recipe`).

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
weights' gradient is summed over the devices. Expert parallelism
(``MoEBlock`` under ``ShardingConfig.ep``) calls this op inside its own
``shard_map`` on each device's received rows, which are whole there. Under
any other mesh (tensor parallelism) the GEMMs take ``lax.ragged_dot``,
with a warning.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from fp8jax.formats import Fp8Format, is_fp8
from fp8jax.kernels import dispatch, expert_cast
from fp8jax.kernels import grouped_gemm as gg
from fp8jax.ops import _partitioning, block_ragged
from fp8jax.ops.residuals import saved_as_bits
from fp8jax.quantize import amax, check_high_precision, quantize_with_scale
from fp8jax.recipes import (
    BlockScaling,
    CurrentScaling,
    DelayedScaling,
    MXFP8Scaling,
    Recipe,
    RowwiseScaling,
    resolve_recipe,
)
from fp8jax.scaling import scale_from_amax

# Tests run the kernels in Pallas interpret mode on the CPU inside it: an
# option in the jit key (fp8jax.kernels.grouped_gemm.interpret_kernels).
interpret_kernels = gg.interpret_kernels


@dataclasses.dataclass(frozen=True)
class RaggedConfig:
    """Everything static about one FP8 ragged_dot."""

    recipe: Recipe
    out_dtype: np.dtype
    lhs_dtype: np.dtype
    rhs_dtype: np.dtype
    repeats: int = 1  # slots per row of lhs (permuted_ragged_dot's top_k)
    # Inside shard_map: (axis of rhs [g, k, n], the mesh axes splitting it)
    # for FSDP-sharded weights gathered in FP8; () for whole weights.
    rhs_gather: tuple = ()


def _placement(rows: int) -> dispatch.Placement:
    """Where the grouped GEMMs run on ``rows`` grouped rows.

    In interpret mode (tests), or :func:`fp8jax.kernels.dispatch.decide`'s
    placement: Pallas on CUDA and XLA elsewhere, with row axes on each
    device's rows inside ``shard_map``; or XLA.
    """
    if rows == 0:  # nothing to multiply; the kernels' row-index loads need a row
        return dispatch.XLA
    if gg.interpreting():
        return dispatch.Placement(kernel=True, interpret=True)
    return dispatch.decide(lambda shards: rows % shards == 0, rows_are_tokens=True)


def _kernel_placement(rows: int) -> dispatch.Placement:
    """:func:`_placement`, warning where a mesh keeps the kernels off."""
    placement = _placement(rows)
    if not placement.kernel and rows and dispatch.enabled():
        warnings.warn(
            "fp8jax.ragged_dot: the grouped-GEMM kernel runs on whole arrays or on each "
            "device's rows under data parallelism (rows divisible by the devices); here "
            f"({rows} rows, mesh {dict(jax.sharding.get_abstract_mesh().shape)}) the GEMMs "
            "take lax.ragged_dot, which XLA's GPU backend expands to one dense GEMM over "
            "all groups.",
            RuntimeWarning,
            stacklevel=4,
        )
    return placement


def _run(pallas_fn, xla_fn, operands, n_rows: int, maps: dict, reduce: bool = False):
    """``pallas_fn`` or ``xla_fn`` on ``operands`` (group sizes third, the first ``n_rows`` split)
    and the row maps ``maps`` (keyword arguments, None for none).

    Where data parallelism alone splits the grouped rows (:mod:`fp8jax.kernels.dispatch`),
    each device runs the grouped GEMM on its own rows inside ``shard_map``:
    its group sizes are the global groups clipped to its rows, the other
    operands (the FP8 weights, gathered in FP8 where sharded) are whole, and
    ``reduce`` sums the results over the devices (the weights' gradient). The
    kernels index local rows only, so there the maps' gathers and
    permutations run in XLA around the kernels (``maps`` must be applied by
    the caller: see :func:`_grouped`).
    """
    rows = operands[0].shape[0]
    for index in maps.values():
        if index is not None:
            rows = index.shape[0]
    placement = _kernel_placement(rows)
    if placement.interpret:
        return pallas_fn(*operands, **maps, interpret=True)
    if not placement.kernel:
        return xla_fn(*operands, **maps)
    axes = placement.row_axes

    def call(*ops, **maps):
        return jax.lax.platform_dependent(
            *ops,
            cuda=functools.partial(pallas_fn, **maps),
            default=functools.partial(xla_fn, **maps),
        )

    if not axes:
        return call(*operands, **maps)
    if any(index is not None for index in maps.values()):
        raise AssertionError("row maps under data parallelism are applied by the caller")

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


def _split_rows(rows: int) -> bool:
    """Whether data parallelism splits ``rows`` grouped rows over devices here."""
    return bool(_placement(rows).row_axes)


def inverse_permutation(permutation: jax.Array) -> jax.Array:
    """The inverse of a permutation of ``range(m)`` (int32): ``p[inverse[i]] == i``."""
    m = permutation.shape[0]
    return jnp.zeros((m,), jnp.int32).at[permutation].set(jnp.arange(m, dtype=jnp.int32))


def _grouped(a, b, group_sizes, a_scale_inv, b_scale_inv, out_dtype, read=None, write=None):
    """``out[write[r]] = a[read[r]] . b[i]^T * a_scale_inv * b_scale_inv[i]`` per group.

    ``b [g, n, k]``; ``read``, ``write`` as in :func:`fp8jax.kernels.grouped_gemm.grouped`
    (None: the rows themselves).
    """
    m = a.shape[0] if read is None else read.shape[0]
    if (read is not None or write is not None) and _split_rows(m):
        # Each device's share of the grouped rows: the gather and the
        # permutation back run in XLA (the kernels index local rows only).
        a = a if read is None else jnp.take(a, read, axis=0)
        out = _grouped(a, b, group_sizes, a_scale_inv, b_scale_inv, out_dtype)
        return out if write is None else jnp.take(out, inverse_permutation(write), axis=0)
    per_group = jnp.concatenate([a_scale_inv * b_scale_inv, jnp.zeros((1,), jnp.float32)])

    def pallas_fn(a, b, group_sizes, per_group, read=None, write=None, interpret=False):
        return gg.grouped(a, b, group_sizes, per_group, out_dtype, interpret,
                          read=read, write=write)  # fmt: skip

    def xla_fn(a, b, group_sizes, per_group, read=None, write=None):
        rows = a.shape[0] if read is None else read.shape[0]  # each device's, in shard_map
        row_scale = per_group[gg.row_groups(group_sizes, rows)]
        sizes = gg.effective_sizes(group_sizes, rows)
        return gg.grouped_xla(a, b, sizes, row_scale, out_dtype, read=read, write=write)

    maps = {"read": read, "write": write}
    return _run(pallas_fn, xla_fn, (a, b, group_sizes, per_group), 1, maps)


def _grouped_wgrad(a, b, group_sizes, scale_inv, out_dtype, read_a=None, read_b=None):
    """``out[i] = a[read_a[rows of i]]^T . b[read_b[rows of i]] * scale_inv``: ``[g, k, n]``."""
    m = a.shape[0] if read_a is None else read_a.shape[0]
    if (read_a is not None or read_b is not None) and _split_rows(m):
        a = a if read_a is None else jnp.take(a, read_a, axis=0)
        b = b if read_b is None else jnp.take(b, read_b, axis=0)
        return _grouped_wgrad(a, b, group_sizes, scale_inv, out_dtype)

    def pallas_fn(a, b, group_sizes, scale_inv, read_a=None, read_b=None, interpret=False):
        return gg.grouped_transposed(a, b, group_sizes, scale_inv, out_dtype, interpret,
                                     read_a=read_a, read_b=read_b)  # fmt: skip

    def xla_fn(a, b, group_sizes, scale_inv, read_a=None, read_b=None):
        rows = a.shape[0] if read_a is None else read_a.shape[0]  # each device's, in shard_map
        sizes = gg.effective_sizes(group_sizes, rows)
        return gg.grouped_transposed_xla(a, b, sizes, scale_inv, out_dtype,
                                         read_a=read_a, read_b=read_b)  # fmt: skip

    maps = {"read_a": read_a, "read_b": read_b}
    return _run(pallas_fn, xla_fn, (a, b, group_sizes, scale_inv), 2, maps, reduce=True)


def quantize_per_expert(
    rhs: jax.Array, forward: Fp8Format, backward: Fp8Format, recipe, gather: tuple = ()
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``rhs [g, k, n]`` cast for both of its GEMMs, each expert at its own scale.

    Returns ``(forward_t, backward, scale_inv [g])``: ``forward_t [g, n, k]``
    in ``forward`` (the forward GEMM contracts ``k``, the minor axis there)
    and ``[g, k, n]`` in ``backward`` for the dgrad GEMM (one element type
    per kernel dot), both rounded once from ``rhs`` at the same scale, from
    one read of ``rhs`` (:func:`fp8jax.kernels.expert_cast.cast_experts`;
    docs/design.md#grouped-expert-gemms).

    ``gather``: inside ``shard_map``, ``(axis, mesh axes)`` splitting ``rhs``
    (FSDP): each device casts its shard at the whole expert's scale (the amax
    max-reduced over the axes), then the FP8 copies are all-gathered, so the
    weights cross devices in FP8 (docs/design.md#grouped-expert-gemms).
    """
    expert_amax = jnp.max(jnp.abs(rhs.astype(jnp.float32)).reshape(rhs.shape[0], -1), axis=1)
    if gather:
        expert_amax = jax.lax.pmax(expert_amax, gather[1])
    scale = scale_from_amax(expert_amax, forward.max, recipe.margin, fallback=1.0)
    forward_t, backward_copy = expert_cast.cast_experts(rhs, scale, forward, backward,
                                                        interpret=gg.interpreting())  # fmt: skip
    if gather:
        axis, axes = gather
        forward_t = jax.lax.all_gather(forward_t, axes, axis=3 - axis, tiled=True)  # [g, n, k]
        backward_copy = jax.lax.all_gather(backward_copy, axes, axis=axis, tiled=True)
    return forward_t, backward_copy, 1.0 / scale


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fp8_ragged(lhs, rhs, group_sizes, slots, config: RaggedConfig):
    return _fwd(lhs, rhs, group_sizes, slots, config)[0]


def _read_rows(slots, repeats: int):
    """The grouped rows' rows of ``lhs``: slot ``s`` holds ``lhs[s // repeats]``."""
    lhs_slots, _ = slots
    return None if lhs_slots is None else lhs_slots // repeats


def _fwd(lhs, rhs, group_sizes, slots, config: RaggedConfig):
    recipe, fmt = config.recipe, config.recipe.formats.forward
    lhs_q, lhs_si = _quantize_tensor(lhs, fmt, recipe)
    rhs_t, rhs_b, rhs_si = quantize_per_expert(rhs, fmt, recipe.formats.backward, recipe,
                                               config.rhs_gather)  # fmt: skip
    read = _read_rows(slots, config.repeats)
    y = _grouped(lhs_q, rhs_t, group_sizes, lhs_si, rhs_si, config.out_dtype, read, slots[1])
    return y, (lhs_q, lhs_si, rhs_b, rhs_si, group_sizes, slots)


def _bwd(config: RaggedConfig, residuals, g):
    lhs_q, lhs_si, rhs_b, rhs_si, group_sizes, slots = residuals
    lhs_slots, out_slots = slots
    recipe, fmt = config.recipe, config.recipe.formats.backward
    g_q, g_si = _quantize_tensor(g, fmt, recipe)
    # dgrad: g [m, n] . rhs[i]^T, rhs laid out [g, k, n] contracts its minor n;
    # each grouped row's gradient lands at its slot, and a row of lhs sums
    # its repeats' slots.
    d_lhs = _grouped(g_q, rhs_b, group_sizes, g_si, rhs_si, config.lhs_dtype, out_slots,
                     lhs_slots)  # fmt: skip
    if config.repeats > 1:
        per_row = d_lhs.astype(jnp.float32).reshape(-1, config.repeats, d_lhs.shape[1])
        d_lhs = jnp.sum(per_row, axis=1).astype(config.lhs_dtype)
    read = _read_rows(slots, config.repeats)
    d_rhs = _grouped_wgrad(as_format(lhs_q, fmt), g_q, group_sizes, lhs_si * g_si,
                           config.rhs_dtype, read, out_slots)  # fmt: skip
    if config.rhs_gather:  # each device keeps the summed gradient of its shard
        axis, axes = config.rhs_gather
        d_rhs = jax.lax.psum_scatter(d_rhs, axes, scatter_dimension=axis, tiled=True)
    d_ints = jax.tree.map(lambda i: np.zeros(i.shape, jax.dtypes.float0), (group_sizes, slots))
    return d_lhs, d_rhs, *d_ints


_fp8_ragged.defvjp(*saved_as_bits(_fwd, _bwd))


def _check(lhs, rhs, group_sizes, rows: int, rows_are: str) -> None:
    """Raises for bad operands; ``rows``: the grouped rows the sizes partition, ``rows_are``
    what they are in the message."""
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
    if sizes.sum() > rows:
        raise ValueError(
            f"group_sizes must sum to at most {rows_are}'s {rows} rows, got sum {sizes.sum()} "
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
      recipe: :class:`~fp8jax.CurrentScaling` (the default), or
        :class:`~fp8jax.BlockScaling` (per 1x128 tile and 128x128 block,
        :mod:`fp8jax.ops.block_ragged`); under CurrentScaling each expert's
        weights get their own scale, ``lhs`` and the output gradient one each.
        CurrentScaling's ``*_precision`` fields are not read: the grouped
        kernels accumulate every product in f32, and ``lax.ragged_dot`` (kernels
        off, tensor parallelism) runs at XLA's default precision.
      state: must be None (DelayedScaling is not supported by this op).
      preferred_element_type: output dtype; defaults to ``lhs.dtype``.

    Returns:
      ``[m, n]`` in ``preferred_element_type``.

    Raises:
      TypeError: for non-float operands, FP8 operands or non-integer group sizes.
      ValueError: for wrong ranks or shapes, bad concrete group sizes, or a
        recipe other than CurrentScaling or BlockScaling, or a state.

    Example:
      >>> import jax, jax.numpy as jnp, fp8jax
      >>> x = jax.random.normal(jax.random.key(0), (6, 64))
      >>> w = jax.random.normal(jax.random.key(1), (3, 64, 32))
      >>> fp8jax.ragged_dot(x, w, jnp.array([2, 0, 4], jnp.int32)).shape
      (6, 32)
    """
    _check(lhs, rhs, group_sizes, lhs.shape[0] if lhs.ndim == 2 else 0, "lhs")
    config = _config(lhs, rhs, recipe, state, preferred_element_type)
    return _grouped_product(lhs, rhs, group_sizes.astype(jnp.int32), (None, None), config)


def _grouped_product(lhs, rhs, group_sizes, slots, config: RaggedConfig) -> jax.Array:
    """The op under ``config.recipe``; over Explicit mesh axes with the axes Auto inside.

    The grouped GEMMs' gathers, scatters and weight gradient (which contracts
    sharded rows) have no sharding their types can state, and
    ``lax.ragged_dot`` infers none under Explicit axes, so they run Auto,
    partitioned by XLA as under ``jit``, and the result takes the sharding
    of :func:`fp8jax.ops._partitioning.ragged_out_sharding` (as the
    fine-grained GEMMs do, :func:`fp8jax.ops.fine_grained.dot_general`).
    """
    if 0 in (lhs.shape[1], *rhs.shape) and not config.rhs_gather:
        # No groups, or an empty k or n: every output sums no terms, so zeros
        # (and zero gradients), as lax.ragged_dot gives. The scales' per-expert
        # amaxes, the kernels' tiles and BlockScaling's blocks all need a value.
        return jnp.zeros((lhs.shape[0] * config.repeats, rhs.shape[2]), config.out_dtype)
    op = block_ragged.block_ragged_dot if isinstance(config.recipe, BlockScaling) else _fp8_ragged

    def product(lhs, rhs, group_sizes, slots):
        return op(lhs, rhs, group_sizes, slots, config)

    out_sharding = None if config.rhs_gather else _partitioning.ragged_out_sharding(lhs, rhs)
    if out_sharding is None:
        return product(lhs, rhs, group_sizes, slots)
    return jax.sharding.auto_axes(product, out_sharding=out_sharding)(lhs, rhs, group_sizes, slots)


def check_recipe(owner: str, recipe) -> Recipe:
    """``recipe`` resolved, or an error naming ``owner`` where the expert GEMMs cannot take it.

    The grouped GEMMs scale per tensor (activations, gradients) and per
    expert (weights), freshly from each tensor's amax (CurrentScaling), or
    per 1x128 tile and 128x128 weight block (BlockScaling).
    """
    recipe = resolve_recipe(recipe)
    if isinstance(recipe, (CurrentScaling, BlockScaling)):
        return recipe
    name = type(recipe).__name__
    if isinstance(recipe, DelayedScaling):
        why = "per-expert delayed scaling would need a scale state per expert"
    elif isinstance(recipe, RowwiseScaling):
        why = ("the grouped GEMMs have no per-row scales, and running them per tensor would "
               "silently drop the rowwise recipe")  # fmt: skip
    elif isinstance(recipe, MXFP8Scaling):
        why = ("MXFP8's 1x32 E8M0 blocks need Blackwell's block-scaled GEMM, which the "
               "grouped GEMMs do not call")  # fmt: skip
    else:
        why = f"{name} is not a recipe the expert GEMMs know"
    raise ValueError(
        f"{owner}: the expert GEMMs take CurrentScaling or BlockScaling only (or recipe=None); "
        f"{why}. Got recipe={name}. Pass CurrentScaling or BlockScaling, or run the experts in "
        "BF16 (fp8=False on the MoE block)."
    )


def reduced_over(recipe: Recipe, axes: tuple[str, ...]) -> Recipe:
    """``recipe`` with ``axes`` added to its ``amax_reduction_axes`` (inside ``shard_map``).

    BlockScaling has none: each tile and block lies within one device's
    rows (a device's share of a group tiles from its own first row).
    """
    if isinstance(recipe, BlockScaling):
        return recipe
    reduce = tuple(dict.fromkeys((*recipe.amax_reduction_axes, *axes)))
    return dataclasses.replace(recipe, amax_reduction_axes=reduce)


def _config(lhs, rhs, recipe, state, preferred_element_type, repeats: int = 1,
            rhs_gather: tuple = ()) -> RaggedConfig:  # fmt: skip
    recipe = check_recipe("fp8jax.ragged_dot", recipe)
    if state is not None:
        raise ValueError(
            "fp8jax.ragged_dot supports CurrentScaling only (state=None): per-expert delayed "
            f"scaling would need a state per expert; got state {type(state).__name__}."
        )
    out_dtype = lhs.dtype if preferred_element_type is None else jnp.dtype(preferred_element_type)
    if not jnp.issubdtype(out_dtype, jnp.floating) or is_fp8(out_dtype):
        raise TypeError(
            "preferred_element_type must be a high-precision float dtype (bfloat16, float16 "
            f"or float32), got {out_dtype}."
        )
    return RaggedConfig(recipe, jnp.dtype(out_dtype), jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype),
                        repeats, rhs_gather)  # fmt: skip


def _check_slots(name: str, slots, rows: int) -> None:
    dtype = getattr(slots, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array [{rows}] (a permutation), got {slots!r}.")
    if jnp.shape(slots) != (rows,):
        raise ValueError(
            f"{name} must have shape ({rows},), a permutation of the {rows} grouped rows, got "
            f"shape {jnp.shape(slots)}."
        )
    if isinstance(slots, jax.core.Tracer):
        return
    if not np.array_equal(np.sort(np.asarray(slots)), np.arange(rows)):
        raise ValueError(f"{name} must be a permutation of range({rows}), got {slots!r}.")


def permuted_ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    lhs_slots: jax.Array | None = None,
    repeats: int = 1,
    out_slots: jax.Array | None = None,
    recipe: Recipe | None = None,
    preferred_element_type=None,
) -> jax.Array:
    """:func:`ragged_dot` on rows gathered into group order, its result scattered back: no copies.

    A Mixture-of-Experts layer sends each of its ``t`` tokens to ``repeats``
    (top-k) experts: ``m = t * repeats`` slots, slot ``s`` of token
    ``s // repeats``. Sorted by expert, the grouped rows are the slots
    ``lhs_slots [m]`` (a permutation of ``range(m)``): grouped row ``r``
    multiplies ``lhs[lhs_slots[r] // repeats]`` by its group's matrix, and
    ``out_slots [m]`` (a permutation) puts it at row ``out_slots[r]`` of the
    output. With both equal to the order that sorts slots by expert, the
    result is in slot order, ``[t * repeats, n]``:

    ``permuted_ragged_dot(x, w, sizes, lhs_slots=order, repeats=k, out_slots=order)``
    equals ``ragged_dot(x[order // k], w, sizes)[inverse(order)]``.

    The kernels read and write those rows by index, so neither the gathered
    nor the permuted copy is written; ``lhs`` is quantized before the gather
    (``t`` rows, not ``m``; one scale for both, since every row of ``lhs`` is
    gathered), and its gradient sums each row's ``repeats`` slots in f32.
    Under data parallelism the gathers and permutations run in XLA around the
    kernels. ``None`` for either map: the rows in their own order.

    Args:
      lhs: ``[t, k]`` high-precision rows; ``[m, k]`` without ``lhs_slots``.
      rhs, group_sizes, recipe, preferred_element_type: as in :func:`ragged_dot`
        (the groups partition the ``m`` grouped rows).
      lhs_slots: ``[m]`` int permutation, or None.
      repeats: slots per row of ``lhs`` (``m = t * repeats``); 1 without ``lhs_slots``.
      out_slots: ``[m]`` int permutation, or None.

    Concrete maps are checked to be permutations; inside ``jit`` they cannot
    be: a repeated index there leaves output rows unwritten (undefined).

    Example:
      >>> import jax, jax.numpy as jnp, fp8jax
      >>> x = jax.random.normal(jax.random.key(0), (4, 64))
      >>> w = jax.random.normal(jax.random.key(1), (3, 64, 32))
      >>> expert = jnp.array([2, 0, 0, 1, 2, 1, 0, 2])  # 4 tokens x top-2
      >>> order = jnp.argsort(expert, stable=True)
      >>> sizes = jnp.bincount(expert, length=3).astype(jnp.int32)
      >>> fp8jax.permuted_ragged_dot(x, w, sizes, lhs_slots=order, repeats=2,
      ...                            out_slots=order).shape
      (8, 32)
    """
    return sharded_permuted_ragged_dot(lhs, rhs, group_sizes, lhs_slots=lhs_slots,
                                       repeats=repeats, out_slots=out_slots, recipe=recipe,
                                       preferred_element_type=preferred_element_type)  # fmt: skip


def sharded_permuted_ragged_dot(lhs, rhs, group_sizes, *, lhs_slots=None, repeats: int = 1,
                                out_slots=None, recipe=None, preferred_element_type=None,
                                rhs_gather: tuple = (1, ())):  # fmt: skip
    """:func:`permuted_ragged_dot`, with ``rhs`` split over mesh axes inside ``shard_map``.

    ``rhs_gather``: ``(axis of rhs, mesh axes)``: ``rhs`` is this device's
    shard along that axis, quantized here and all-gathered in FP8; its
    gradient is reduce-scattered back (:func:`quantize_per_expert`). No
    axes: :func:`permuted_ragged_dot` itself.
    """
    gather = rhs_gather if rhs_gather[1] else ()
    if gather:
        shape = list(rhs.shape)
        shape[gather[0]] *= jax.lax.axis_size(gather[1])
        rhs_shape = jax.ShapeDtypeStruct(tuple(shape), rhs.dtype)
    else:
        rhs_shape = rhs
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}.")
    if lhs_slots is None and repeats != 1:
        raise ValueError(f"repeats={repeats} needs lhs_slots (the slots to gather), got None.")
    rows = lhs.shape[0] * repeats if lhs.ndim == 2 else 0
    _check(lhs, rhs_shape, group_sizes, rows, "lhs_slots")
    for name, slots in (("lhs_slots", lhs_slots), ("out_slots", out_slots)):
        if slots is not None:
            _check_slots(name, slots, rows)
    config = _config(lhs, rhs, recipe, None, preferred_element_type, repeats, gather)
    as_int = [None if i is None else i.astype(jnp.int32) for i in (lhs_slots, out_slots)]
    return _grouped_product(lhs, rhs, group_sizes.astype(jnp.int32), tuple(as_int), config)

"""FP8 ``dot_general``: one custom_vjp whose forward and backward GEMMs are all FP8.

Each operand is quantized once (:func:`fp8jax.ops.quantizing.quantize_operand`)
and handed to ``lax.dot_general`` as an FP8-typed array
(:mod:`fp8jax.ops.gemm`). Only the FP8 operands (1 byte per element) are
saved for the backward.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.formats import is_fp8
from fp8jax.ops import _partitioning, dimensions, fine_grained, gemm
from fp8jax.ops.operand import Fp8Layout
from fp8jax.ops.quantizing import quantize_operand
from fp8jax.ops.residuals import saved_as_bits
from fp8jax.ops.split import Split, SplitGradient, split_output_with_bias
from fp8jax.quantize import Fp8Array, check_high_precision
from fp8jax.recipes import DelayedScaling, Recipe, resolve_recipe
from fp8jax.scaling import DotScaleState, ScaleState, update_group


@dataclasses.dataclass(frozen=True)
class DotConfig:
    """Everything static about one FP8 dot_general; the custom_vjp's only static argument."""

    dimension_numbers: dimensions.DimensionNumbers
    recipe: Recipe
    out_dtype: np.dtype
    lhs_dtype: np.dtype
    rhs_dtype: np.dtype
    lhs_ndim: int
    # The kernel's leading axes the product contracts (gemm.kernel_contraction),
    # None where it is no kernel form.
    kernel_contraction: int | None
    # What each input's cotangent must match: shard_map axes, Explicit sharding.
    inputs: tuple[_partitioning.InputType, ...] = ()
    # Trailing output axes a bias spans (0 without one), and its dtype.
    bias_ndim: int = 0
    bias_dtype: np.dtype | None = None
    split: Split | None = None  # dense's output returned in pieces


class DotResiduals(NamedTuple):
    """What the forward of one FP8 dot_general saves for its backward."""

    lhs: Fp8Layout  # the copy the wgrad GEMM reads: transposed where the cast kernel made one
    rhs: Fp8Array
    state: DotScaleState | None
    amaxes: tuple[jax.Array, jax.Array] | None  # lhs's and rhs's, for the state's update


# The bias is an input here, not added after: its gradient then comes out of
# the pass that quantizes the output gradient (quantize_operand's column_sums).
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fp8_dot(lhs, rhs, bias, state, config: DotConfig):
    return _fp8_dot_fwd(lhs, rhs, bias, state, config)[0]


def _fp8_dot_fwd(lhs, rhs, bias, state, config: DotConfig):
    recipe, fmt = config.recipe, config.recipe.formats.forward
    dims, n_contract = config.dimension_numbers, config.kernel_contraction
    tokens_ndim = None if n_contract is None else lhs.ndim - n_contract
    # Each operand is read transposed by one of its GEMMs (lhs by the wgrad,
    # rhs by the forward) where the contraction is the kernel form.
    lhs_q = quantize_operand(lhs, fmt, state and state.x, recipe, rows_ndim=tokens_ndim,
                             transpose=n_contract is not None, rows_are_tokens=True)  # fmt: skip
    rhs_q = quantize_operand(rhs, fmt, state and state.kernel, recipe, rows_ndim=n_contract,
                             transpose=n_contract is not None)  # fmt: skip
    y = gemm.scaled_dot(lhs_q.fp8, rhs_q, dims, config.out_dtype, recipe.forward_precision)
    y = split_output_with_bias(y, bias, config.bias_ndim, config.split)
    amaxes = (lhs_q.amax, rhs_q.amax) if state is not None else None
    return y, DotResiduals(lhs_q.for_wgrad(), rhs_q.fp8, state, amaxes)


def _fp8_dot_bwd(config: DotConfig, residuals: DotResiduals, g):
    recipe, dims = config.recipe, config.dimension_numbers
    state = residuals.state
    lhs_ndim, n_contract = config.lhs_ndim, config.kernel_contraction
    if config.split is not None:
        g = SplitGradient(tuple(g), config.split.axis)
    # g's leading (token) axes are its rows where the wgrad GEMM contracts
    # them; a bias's gradient sums over the axes before the bias's.
    tokens_ndim = None if n_contract is None else lhs_ndim - n_contract
    rows_ndim = tokens_ndim if config.bias_ndim == 0 else g.ndim - config.bias_ndim
    g_q = quantize_operand(g, recipe.formats.backward, state and state.grad, recipe,
                           rows_ndim=rows_ndim,
                           transpose=tokens_ndim is not None and rows_ndim == tokens_ndim,
                           rows_are_tokens=True, column_sums=config.bias_ndim > 0)  # fmt: skip
    d_lhs, d_rhs = gemm.backward_dots(dims, lhs_ndim, residuals.lhs, residuals.rhs, g_q,
                                      config.lhs_dtype, config.rhs_dtype, recipe)  # fmt: skip
    new_state = None
    if state is not None:
        new_state = update_group(state, (*residuals.amaxes, g_q.amax), recipe)
    d_bias = None if config.bias_ndim == 0 else g_q.column_sums.astype(config.bias_dtype)
    return _partitioning.match_cotangents((d_lhs, d_rhs, d_bias), new_state, config.inputs)


_fp8_dot.defvjp(*saved_as_bits(_fp8_dot_fwd, _fp8_dot_bwd))


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


def result_dtype(lhs_dtype, rhs_dtype) -> np.dtype:
    """``lax.dot_general``'s output dtype for these (high-precision float) operands.

    The operand of greater range, then precision, wins, as in XLA's
    HigherPrecisionType: float16 x float32 is float32 (a float16 output
    would overflow where lax's does not), bfloat16 x float16 is bfloat16.
    """
    lhs_dtype, rhs_dtype = jnp.dtype(lhs_dtype), jnp.dtype(rhs_dtype)

    def rank(dtype):
        info = jnp.finfo(dtype)
        return info.maxexp, info.nmant, info.bits

    return lhs_dtype if rank(lhs_dtype) >= rank(rhs_dtype) else rhs_dtype


def out_dtype(preferred_element_type, default):
    """``preferred_element_type`` checked, or ``default`` where it is None."""
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
      preferred_element_type: output dtype; defaults to what ``lax.dot_general``
        returns, the wider of the two dtypes (float16 x float32 is float32).

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
    return dot_with_bias(lhs, rhs, None, dims, recipe, state, preferred_element_type)


def dot_with_bias(lhs, rhs, bias, dims, recipe, state, preferred_element_type,
                  split: Split | None = None):  # fmt: skip
    """:func:`dot_general` on checked inputs, plus a bias over the output's trailing axes.

    Everything static (the output dtype, the kernel contraction) is settled
    here, once, into the custom_vjp's config: the public wrappers call into
    this module once, and the forward and backward read the config instead of
    working it out again
    (docs/design.md#the-path-of-one-fp8-dense-forward-and-backward).
    """
    out = out_dtype(preferred_element_type, result_dtype(lhs.dtype, rhs.dtype))
    recipe = resolve_recipe(recipe)
    check_state(state, recipe)
    if fine_grained.is_fine(recipe):  # scales per row or block: GEMMs of their own
        return fine_grained.dot(lhs, rhs, bias, dims, recipe, out, split)
    config = DotConfig(
        dimension_numbers=dims,
        recipe=recipe,
        out_dtype=out,
        kernel_contraction=gemm.kernel_contraction(dims, lhs.ndim, rhs.ndim),
        lhs_dtype=jnp.dtype(lhs.dtype),
        rhs_dtype=jnp.dtype(rhs.dtype),
        lhs_ndim=lhs.ndim,
        inputs=_partitioning.input_types(lhs, rhs, bias, state),
        bias_ndim=0 if bias is None else bias.ndim,
        bias_dtype=None if bias is None else jnp.dtype(bias.dtype),
        split=split,
    )
    return _fp8_dot(lhs, rhs, bias, state, config)

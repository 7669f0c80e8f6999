"""LayerNorm/RMSNorm followed by an FP8 dense, in one custom_vjp.

The norm's output is quantized where it is computed
(:func:`fp8jax.ops._fused.normalize_and_quantize`) and never reaches HBM in
high precision. The bias is an input of the custom_vjp: its gradient comes
out of the pass that quantizes the output gradient. The norm's backward
runs in one pass (:mod:`fp8jax.kernels.norm_backward`) where its kernel runs,
with the residual connection's gradient added in it when the caller takes
the residual from the op (``return_residual``;
docs/design.md#the-norms-backward-in-one-pass).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fp8jax.ops import _fused, _partitioning, dimensions, fine_grained, gemm, norm
from fp8jax.ops._fused import FusedConfig, NormSaved
from fp8jax.ops.dot_general import check_state
from fp8jax.ops.norm import NormConfig, check_norm_args
from fp8jax.ops.operand import Fp8Layout
from fp8jax.ops.quantizing import quantize_operand
from fp8jax.ops.residuals import saved_as_bits
from fp8jax.ops.split import SplitGradient, make_split, split_output_with_bias
from fp8jax.quantize import Fp8Array, check_high_precision
from fp8jax.recipes import Recipe, resolve_recipe
from fp8jax.scaling import DotScaleState, update_group


class LnDenseResiduals(NamedTuple):
    """What layernorm_dense's forward saves for its backward."""

    norm: NormSaved
    normed: Fp8Array | None  # the norm's output, the GEMM's lhs (_fused.saved_output)
    kernel: Fp8Array
    state: DotScaleState | None
    amaxes: tuple[jax.Array, jax.Array]  # normed's and kernel's, for the state's update


# The bias is an input, as in dense: its gradient comes out of the pass that
# quantizes the output gradient (quantize_operand's column_sums).
@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _ln_dense(x, gamma, beta, kernel, bias, state, residual, config: FusedConfig):
    return _ln_dense_fwd(x, gamma, beta, kernel, bias, state, residual, config)[0]


def _ln_dense_fwd(x, gamma, beta, kernel, bias, state, residual, config: FusedConfig):
    recipe = config.recipe
    normed, norm = _fused.normalize_and_quantize(x, gamma, beta, state and state.x, config,
                                                 residual)  # fmt: skip
    x = norm.x  # with a residual, the sum the norm read
    kernel_q = quantize_operand(kernel, recipe.formats.forward, state and state.kernel, recipe,
                                rows_ndim=1, transpose=True)  # fmt: skip
    y = gemm.scaled_dot(normed.fp8, kernel_q, dimensions.contract_last(x.ndim), config.x_dtype,
                        recipe.forward_precision)  # fmt: skip
    y = split_output_with_bias(y, bias, kernel.ndim - 1, config.split)
    if config.return_normalized:
        y = (y, _fused.normalized(x, gamma, beta, config).astype(x.dtype))
    if config.return_residual:
        y = (y, x)
    return y, LnDenseResiduals(norm, _fused.saved_output(normed, norm), kernel_q.fp8, state,
                               (normed.amax, kernel_q.amax))  # fmt: skip


def _ln_dense_bwd(config: FusedConfig, saved: LnDenseResiduals, cotangent):
    x, gamma, beta, mean, rstd, _ = saved.norm
    recipe, state = config.recipe, saved.state
    g, g_normed = cotangent if config.return_normalized else (cotangent, None)
    g, g_residual = g if config.return_residual else (g, None)
    if config.split is not None:
        g = SplitGradient(tuple(g), config.split.axis)
    g_q = quantize_operand(g, recipe.formats.backward, state and state.grad, recipe,
                           rows_ndim=x.ndim - 1, transpose=True, rows_are_tokens=True,
                           column_sums=config.bias_dtype is not None)  # fmt: skip
    normed = _fused.fp8_output(saved.normed, saved.norm, config, g_q.fp8.data)
    d_normed, d_kernel = gemm.backward_dots(
        dimensions.contract_last(x.ndim), x.ndim, Fp8Layout(normed), saved.kernel, g_q,
        x.dtype, config.kernel_dtypes[0], recipe,
    )  # fmt: skip
    if g_normed is not None:
        d_normed = d_normed.astype(jnp.float32) + g_normed.astype(jnp.float32)
    dx, dgamma, dbeta = norm.fused_normalize_backward(d_normed, x, mean, rstd, gamma, beta,
                                                        config.norm, g_residual)  # fmt: skip
    new_state = None if state is None else update_group(state, (*saved.amaxes, g_q.amax), recipe)
    d_bias = None
    if config.bias_dtype is not None:
        d_bias = g_q.column_sums.astype(config.bias_dtype)
    return _fused.with_residual_cotangent(
        _partitioning.match_cotangents((dx, dgamma, dbeta, d_kernel, d_bias), new_state,
                                       config.inputs[:-1]), dx, config)  # fmt: skip


_ln_dense.defvjp(*saved_as_bits(_ln_dense_fwd, _ln_dense_bwd))


def layernorm_dense(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    *,
    norm_type: str = "layernorm",
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    recipe: Recipe | None = None,
    state: DotScaleState | None = None,
    return_normalized: bool = False,
    return_residual: bool = False,
    split: Sequence[int] | None = None,
    split_axis: int = -2,
    residual: jax.Array | None = None,
):
    """LayerNorm/RMSNorm followed by an FP8 dense, fused.

    Args:
      x: activations ``(..., hidden)``.
      gamma: norm scale ``(hidden,)``.
      beta: norm shift ``(hidden,)``, or None (always None for rmsnorm).
      kernel: ``(hidden, *features)``.
      bias: optional, shaped ``features``.
      norm_type: ``"layernorm"`` or ``"rmsnorm"``.
      zero_centered_gamma: if True the effective norm scale is ``1 + gamma``.
      epsilon: added to the variance; must be > 0.
      recipe: CurrentScaling (default) or DelayedScaling.
      state: DelayedScaling state from ``fp8jax.init_state(recipe)`` (a
        :class:`~fp8jax.DotScaleState`); its role ``x`` is the normalized input.
      return_normalized: also return the normalized ``x`` (in ``x.dtype``),
        e.g. for a residual taken after the norm.
      return_residual: also return ``x`` itself, for a residual taken before
        the norm (pre-norm). Use it for the residual connection: its gradient
        then reaches the op's backward, which adds it to the norm's in the
        same pass (:mod:`fp8jax.kernels.norm_backward`) instead of XLA adding the
        two afterwards. Not with ``return_normalized``.
      split: return ``y`` as a tuple of pieces of these sizes along
        ``split_axis``, as ``jnp.split`` would cut it. For a fused QKV
        projection: the backward then casts the pieces' gradients to FP8
        straight from the pieces, where slicing outside the op makes XLA
        write their sum in bf16 first (:mod:`fp8jax.ops.split`).
      split_axis: the feature axis ``split`` cuts, counted from the end.
      residual: None, or a branch output shaped like ``x`` (a pre-norm block's
        ``x + attention(...)``): the op normalizes ``x + residual``, computed
        in the pass that reads ``x`` for the norm, and ``return_residual``
        returns that sum (the new residual stream). Both inputs' gradients
        are the sum's, from the norm's one backward pass. A saving where the
        branch is in memory anyway; straight after an FP8 GEMM, XLA fuses the
        add with the GEMM's dequantizing multiply, which the kernel cannot
        take, so there the add outside costs less (the layers keep it there).

    Returns:
      ``y`` of shape ``(..., *features)`` in ``x.dtype`` (a tuple of pieces
      with ``split``), or ``(y, normalized)``, or ``(y, x)`` (``x + residual``
      with ``residual``).

    Example:
      >>> import jax, jax.numpy as jnp, fp8jax
      >>> x = jax.random.normal(jax.random.key(0), (4, 16, 64), jnp.bfloat16)
      >>> w = jax.random.normal(jax.random.key(1), (64, 3, 8)) * 0.1
      >>> fp8jax.layernorm_dense(x, jnp.ones(64), jnp.zeros(64), w).shape
      (4, 16, 3, 8)
      >>> q, k, v = fp8jax.layernorm_dense(x, jnp.ones(64), jnp.zeros(64), w, split=(1, 1, 1))
      >>> q.shape
      (4, 16, 1, 8)
    """
    norm = NormConfig(norm_type, zero_centered_gamma, epsilon)
    check_norm_args(x, gamma, beta, norm)
    _fused.check_residual(x, residual)
    if return_normalized and return_residual:
        raise ValueError(
            "return_normalized and return_residual are alternatives (a residual taken after the "
            "norm, or before it); got both True."
        )
    check_high_precision("kernel", kernel)
    if kernel.ndim < 2 or kernel.shape[0] != x.shape[-1]:
        raise ValueError(
            f"kernel must have shape (hidden={x.shape[-1]}, *features), got {tuple(kernel.shape)}."
        )
    gemm.check_bias(bias, kernel.shape[1:])
    recipe = resolve_recipe(recipe)
    check_state(state, recipe)
    inputs = _partitioning.input_types(x, gamma, beta, kernel, bias, state, residual)
    bias_dtype = None if bias is None else jnp.dtype(bias.dtype)
    out_shape = (*x.shape[:-1], *kernel.shape[1:])
    pieces = make_split(split, split_axis, out_shape, kernel.ndim - 1)
    if fine_grained.is_fine(recipe):  # composed, not fused (fp8jax.ops.fine_grained)
        x = x if residual is None else x + residual
        return fine_grained.layernorm_dense(x, gamma, beta, kernel, bias, norm, recipe,
                                            split=pieces, return_normalized=return_normalized,
                                            return_residual=return_residual)  # fmt: skip
    config = FusedConfig(norm, recipe, jnp.dtype(x.dtype), (jnp.dtype(kernel.dtype),),
                         return_normalized=return_normalized, return_residual=return_residual,
                         inputs=inputs, bias_dtype=bias_dtype, split=pieces,
                         has_residual=residual is not None)  # fmt: skip
    return _ln_dense(x, gamma, beta, kernel, bias, state, residual, config)

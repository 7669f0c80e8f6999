"""LayerNorm + FP8 dense, and the FP8 MLP block, each one custom_vjp.

The normalized input never reaches HBM in high precision. Under delayed
scaling one kernel computes the norm, its FP8 cast and its maxima from a
single read of x (:mod:`fp8jax.ops.norm_forward`;
docs/design.md#the-norms-forward-and-its-fp8-cast-in-one-kernel); elsewhere it is
quantized in the fusions that compute it, the amax pass recomputing it
from x (:func:`~fp8jax.ops.dense.quantize_computed`). The activation's gradient,
and the activation itself under current scaling or without a bias, cost too
much to compute twice; each is written once, in the activations' dtype, and
read back by its quantize pass (:func:`~fp8jax.ops.dense.quantize_stored`).
Under delayed scaling the activation, one or a gated pair, and its
gradient are computed inside FP8 cast kernels on the GPU
(:mod:`fp8jax.ops.activation_cast`; not erf's gelu, which measured slower
there); where those do not run, a biased activation is cast to FP8 where
XLA computes it (:func:`~fp8jax.ops.dense.quantize_recomputed`). Biases are inputs
of the custom_vjps: their gradients come out of the pass that quantizes the
output gradient (:func:`~fp8jax.ops.dense.quantize_gradient`). The ops save
only FP8 GEMM operands, the input, the per-row statistics and, for the MLP,
the first GEMM's output, which the activation's backward needs. The norm's
backward runs in one pass (:mod:`fp8jax.ops.norm_backward`) where its
kernel runs, with the residual connection's gradient added in it when the
caller takes the residual from the op (``return_residual``;
docs/design.md#the-norms-backward-in-one-pass).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax import activations as activations_
from fp8jax.activations import gelu  # noqa: F401  (fp8jax.ops.fused.gelu, as before)
from fp8jax.kernels import dispatch
from fp8jax.ops import (
    _partitioning,
    activation_cast,
    fine_fused,
    fine_grained,
    norm_backward,
    norm_forward,
)
from fp8jax.ops.dense import (
    add_bias,
    amax_for_update,
    backward_dots,
    check_bias,
    check_state,
    dgrad_dot,
    quantize_computed,
    quantize_in_both_layouts,
    quantize_output_gradient,
    quantize_recomputed,
    quantize_stored,
    quantize_transposed,
    scaled_dot,
    wgrad_over_tokens,
)
from fp8jax.ops.norm import NormConfig, check_norm_args, normalize
from fp8jax.ops.split import Split, SplitGradient, make_split
from fp8jax.quantize import Fp8Array, check_high_precision
from fp8jax.recipes import Recipe, resolve_recipe
from fp8jax.scaling import DotScaleState, MlpScaleState, update_group

# XLA's formula of each activation, by name (fp8jax.activations.REGISTRY).
ACTIVATIONS = {name: a.xla for name, a in activations_.REGISTRY.items()}


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """Static settings of a fused op; its custom_vjp's only static argument."""

    norm: NormConfig
    recipe: Recipe
    x_dtype: jnp.dtype  # also the dtype of every activation the op outputs
    kernel_dtypes: tuple[jnp.dtype, ...]  # cotangents come back in these
    activations: tuple[str, ...] = ()
    return_normalized: bool = False
    return_residual: bool = False  # also return x, whose gradient then joins the norm's
    # What each input's cotangent must match: shard_map axes, Explicit sharding.
    inputs: tuple[_partitioning.InputType, ...] = ()
    bias_dtype: jnp.dtype | None = None  # layernorm_dense's bias, None without one
    split: Split | None = None  # layernorm_dense's output returned in pieces


def _normalized(x, gamma, beta, config: FusedConfig):
    return normalize(x, gamma, beta, config.norm)[0]


def gated(pre, activations, axis=-2):
    """The (gated) activation of ``pre``, in f32.

    ``pre``'s axis ``axis`` (of size ``len(activations)``) picks the activation:
    ``(..., len(activations), ffn)`` by default.
    """
    pre32 = pre.astype(jnp.float32)
    h = ACTIVATIONS[activations[0]](lax.index_in_dim(pre32, 0, axis, keepdims=False))
    for i, name in enumerate(activations[1:], start=1):
        h = h * ACTIVATIONS[name](lax.index_in_dim(pre32, i, axis, keepdims=False))
    return h


def _contract_last(lhs_ndim: int):
    return (((lhs_ndim - 1,), (0,)), ((), ()))


def _backward_dots(lhs_ndim, lhs_q, rhs_q, g_q, lhs_dtype, rhs_dtype, recipe: Recipe, g_t=None):
    """:func:`~fp8jax.ops.dense.backward_dots` of a GEMM contracting lhs's last axis."""
    return backward_dots(_contract_last(lhs_ndim), lhs_ndim, lhs_q, rhs_q, g_q, lhs_dtype,
                         rhs_dtype, recipe, g_t=g_t)  # fmt: skip


def _rows_sum(v, like):
    return None if like is None else jnp.sum(v.astype(jnp.float32), axis=tuple(
        range(v.ndim - like.ndim))).astype(like.dtype)  # fmt: skip


# --- layernorm_dense ---------------------------------------------------------------


# The bias is an input, as in dense: its gradient comes out of the pass that
# quantizes the output gradient (quantize_gradient).
@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _ln_dense(x, gamma, beta, kernel, bias, state, config: FusedConfig):
    return _ln_dense_fwd(x, gamma, beta, kernel, bias, state, config)[0]


def _normalize_and_quantize(x, gamma, beta, state, config: FusedConfig):
    """``(normed_q, normed_amax, mean, rstd)``: the norm's FP8 output, its amax, the statistics.

    Under delayed scaling (``state``, the output's ScaleState) in one kernel
    where it runs (:mod:`fp8jax.ops.norm_forward`); else XLA's passes.
    """
    recipe, fmt = config.recipe, config.recipe.formats.forward
    row_axes = None if state is None else norm_forward.kernel_row_axes(x)
    if row_axes is not None:
        q, maxima, mean, rstd = norm_forward.normalize_and_cast(
            x, gamma, beta, config.norm, state.scale, fmt, row_axes
        )
        scale_inv = 1.0 / state.scale.astype(jnp.float32)  # as quantize_with_scale computes it
        return Fp8Array(q, scale_inv, fmt), amax_for_update(maxima, recipe), mean, rstd
    _, mean, rstd = normalize(x, gamma, beta, config.norm)
    normed_q, normed_amax = quantize_computed(
        functools.partial(_normalized, config=config), (x, gamma, beta), fmt, state, recipe,
        jnp.float32,
    )  # fmt: skip
    return normed_q, normed_amax, mean, rstd


def _ln_dense_fwd(x, gamma, beta, kernel, bias, state, config: FusedConfig):
    recipe = config.recipe
    normed_q, normed_amax, mean, rstd = _normalize_and_quantize(
        x, gamma, beta, state and state.x, config
    )
    kernel_q, kernel_t, kernel_amax = quantize_in_both_layouts(
        kernel, recipe.formats.forward, state and state.kernel, recipe, rows_ndim=1
    )
    y = scaled_dot(normed_q, kernel_q, _contract_last(x.ndim), config.x_dtype,
                   recipe.forward_precision, kernel_t=kernel_t)  # fmt: skip
    y = add_bias(y, bias, kernel.ndim - 1)
    if config.split is not None:
        y = config.split.apply(y)
    if config.return_normalized:
        y = (y, _normalized(x, gamma, beta, config).astype(x.dtype))
    if config.return_residual:
        y = (y, x)
    residuals = (x, gamma, beta, mean, rstd, normed_q, kernel_q, state)
    return y, (residuals, (normed_amax, kernel_amax))


def _ln_dense_bwd(config: FusedConfig, saved, cotangent):
    (x, gamma, beta, mean, rstd, normed_q, kernel_q, state), amaxes = saved
    recipe = config.recipe
    g, g_normed = cotangent if config.return_normalized else (cotangent, None)
    g, g_residual = g if config.return_residual else (g, None)
    if config.split is not None:
        g = SplitGradient(tuple(g), config.split.axis)
    bias_ndim = 0 if config.bias_dtype is None else kernel_q.data.ndim - 1
    g_q, g_t, g_amax, d_bias = quantize_output_gradient(
        g, recipe.formats.backward, state and state.grad, recipe, x.ndim - 1, bias_ndim
    )
    d_normed, d_kernel = _backward_dots(x.ndim, normed_q, kernel_q, g_q, x.dtype,
                                        config.kernel_dtypes[0], recipe, g_t=g_t)  # fmt: skip
    if g_normed is not None:
        d_normed = d_normed.astype(jnp.float32) + g_normed.astype(jnp.float32)
    dx, dgamma, dbeta = norm_backward.normalize_backward(d_normed, x, mean, rstd, gamma, beta,
                                                        config.norm, g_residual)  # fmt: skip
    new_state = None if state is None else update_group(state, (*amaxes, g_amax), recipe)
    d_bias = None if d_bias is None else d_bias.astype(config.bias_dtype)
    return _partitioning.match_cotangents((dx, dgamma, dbeta, d_kernel, d_bias), new_state,
                                          config.inputs)  # fmt: skip


_ln_dense.defvjp(_ln_dense_fwd, _ln_dense_bwd)


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
        same pass (:mod:`fp8jax.ops.norm_backward`) instead of XLA adding the
        two afterwards. Not with ``return_normalized``.
      split: return ``y`` as a tuple of pieces of these sizes along
        ``split_axis``, as ``jnp.split`` would cut it. For a fused QKV
        projection: the backward then casts the pieces' gradients to FP8
        straight from the pieces, where slicing outside the op makes XLA
        write their sum in bf16 first (:mod:`fp8jax.ops.split`).
      split_axis: the feature axis ``split`` cuts, counted from the end.

    Returns:
      ``y`` of shape ``(..., *features)`` in ``x.dtype`` (a tuple of pieces
      with ``split``), or ``(y, normalized)``, or ``(y, x)``.

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
    check_bias(bias, kernel.shape[1:])
    recipe = resolve_recipe(recipe)
    check_state(state, recipe)
    inputs = _partitioning.input_types(x, gamma, beta, kernel, bias, state)
    bias_dtype = None if bias is None else jnp.dtype(bias.dtype)
    out_shape = (*x.shape[:-1], *kernel.shape[1:])
    pieces = make_split(split, split_axis, out_shape, kernel.ndim - 1)
    if fine_grained.is_fine(recipe):  # composed, not fused (fp8jax.ops.fine_fused)
        return fine_fused.layernorm_dense(x, gamma, beta, kernel, bias, norm, recipe, split=pieces,
                                          return_normalized=return_normalized,
                                          return_residual=return_residual)  # fmt: skip
    config = FusedConfig(norm, recipe, jnp.dtype(x.dtype), (jnp.dtype(kernel.dtype),),
                         return_normalized=return_normalized, return_residual=return_residual,
                         inputs=inputs, bias_dtype=bias_dtype, split=pieces)  # fmt: skip
    return _ln_dense(x, gamma, beta, kernel, bias, state, config)


# --- layernorm_mlp -----------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _mlp(x, gamma, beta, k1, b1, k2, b2, state, config: FusedConfig):
    return _mlp_fwd(x, gamma, beta, k1, b1, k2, b2, state, config)[0]


def _mlp_fwd(x, gamma, beta, k1, b1, k2, b2, state, config: FusedConfig):
    recipe, fwd = config.recipe, config.recipe.formats.forward
    fc1, fc2 = (None, None) if state is None else state
    normed_q, normed_amax, mean, rstd = _normalize_and_quantize(
        x, gamma, beta, fc1 and fc1.x, config
    )
    # kernel_1 goes in as (hidden, ffn, n), so that the GEMM writes pre interleaved.
    # Gated (n > 1), that view is a transpose, which XLA fuses into its own
    # quantize pass; quantize_in_both_layouts's kernel would need it written out first.
    k1_q, k1_t, k1_amax = quantize_in_both_layouts(
        _interleave(k1), fwd, fc1 and fc1.kernel, recipe, rows_ndim=1 if k1.shape[1] == 1 else None
    )
    pre = scaled_dot(normed_q, k1_q, _contract_last(x.ndim), config.x_dtype,
                     recipe.forward_precision, kernel_t=k1_t)  # fmt: skip
    activation = functools.partial(_activation, activations=config.activations)
    kernel_axes = _activation_kernel_axes(pre, config, delayed=state is not None)
    if kernel_axes is not None:
        h_q, h_amax = _cast_activation(pre, b1, fc2.x.scale, config, kernel_axes)
    elif fc2 is not None and b1 is not None:
        h_q, h_amax = quantize_recomputed(activation, pre, (b1,), fwd, fc2.x, recipe,
                                          config.x_dtype)  # fmt: skip
    else:
        h = activation(pre, b1).astype(config.x_dtype)
        h_q, h_amax, _ = quantize_stored(h, fwd, fc2 and fc2.x, recipe)
    k2_q, k2_t, k2_amax = quantize_in_both_layouts(k2, fwd, fc2 and fc2.kernel, recipe, rows_ndim=1)
    y = scaled_dot(h_q, k2_q, _contract_last(h_q.data.ndim), config.x_dtype,
                   recipe.forward_precision, kernel_t=k2_t)  # fmt: skip
    y = add_bias(y, b2, 1)
    if config.return_residual:
        y = (y, x)
    residuals = (x, gamma, beta, mean, rstd, normed_q, k1_q, b1, pre, h_q, k2_q, b2, state)
    return y, (residuals, (normed_amax, k1_amax, h_amax, k2_amax))


def _interleave(a):
    """``(..., n, ffn)`` as ``(..., ffn, n)``, and back: the layout of the pre-activation.

    A gated activation pairs ``pre[..., 0, f]`` with ``pre[..., 1, f]``. In
    kernel_1's own layout the two are ffn elements apart, and XLA's fusion for
    the activation's gradient computes each of its output rows separately,
    reading both input rows for each: every pre-activation element comes from
    HBM twice. Interleaved, a pair sits side by side and neighbouring threads
    share one read; on the H200 the GeGLU block's gradient fusion took about
    30% less time (docs/design.md#the-interleaved-gated-pre-activation).
    The price is kernel_1's gradient, which the wgrad GEMM writes as (hidden,
    ffn, n) and which is transposed back in bf16. For one activation (n = 1)
    the two layouts are the same.
    """
    return jnp.swapaxes(a, -1, -2)


def _activation(pre, bias, activations):
    """:func:`gated` of ``pre + bias``, ``pre`` interleaved ``(..., ffn, n)``, in f32.

    The bias is added here rather than in the GEMM's epilogue: the forward
    fusion and the backward recompute both read ``pre`` anyway.
    """
    pre32 = pre.astype(jnp.float32)
    if bias is not None:
        pre32 = pre32 + _partitioning.broadcastable(_interleave(bias).astype(jnp.float32), pre.ndim)
    return gated(pre32, activations, axis=-1)


def _activation_grad(dh, pre, bias, activations):
    _, vjp = jax.vjp(lambda p: _activation(p, bias, activations), pre.astype(jnp.float32))
    return vjp(dh.astype(jnp.float32))[0]


def _mlp_bwd(config: FusedConfig, saved, g):
    (x, *_, b1, pre, h_q, k2_q, b2, state), _ = saved
    g, g_residual = g if config.return_residual else (g, None)
    recipe, bwd = config.recipe, config.recipe.formats.backward
    fc1, fc2 = (None, None) if state is None else state
    g_q, g_t, g_amax, db2 = quantize_output_gradient(
        g, bwd, fc2 and fc2.grad, recipe, x.ndim - 1, bias_ndim=0 if b2 is None else 1
    )
    kernel_axes = _activation_kernel_axes(pre, config, delayed=state is not None)
    if kernel_axes is not None:
        dh = dgrad_dot(_contract_last(x.ndim), x.ndim, k2_q, g_q, config.x_dtype, recipe,
                       like=h_q.data)  # fmt: skip
        dpre_q, dpre_t, dpre_amax, db1, h_t = _cast_activation_gradient(
            dh, pre, b1, fc1.grad.scale, fc2.x.scale, config, kernel_axes
        )
        dk2 = wgrad_over_tokens(h_t, g_q if g_t is None else g_t, k2_q.shape,
                                config.kernel_dtypes[1], recipe, lhs_transposed=True,
                                g_transposed=g_t is not None)  # fmt: skip
        return _mlp_bwd_after_activation(config, saved, dpre_q, dpre_t, dpre_amax, db1, dk2,
                                         db2, g_amax, g_residual)  # fmt: skip
    dh, dk2 = _backward_dots(x.ndim, h_q, k2_q, g_q, config.x_dtype,
                             config.kernel_dtypes[1], recipe, g_t=g_t)  # fmt: skip
    # Without the barrier XLA shares the activation's f32 math between the
    # forward and this recompute, and keeps it in f32 from the forward until
    # here: 4 bytes per element more held and moved than pre.
    pre = jax.lax.optimization_barrier(pre)
    dpre = _activation_grad(dh, pre, b1, config.activations).astype(config.x_dtype)
    # Under delayed scaling too the gradient goes to HBM in bf16 and back,
    # where the forward activation does not (quantize_recomputed): bias_1's
    # gradient is a column sum, and XLA's reduction kernels run the
    # activation's gradient math slowly: one XLA kernel doing all of it took
    # several times the bf16 write and the cast together on the H200
    # (docs/design.md#tried-and-dropped). fp8jax.ops.activation_cast does it
    # in Pallas where it runs.
    transposed = quantize_transposed(dpre, bwd, fc1 and fc1.grad, recipe, x.ndim - 1,
                                     rows_are_tokens=True, column_sums=b1 is not None)  # fmt: skip
    if transposed is None:
        dpre_q, dpre_amax, dpre = quantize_stored(dpre, bwd, fc1 and fc1.grad, recipe)
        dpre_t = None
        db1 = None if b1 is None else _rows_sum(dpre, b1)
    else:
        dpre_q, dpre_t, dpre_amax, column_sums = transposed
        db1 = None if b1 is None else column_sums.astype(b1.dtype)
    return _mlp_bwd_after_activation(config, saved, dpre_q, dpre_t, dpre_amax, db1, dk2, db2,
                                     g_amax, g_residual)  # fmt: skip


def _mlp_bwd_after_activation(config: FusedConfig, saved, dpre_q, dpre_t, dpre_amax, db1, dk2,
                              db2, g_amax, g_residual):  # fmt: skip
    """The MLP's backward from its activation's FP8 gradient on: kernel_1's GEMMs, the norm."""
    (x, gamma, beta, mean, rstd, normed_q, k1_q, _, _, _, _, b2, state), amaxes = saved
    normed_amax, k1_amax, h_amax, k2_amax = amaxes
    recipe = config.recipe
    dnormed, dk1 = _backward_dots(x.ndim, normed_q, k1_q, dpre_q, x.dtype,
                                  config.kernel_dtypes[0], recipe, g_t=dpre_t)  # fmt: skip
    dk1 = _interleave(dk1)
    db1 = None if db1 is None else _interleave(db1)
    dx, dgamma, dbeta = norm_backward.normalize_backward(dnormed, x, mean, rstd, gamma, beta,
                                                        config.norm, g_residual)  # fmt: skip
    db2 = None if b2 is None else db2.astype(b2.dtype)
    new_state = None
    if state is not None:
        new_state = update_group(
            state, ((normed_amax, k1_amax, dpre_amax), (h_amax, k2_amax, g_amax)), recipe
        )
    cotangents = (dx, dgamma, dbeta, dk1, db1, dk2, db2)
    return _partitioning.match_cotangents(cotangents, new_state, config.inputs)


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def _activation_kernel_axes(pre, config: FusedConfig, delayed: bool) -> tuple[str, ...] | None:
    """The mesh axes splitting the rows the activation kernels run on, or None for XLA's path.

    The kernels (:mod:`fp8jax.ops.activation_cast`) compute one activation
    or a gated pair and need their scales before their values: delayed
    scaling. They run where :func:`fp8jax.kernels.dispatch.placement` puts
    them on token rows, for the activations
    the registry's kernel serves (:attr:`fp8jax.activations.Activation.kernel`).
    """
    activations = config.activations
    if not delayed or len(activations) > 2:
        return None
    if not activations_.kernel_serves(activations):
        return None
    if pre.size == 0:  # an empty pre-activation fills no tile
        return None
    rows_by_width = (pre.size // (pre.shape[-2] * pre.shape[-1]), pre.shape[-2] * pre.shape[-1])
    return dispatch.placement(
        lambda shards: activation_cast.fits(rows_by_width, len(activations), shards)
    )


def _rows(pre, b1):
    """``pre`` (..., ffn, n) as the kernels' (rows, ffn * n) matrix, and b1 (n, ffn) to match."""
    width = pre.shape[-2] * pre.shape[-1]
    return pre.reshape(-1, width), None if b1 is None else _interleave(b1).reshape(width)


def _cast_activation(pre, b1, scale, config: FusedConfig, row_axes):
    """``h`` in FP8 from the forward activation kernel, and its amax."""
    fmt = config.recipe.formats.forward
    data, h_amax = activation_cast.cast_activation(*_rows(pre, b1), config.activations, scale,
                                                   fmt, row_axes)  # fmt: skip
    h_amax = amax_for_update(h_amax, config.recipe)
    return Fp8Array(data.reshape(pre.shape[:-1]), 1.0 / scale.astype(jnp.float32), fmt), h_amax


def _cast_activation_gradient(dh, pre, b1, scale, h_scale, config: FusedConfig, row_axes):
    """The backward activation kernel: pre's gradient as quantize_transposed gives it, and h_t."""
    recipe = config.recipe
    fmt, h_fmt = recipe.formats.backward, recipe.formats.forward
    rows, bias = _rows(pre, b1)
    out, h_t = activation_cast.cast_activation_gradient(
        dh.reshape(rows.shape[0], -1), rows, bias, config.activations, scale, fmt, h_scale,
        h_fmt, row_axes,
    )  # fmt: skip
    scale_inv = 1.0 / scale.astype(jnp.float32)
    dpre_q = Fp8Array(out.q.reshape(pre.shape), scale_inv, fmt)
    dpre_t = Fp8Array(out.q_t, scale_inv, fmt)
    db1 = None if b1 is None else out.column_sums.reshape(pre.shape[-2:]).astype(b1.dtype)
    h_t = Fp8Array(h_t, 1.0 / h_scale.astype(jnp.float32), h_fmt)
    return dpre_q, dpre_t, amax_for_update(out.maxima, recipe), db1, h_t


def _check_bias(name: str, bias, shape: tuple[int, ...]) -> None:
    if bias is None:
        return
    check_high_precision(name, bias)
    if tuple(bias.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(bias.shape)}.")


def layernorm_mlp(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None,
    kernel_1: jax.Array,
    kernel_2: jax.Array,
    bias_1: jax.Array | None = None,
    bias_2: jax.Array | None = None,
    *,
    activations=("gelu", "linear"),
    norm_type: str = "layernorm",
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    recipe: Recipe | None = None,
    state: MlpScaleState | None = None,
    return_residual: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Norm -> FP8 GEMM -> (gated) activation -> FP8 GEMM: a transformer MLP block.

    All six GEMMs of forward and backward are FP8. For two activations the
    first GEMM computes both branches at once and their product is the gate:
    ``("gelu", "linear")`` is GeGLU, ``("silu", "linear")`` SwiGLU,
    ``("relu", "linear")`` ReGLU; one name is a plain MLP.

    Args:
      x: activations ``(..., hidden)``.
      gamma: norm scale ``(hidden,)``.
      beta: norm shift ``(hidden,)`` or None.
      kernel_1: ``(hidden, len(activations), ffn)``.
      kernel_2: ``(ffn, hidden_out)``.
      bias_1: optional ``(len(activations), ffn)``.
      bias_2: optional ``(hidden_out,)``.
      activations: names from gelu, gelu_tanh, relu, silu, linear.
      norm_type: ``"layernorm"`` or ``"rmsnorm"``.
      zero_centered_gamma: if True the effective norm scale is ``1 + gamma``.
      epsilon: added to the variance; must be > 0.
      recipe: CurrentScaling (default) or DelayedScaling.
      state: ``fp8jax.init_state(recipe, fp8jax.MlpScaleState)`` for DelayedScaling.
      return_residual: also return ``x`` itself, for the residual connection
        around the block: its gradient then joins the norm's backward in one
        pass (see :func:`layernorm_dense`).

    Returns:
      ``(..., hidden_out)`` in ``x.dtype``, or ``(y, x)`` with ``return_residual``.

    Raises:
      ValueError: for an unknown activation, kernels that do not fit the
        activations or the hidden size, or epsilon <= 0.

    Example:
      >>> import jax, jax.numpy as jnp, fp8jax
      >>> x = jax.random.normal(jax.random.key(0), (2, 8, 64), jnp.bfloat16)
      >>> k1 = jax.random.normal(jax.random.key(1), (64, 2, 256)) * 0.05
      >>> k2 = jax.random.normal(jax.random.key(2), (256, 64)) * 0.05
      >>> y = fp8jax.layernorm_mlp(x, jnp.ones(64), None, k1, k2,
      ...                          activations=("silu", "linear"), norm_type="rmsnorm")
      >>> y.shape, y.dtype
      ((2, 8, 64), dtype(bfloat16))
    """
    activations = activations_.check(activations)
    norm = NormConfig(norm_type, zero_centered_gamma, epsilon)
    check_norm_args(x, gamma, beta, norm)
    check_high_precision("kernel_1", kernel_1)
    check_high_precision("kernel_2", kernel_2)
    hidden = x.shape[-1]
    if kernel_1.ndim != 3 or kernel_1.shape[:2] != (hidden, len(activations)):
        raise ValueError(
            f"kernel_1 must have shape (hidden={hidden}, len(activations)={len(activations)}, "
            f"ffn), got {tuple(kernel_1.shape)}."
        )
    ffn = kernel_1.shape[2]
    if kernel_2.ndim != 2 or kernel_2.shape[0] != ffn:
        raise ValueError(
            f"kernel_2 must have shape (ffn={ffn}, hidden_out), got {tuple(kernel_2.shape)}."
        )
    _check_bias("bias_1", bias_1, (len(activations), ffn))
    _check_bias("bias_2", bias_2, (kernel_2.shape[1],))
    recipe = resolve_recipe(recipe)
    check_state(state, recipe, MlpScaleState)
    if fine_grained.is_fine(recipe):  # composed, not fused (fp8jax.ops.fine_fused)
        return fine_fused.layernorm_mlp(x, gamma, beta, kernel_1, kernel_2, bias_1, bias_2, norm,
                                        recipe, activations,
                                        return_residual=return_residual)  # fmt: skip
    config = FusedConfig(
        norm, recipe, jnp.dtype(x.dtype), (jnp.dtype(kernel_1.dtype), jnp.dtype(kernel_2.dtype)),
        activations=activations, return_residual=return_residual,
        inputs=_partitioning.input_types(x, gamma, beta, kernel_1, bias_1, kernel_2, bias_2, state),
    )  # fmt: skip
    return _mlp(x, gamma, beta, kernel_1, bias_1, kernel_2, bias_2, state, config)

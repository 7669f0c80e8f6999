"""The FP8 MLP block: norm -> FP8 GEMM -> (gated) activation -> FP8 GEMM, in one custom_vjp.

The normalized input never reaches HBM in high precision
(:func:`fp8jax.ops._fused.normalize_and_quantize`). The activation's
gradient, and the activation itself under current scaling or without a
bias, cost too much to compute twice; each is written once, in the
activations' dtype, and read back by its quantize pass
(:func:`fp8jax.ops.quantizing.quantize_operand`, ``stored``). Under delayed
scaling the activation, one or a gated pair, and its gradient are computed
inside FP8 cast kernels on the GPU (:mod:`fp8jax.kernels.activation_cast`; not
erf's gelu, which measured slower there); where those do not run, a biased
activation is cast to FP8 where XLA computes it
(:class:`~fp8jax.ops.quantizing.Recomputed`). Biases are inputs of the
custom_vjp: their gradients come out of the pass that quantizes the output
gradient. The op saves only FP8 GEMM operands, the input, the per-row
statistics and the first GEMM's output, which the activation's backward
needs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax import activations as activations_
from fp8jax.activations import gated
from fp8jax.kernels import activation_cast, dispatch
from fp8jax.ops import _fused, _partitioning, dimensions, fine_grained, gemm, norm
from fp8jax.ops._fused import FusedConfig, NormSaved
from fp8jax.ops.dot_general import check_state
from fp8jax.ops.norm import NormConfig, check_norm_args
from fp8jax.ops.operand import Fp8Layout, QuantizedOperand, from_kernel, inverse, transposed_copy
from fp8jax.ops.quantizing import (
    Recomputed,
    amax_for_update,
    current_amax_and_scale,
    quantize_operand,
)
from fp8jax.ops.residuals import saved_as_bits
from fp8jax.quantize import Fp8Array, check_high_precision
from fp8jax.recipes import Recipe, resolve_recipe
from fp8jax.scaling import MlpScaleState, update_group


class MlpAmaxes(NamedTuple):
    """The forward operands' amaxes, for the state's update."""

    normed: jax.Array
    kernel_1: jax.Array
    h: jax.Array
    kernel_2: jax.Array


class MlpResiduals(NamedTuple):
    """What layernorm_mlp's forward saves for its backward."""

    norm: NormSaved
    normed: Fp8Array | None  # the norm's output, the first GEMM's lhs (_fused.saved_output)
    kernel_1: Fp8Array  # as (hidden, ffn, n): see _interleave
    bias_1: jax.Array | None
    pre: jax.Array  # the first GEMM's output, interleaved (..., ffn, n)
    h: Fp8Array  # the activation, the second GEMM's lhs
    kernel_2: Fp8Array
    bias_2: jax.Array | None
    state: MlpScaleState | None
    amaxes: MlpAmaxes


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _mlp(x, gamma, beta, k1, b1, k2, b2, state, residual, config: FusedConfig):
    return _mlp_fwd(x, gamma, beta, k1, b1, k2, b2, state, residual, config)[0]


def _mlp_fwd(x, gamma, beta, k1, b1, k2, b2, state, residual, config: FusedConfig):
    recipe, fwd = config.recipe, config.recipe.formats.forward
    fc1, fc2 = (None, None) if state is None else state
    normed, norm = _fused.normalize_and_quantize(x, gamma, beta, fc1 and fc1.x, config, residual)
    x = norm.x  # with a residual, the sum the norm read
    # kernel_1 goes in as (hidden, ffn, n), so that the GEMM writes pre interleaved.
    # Gated (n > 1), that view is a transpose, which XLA fuses into its own
    # quantize pass; the cast kernel would need it written out first.
    k1_q = quantize_operand(_interleave(k1), fwd, fc1 and fc1.kernel, recipe, rows_ndim=1,
                            transpose=k1.shape[1] == 1)  # fmt: skip
    pre = gemm.scaled_dot(normed.fp8, k1_q, dimensions.contract_last(x.ndim), config.x_dtype,
                          recipe.forward_precision)  # fmt: skip
    activation = functools.partial(_activation, activations=config.activations)
    placement = _activation_kernel(pre, config)
    if placement.kernel:
        h = _cast_activation(pre, b1, fc2 and fc2.x, config, placement.row_axes)
    elif fc2 is not None and b1 is not None:
        h = quantize_operand(Recomputed(activation, pre, (b1,), config.x_dtype), fwd, fc2.x,
                             recipe)  # fmt: skip
    else:
        h = quantize_operand(activation(pre, b1).astype(config.x_dtype), fwd, fc2 and fc2.x,
                             recipe, stored=True)  # fmt: skip
    k2_q = quantize_operand(k2, fwd, fc2 and fc2.kernel, recipe, rows_ndim=1, transpose=True)
    y = gemm.scaled_dot(h.fp8, k2_q, dimensions.contract_last(h.fp8.data.ndim), config.x_dtype,
                        recipe.forward_precision)  # fmt: skip
    y = gemm.add_bias(y, b2, 1)
    if config.return_residual:
        y = (y, x)
    amaxes = MlpAmaxes(normed.amax, k1_q.amax, h.amax, k2_q.amax)
    return y, MlpResiduals(norm, _fused.saved_output(normed, norm), k1_q.fp8, b1, pre, h.fp8,
                           k2_q.fp8, b2, state, amaxes)  # fmt: skip


def _interleave(a):
    """``(..., n, ffn)`` as ``(..., ffn, n)``, and back: the layout of the pre-activation.

    A gated activation pairs ``pre[..., 0, f]`` with ``pre[..., 1, f]``. In
    kernel_1's own layout the two are ffn elements apart, and XLA's fusion for
    the activation's gradient computes each of its output rows separately,
    reading both input rows for each: every pre-activation element comes from
    HBM twice. Interleaved, a pair sits side by side and neighbouring threads
    share one read; on the H200 the GeGLU block's gradient fusion took about
    30% less time (docs/design.md#the-interleaved-gated-pre-activation).
    kernel_1's gradient still comes out in the parameter's layout: its wgrad
    GEMM reads pre's gradient branch-major (:func:`_branch_major`), where it
    used to write (hidden, ffn, n) for XLA to transpose back in the
    parameter's dtype (f32 for f32 parameters), a pass that read and wrote
    the whole gradient. For one activation (n = 1) the two layouts are the
    same.
    """
    return jnp.swapaxes(a, -1, -2)


def _branch_major(dpre: QuantizedOperand) -> Fp8Layout:
    """Pre's FP8 gradient as kernel_1's wgrad reads it: columns (n, ffn), its branches apart.

    Where the cast kernel wrote the transposed copy, it wrote it branch-major
    (``transposed_branches``, :func:`fp8jax.kernels.cast_transpose.branch_major`);
    elsewhere the wgrad GEMM's operand is the interleaved gradient viewed as
    ``(..., n, ffn)``, which XLA transposes for the GEMM in the FP8 copy it
    makes anyway. Either way the GEMM writes ``(hidden, n, ffn)``: no f32
    transpose of the gradient after it
    (docs/design.md#the-interleaved-gated-pre-activation).
    """
    if dpre.has_transposed:
        return transposed_copy(dpre.transposed)
    fp8 = dpre.fp8
    return Fp8Layout(Fp8Array(_interleave(fp8.data), fp8.scale_inv, fp8.format))


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


def _mlp_bwd(config: FusedConfig, saved: MlpResiduals, g):
    x, b1, pre = saved.norm.x, saved.bias_1, saved.pre
    g, g_residual = g if config.return_residual else (g, None)
    recipe, bwd = config.recipe, config.recipe.formats.backward
    state = saved.state
    fc1, fc2 = (None, None) if state is None else state
    contract = dimensions.contract_last(x.ndim)
    g_q = quantize_operand(g, bwd, fc2 and fc2.grad, recipe, rows_ndim=x.ndim - 1, transpose=True,
                           rows_are_tokens=True, column_sums=saved.bias_2 is not None)  # fmt: skip
    # The backward kernel needs the gradient's scale before the gradient:
    # delayed scaling only (docs/design.md#the-activation-inside-the-cast-kernels).
    # In bytes per (token, ffn) element, gated, bf16: delayed, the kernel
    # reads dh and pre (2 + 4) and writes both FP8 layouts and h_t (4 + 1):
    # 11. Current scaling here: XLA's fusion reads dh and pre and writes the
    # bf16 gradient with its row maxima (6 + 4), the cast kernel reads it and
    # writes both layouts (4 + 4), XLA transposes the forward's FP8 h (1 + 1):
    # 20. The kernel behind an amax pass of its own, which reads dh and pre
    # again, would move 17, with its approximate math in place of XLA's.
    placement = dispatch.XLA if state is None else _activation_kernel(pre, config)
    if placement.kernel:
        dh = gemm.dgrad_dot(contract, x.ndim, saved.kernel_2, g_q.fp8, config.x_dtype, recipe,
                            like=saved.h.data)  # fmt: skip
        dpre, db1, h_t = _cast_activation_gradient(dh, pre, b1, fc1.grad.scale, fc2.x.scale,
                                                   config, placement.row_axes)  # fmt: skip
        dk2 = gemm.wgrad_over_tokens(h_t, g_q.for_wgrad(), saved.kernel_2.shape,
                                     config.kernel_dtypes[1], recipe)  # fmt: skip
        return _mlp_bwd_after_activation(config, saved, dpre, db1, dk2, g_q, g_residual)
    dh, dk2 = gemm.backward_dots(contract, x.ndim, Fp8Layout(saved.h), saved.kernel_2, g_q,
                                 config.x_dtype, config.kernel_dtypes[1], recipe)  # fmt: skip
    # Without the barrier XLA shares the activation's f32 math between the
    # forward and this recompute, and keeps it in f32 from the forward until
    # here: 4 bytes per element more held and moved than pre.
    pre = lax.optimization_barrier(pre)
    dpre = _activation_grad(dh, pre, b1, config.activations).astype(config.x_dtype)
    # Under delayed scaling too the gradient goes to HBM in bf16 and back
    # (stored), where the forward activation does not (Recomputed): bias_1's
    # gradient is a column sum, and XLA's reduction kernels run the
    # activation's gradient math slowly: one XLA kernel doing all of it took
    # several times the bf16 write and the cast together on the H200
    # (docs/design.md#tried-and-dropped). fp8jax.kernels.activation_cast does it
    # in Pallas where it runs.
    dpre = quantize_operand(dpre, bwd, fc1 and fc1.grad, recipe, rows_ndim=x.ndim - 1,
                            transpose=True, rows_are_tokens=True, column_sums=b1 is not None,
                            stored=True, transposed_branches=pre.shape[-1])  # fmt: skip
    db1 = None if b1 is None else dpre.column_sums.astype(b1.dtype)
    return _mlp_bwd_after_activation(config, saved, dpre, db1, dk2, g_q, g_residual)


def _mlp_bwd_after_activation(config: FusedConfig, saved: MlpResiduals, dpre: QuantizedOperand,
                              db1, dk2, g_q: QuantizedOperand, g_residual):  # fmt: skip
    """The MLP's backward from its activation's FP8 gradient on: kernel_1's GEMMs, the norm.

    ``db1``: bias_1's gradient as (ffn, n), in its dtype, or None without bias_1.
    """
    x, gamma, beta, mean, rstd, _ = saved.norm
    recipe, state, amaxes = config.recipe, saved.state, saved.amaxes
    normed = _fused.fp8_output(saved.normed, saved.norm, config, dpre.fp8.data)
    contract = dimensions.contract_last(x.ndim)
    dnormed = gemm.dgrad_dot(contract, x.ndim, saved.kernel_1, dpre.fp8, x.dtype, recipe,
                             like=normed.data)  # fmt: skip
    # kernel_1's gradient straight in the parameter's layout (hidden, n, ffn):
    # the wgrad reads pre's gradient with its branches apart.
    k1_like = _interleave(saved.kernel_1.data)
    dk1 = gemm.wgrad_dot(contract, x.ndim, Fp8Layout(normed), _branch_major(dpre), k1_like,
                         config.kernel_dtypes[0], recipe)  # fmt: skip
    db1 = None if db1 is None else _interleave(db1)
    dx, dgamma, dbeta = norm.fused_normalize_backward(dnormed, x, mean, rstd, gamma, beta,
                                                        config.norm, g_residual)  # fmt: skip
    db2 = None if saved.bias_2 is None else g_q.column_sums.astype(saved.bias_2.dtype)
    new_state = None
    if state is not None:
        new_state = update_group(
            state, ((amaxes.normed, amaxes.kernel_1, dpre.amax),
                    (amaxes.h, amaxes.kernel_2, g_q.amax)), recipe,
        )  # fmt: skip
    cotangents = (dx, dgamma, dbeta, dk1, db1, dk2, db2)
    matched = _partitioning.match_cotangents(cotangents, new_state, config.inputs[:-1])
    return _fused.with_residual_cotangent(matched, dx, config)


_mlp.defvjp(*saved_as_bits(_mlp_fwd, _mlp_bwd))


def _activation_kernel(pre, config: FusedConfig) -> dispatch.Placement:
    """Where the activation kernels run on ``pre``'s rows: the dispatcher's decision.

    The kernels (:mod:`fp8jax.kernels.activation_cast`) compute one activation
    or a gated pair and need their scales before their values. The forward
    kernel runs under both recipes, current scaling taking its scale from
    :func:`_activation_amax_and_scale`; the backward one under delayed scaling only.
    They run where :func:`fp8jax.kernels.dispatch.decide` puts them on token
    rows, for the activations the registry's kernel serves
    (:attr:`fp8jax.activations.Activation.kernel`).
    """
    activations = config.activations
    if len(activations) > 2:
        return dispatch.XLA
    if not activations_.kernel_serves(activations):
        return dispatch.XLA
    if pre.size == 0:  # an empty pre-activation fills no tile
        return dispatch.XLA
    rows_by_width = (pre.size // (pre.shape[-2] * pre.shape[-1]), pre.shape[-2] * pre.shape[-1])
    return dispatch.decide(
        lambda shards: activation_cast.fits(rows_by_width, len(activations), shards)
    )


def _activation_amax_and_scale(pre, b1, config: FusedConfig):
    """Current scaling's amax and scale for the forward activation kernel, from a pass of its own.

    The pass reads ``pre`` and writes only row maxima; the kernel computes the
    activation again, so no bf16 copy of it reaches HBM
    (docs/design.md#the-activation-inside-the-cast-kernels).
    """
    h = _activation(pre, b1, config.activations).astype(config.x_dtype)
    return current_amax_and_scale(jnp.abs(h), config.recipe.formats.forward, config.recipe)


def _rows(pre, b1):
    """``pre`` (..., ffn, n) as the kernels' (rows, ffn * n) matrix, and b1 (n, ffn) to match."""
    width = pre.shape[-2] * pre.shape[-1]
    return pre.reshape(-1, width), None if b1 is None else _interleave(b1).reshape(width)


def _cast_activation(pre, b1, state, config: FusedConfig, row_axes) -> QuantizedOperand:
    """``h`` in FP8 from the forward activation kernel, with its amax.

    ``state``: h's ScaleState under delayed scaling, whose amax the kernel
    takes as tile maxima; None under current scaling, whose amax comes from
    :func:`_activation_amax_and_scale` and which the kernel then skips.
    """
    fmt = config.recipe.formats.forward
    if state is None:
        h_amax, scale = _activation_amax_and_scale(pre, b1, config)
    else:
        scale = state.scale
    delayed = state is not None
    data, h_maxima = activation_cast.cast_activation(*_rows(pre, b1), config.activations, scale,
                                                     fmt, row_axes, maxima=delayed)  # fmt: skip
    if delayed:
        h_amax = amax_for_update(h_maxima, config.recipe)
    return from_kernel(data.reshape(pre.shape[:-1]), inverse(scale), fmt, h_amax)


def _cast_activation_gradient(dh, pre, b1, scale, h_scale, config: FusedConfig, row_axes):
    """The backward activation kernel: pre's gradient as the cast kernel gives it, and h_t.

    Returns ``(dpre, db1, h_t)``: ``dpre`` with its transposed copy and, with
    a bias, its column sums (f32, (ffn, n)); ``db1`` those sums in bias_1's
    dtype, or None; ``h_t`` the activation's FP8 copy transposed, for
    kernel_2's wgrad GEMM.
    """
    recipe = config.recipe
    fmt, h_fmt = recipe.formats.backward, recipe.formats.forward
    rows, bias = _rows(pre, b1)
    out, h_t = activation_cast.cast_activation_gradient(
        dh.reshape(rows.shape[0], -1), rows, bias, config.activations, scale, fmt, h_scale,
        h_fmt, row_axes,
    )  # fmt: skip
    scale_inv = inverse(scale)
    q = out.q.reshape(pre.shape)
    sums = None if b1 is None else out.column_sums.reshape(pre.shape[-2:])
    db1 = None if b1 is None else sums.astype(b1.dtype)
    h_t = Fp8Array(h_t, inverse(h_scale), h_fmt)
    dpre = from_kernel(q, scale_inv, fmt, amax_for_update(out.maxima, recipe), transposed=out.q_t,
                       column_sums=sums)  # fmt: skip
    return dpre, db1, transposed_copy(h_t)


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
    residual: jax.Array | None = None,
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
      residual: None, or a branch output shaped like ``x``: the block is
        applied to ``x + residual``, added in the norm's pass over ``x``
        (see :func:`layernorm_dense`); ``return_residual`` returns the sum.

    Returns:
      ``(..., hidden_out)`` in ``x.dtype``, or ``(y, x)`` with ``return_residual``
      (``x + residual`` with ``residual``).

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
    _fused.check_residual(x, residual)
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
    gemm.check_bias(bias_1, (len(activations), ffn), "bias_1")
    gemm.check_bias(bias_2, (kernel_2.shape[1],), "bias_2")
    recipe = resolve_recipe(recipe)
    check_state(state, recipe, MlpScaleState)
    if fine_grained.is_fine(recipe):  # composed, not fused (fp8jax.ops.fine_grained)
        x = x if residual is None else x + residual
        return fine_grained.layernorm_mlp(x, gamma, beta, kernel_1, kernel_2, bias_1, bias_2,
                                          norm, recipe, activations,
                                          return_residual=return_residual)  # fmt: skip
    config = FusedConfig(
        norm, recipe, jnp.dtype(x.dtype), (jnp.dtype(kernel_1.dtype), jnp.dtype(kernel_2.dtype)),
        activations=activations, return_residual=return_residual, has_residual=residual is not None,
        inputs=_partitioning.input_types(x, gamma, beta, kernel_1, bias_1, kernel_2, bias_2, state,
                                         residual),
    )  # fmt: skip
    return _mlp(x, gamma, beta, kernel_1, bias_1, kernel_2, bias_2, state, residual, config)

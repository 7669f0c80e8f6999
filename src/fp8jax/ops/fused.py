"""LayerNorm + FP8 dense in one custom_vjp, and the FP8 MLP block built on it.

``layernorm_dense`` normalizes in f32 and quantizes straight to E4M3 in the
same XLA fusion, so no BF16 copy of the normalized activations reaches HBM.
It saves only the FP8 normalized activations, the FP8 kernel, the input and
the per-row statistics; the norm's backward is computed from those.

``layernorm_mlp`` is ``layernorm_dense`` -> activation -> FP8 ``dense``. The
activation sits in a ``jax.checkpoint`` so that its only residual is the
first GEMM's output; its result is quantized for the second GEMM in the
fusion that computes it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from fp8jax.ops import dimensions
from fp8jax.ops.dense import DotConfig, check_state, dense, quantize_operand, scaled_dot
from fp8jax.ops.norm import NormConfig, check_norm_args, normalize, normalize_backward
from fp8jax.quantize import check_high_precision
from fp8jax.recipes import resolve_recipe
from fp8jax.scaling import DotScaleState, MlpScaleState, update_scale_state

ACTIVATIONS = {
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "linear": lambda x: x,
}


@dataclasses.dataclass(frozen=True)
class LayerNormDenseConfig:
    """Static settings of one layernorm_dense; the custom_vjp's only static argument."""

    norm: NormConfig
    dot: DotConfig
    return_normalized: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ln_dense(x, gamma, beta, kernel, state, config: LayerNormDenseConfig):
    return _ln_dense_fwd(x, gamma, beta, kernel, state, config)[0]


def _ln_dense_fwd(x, gamma, beta, kernel, state, config: LayerNormDenseConfig):
    recipe, dot = config.dot.recipe, config.dot
    normed, mean, rstd = normalize(x, gamma, beta, config.norm)
    # Quantized from the f32 normalization in the same fusion: no BF16 copy.
    normed_q, normed_amax = quantize_operand(
        normed, recipe.formats.forward, state and state.x, recipe
    )
    kernel_q, kernel_amax = quantize_operand(
        kernel, recipe.formats.forward, state and state.kernel, recipe
    )
    y = scaled_dot(
        normed_q, kernel_q, dot.dimension_numbers, dot.out_dtype, recipe.forward_precision
    )
    out = (y, normed.astype(x.dtype)) if config.return_normalized else y
    amaxes = (normed_amax, kernel_amax) if state is not None else None
    return out, (x, gamma, beta, mean, rstd, normed_q, kernel_q, state, amaxes)


def _ln_dense_bwd(config: LayerNormDenseConfig, residuals, cotangent):
    x, gamma, beta, mean, rstd, normed_q, kernel_q, state, amaxes = residuals
    dot, recipe = config.dot, config.dot.recipe
    g, g_normed = cotangent if config.return_normalized else (cotangent, None)
    g_q, g_amax = quantize_operand(g, recipe.formats.backward, state and state.grad, recipe)
    dg = dimensions.dgrad(dot.dimension_numbers, x.ndim, kernel_q.data.ndim)
    wg = dimensions.wgrad(dot.dimension_numbers, x.ndim, kernel_q.data.ndim)
    d_normed = scaled_dot(
        g_q, kernel_q, dg.dimension_numbers, dot.lhs_dtype, recipe.dgrad_precision, dg.permutation
    )
    d_kernel = scaled_dot(
        normed_q, g_q, wg.dimension_numbers, dot.rhs_dtype, recipe.wgrad_precision, wg.permutation
    )
    if g_normed is not None:
        d_normed = d_normed.astype(jnp.float32) + g_normed.astype(jnp.float32)
    dx, dgamma, dbeta = normalize_backward(d_normed, x, mean, rstd, gamma, beta, config.norm)
    if state is None:
        return dx, dgamma, dbeta, d_kernel, None
    fwd_max, bwd_max = recipe.formats.forward.max, recipe.formats.backward.max
    new_state = DotScaleState(
        x=update_scale_state(state.x, amaxes[0], fwd_max, recipe),
        kernel=update_scale_state(state.kernel, amaxes[1], fwd_max, recipe),
        grad=update_scale_state(state.grad, g_amax, bwd_max, recipe),
    )
    return dx, dgamma, dbeta, d_kernel, new_state


_ln_dense.defvjp(_ln_dense_fwd, _ln_dense_bwd)


def _add_bias(y, bias, n_out_axes: int):
    if bias is None:
        return y
    check_high_precision("bias", bias)
    expected = tuple(y.shape[y.ndim - n_out_axes :])
    if tuple(bias.shape) != expected:
        raise ValueError(
            f"bias must have the kernel's output shape {expected}, got {tuple(bias.shape)}."
        )
    return y + jnp.broadcast_to(bias.astype(y.dtype), y.shape)


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
    recipe=None,
    state: DotScaleState | None = None,
    return_normalized: bool = False,
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

    Returns:
      ``y`` of shape ``(..., *features)`` in ``x.dtype``, or ``(y, normalized)``.

    Example:
      >>> import jax, jax.numpy as jnp, fp8jax
      >>> x = jax.random.normal(jax.random.key(0), (4, 16, 64), jnp.bfloat16)
      >>> w = jax.random.normal(jax.random.key(1), (64, 3, 8)) * 0.1
      >>> fp8jax.layernorm_dense(x, jnp.ones(64), jnp.zeros(64), w).shape
      (4, 16, 3, 8)
    """
    norm = NormConfig(norm_type, zero_centered_gamma, epsilon)
    check_norm_args(x, gamma, beta, norm)
    check_high_precision("kernel", kernel)
    if kernel.ndim < 2 or kernel.shape[0] != x.shape[-1]:
        raise ValueError(
            f"kernel must have shape (hidden={x.shape[-1]}, *features), got {tuple(kernel.shape)}."
        )
    recipe = resolve_recipe(recipe)
    check_state(state, recipe)
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    dot = DotConfig(dims, recipe, jnp.dtype(x.dtype), jnp.dtype(x.dtype), jnp.dtype(kernel.dtype))
    out = _ln_dense(
        x, gamma, beta, kernel, state, LayerNormDenseConfig(norm, dot, return_normalized)
    )
    if return_normalized:
        y, normalized = out
        return _add_bias(y, bias, kernel.ndim - 1), normalized
    return _add_bias(out, bias, kernel.ndim - 1)


def _check_activations(activations) -> tuple[str, ...]:
    if isinstance(activations, str):
        activations = (activations,)
    activations = tuple(activations)
    if not 1 <= len(activations) <= 2 or any(a not in ACTIVATIONS for a in activations):
        raise ValueError(
            f"activations must be one or two names from {sorted(ACTIVATIONS)}, e.g. "
            f"('gelu', 'linear') for GeGLU or ('silu', 'linear') for SwiGLU; got {activations!r}."
        )
    return activations


@functools.partial(jax.checkpoint, static_argnums=(1,))
def _gated_activation(pre: jax.Array, activations: tuple[str, ...]) -> jax.Array:
    # Under checkpoint the backward recomputes the activation from `pre`, the
    # GEMM output already in HBM, instead of saving erf/sigmoid intermediates.
    pre32 = pre.astype(jnp.float32)
    h = ACTIVATIONS[activations[0]](pre32[..., 0, :])
    for i, name in enumerate(activations[1:], start=1):
        h = h * ACTIVATIONS[name](pre32[..., i, :])
    return h.astype(pre.dtype)


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
    recipe=None,
    state: MlpScaleState | None = None,
) -> jax.Array:
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

    Returns:
      ``(..., hidden_out)`` in ``x.dtype``.

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
    activations = _check_activations(activations)
    check_high_precision("kernel_1", kernel_1)
    check_high_precision("kernel_2", kernel_2)
    hidden = x.shape[-1] if getattr(x, "ndim", 0) else None
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
    recipe = resolve_recipe(recipe)
    check_state(state, recipe, MlpScaleState)
    pre = layernorm_dense(
        x, gamma, beta, kernel_1, bias_1,
        norm_type=norm_type, zero_centered_gamma=zero_centered_gamma, epsilon=epsilon,
        recipe=recipe, state=None if state is None else state.fc1,
    )  # fmt: skip
    h = _gated_activation(pre, activations)
    return dense(h, kernel_2, bias_2, recipe=recipe, state=None if state is None else state.fc2)

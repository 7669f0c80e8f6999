"""NNX DenseGeneral and LayerNormDenseGeneral over ``fp8jax.dense`` / ``layernorm_dense``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

import fp8jax
from fp8jax.flax import _common
from fp8jax.flax._common import EMBED
from fp8jax.flax.nnx._base import param, scale_state, state_value, value_of
from fp8jax.ops.split import split_output
from fp8jax.recipes import Recipe

default_kernel_init = nnx.initializers.lecun_normal()


class DenseGeneral(nnx.Module):
    """FP8 dense over any input axes; the NNX twin of the Linen module.

    Args:
      in_features: size (or sizes) of the contracted input axes.
      out_features: output size, or a tuple of output sizes.
      axis: the input axes contracted, one per in_features entry.
      use_bias: add a bias of shape ``out_features``.
      dtype: compute and output dtype; None keeps the input's.
      param_dtype: dtype of the parameters (the kernel is quantized from it).
      kernel_init: applied as to the kernel flattened to 2-D.
      bias_init: bias initializer.
      kernel_axes: logical axis names of the kernel (default all None).
      bias_axes: logical axis names of the bias (default all None).
      recipe: CurrentScaling (None) or DelayedScaling (state in an Fp8State).
      dot_general: a ``lax.dot_general``-like callable instead of FP8;
        CurrentScaling only.
      split, split_axis: return the output as pieces of these sizes along
        that feature axis, as ``fp8jax.dense`` does (a fused QKV).
      rngs: ``nnx.Rngs`` for the initializers.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from fp8jax.flax import nnx as fnnx
      >>> layer = fnnx.DenseGeneral(32, (4, 8), rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((2, 16, 32))).shape
      (2, 16, 4, 8)
    """

    def __init__(
        self,
        in_features: int | Sequence[int],
        out_features: int | Sequence[int],
        *,
        axis: int | Sequence[int] = -1,
        use_bias: bool = True,
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init=default_kernel_init,
        bias_init=jax.nn.initializers.zeros,
        kernel_axes: Sequence[str | None] | None = None,
        bias_axes: Sequence[str | None] | None = None,
        recipe: Recipe | None = None,
        dot_general: Callable | None = None,
        split: Sequence[int] | None = None,
        split_axis: int = -2,
        rngs: nnx.Rngs,
    ):
        owner = type(self).__name__
        self.in_features = _common.features(owner, in_features, "in_features")
        features = _common.features(owner, out_features, "out_features")
        self.axis = _common.as_tuple(owner, "axis", axis)
        if len(self.axis) != len(self.in_features):
            raise ValueError(
                f"{owner}: axis={axis!r} names {len(self.axis)} axes, but in_features="
                f"{in_features!r} gives {len(self.in_features)} sizes; give one size per axis."
            )
        _common.flags(owner, use_bias=use_bias)
        _common.no_custom_dot_with_state(owner, dot_general, recipe)
        shape = self.in_features + features
        names = _common.axis_names(
            owner, "kernel_axes", kernel_axes, len(shape), (None,) * len(shape)
        )
        init = _common.fan_in_init(kernel_init, len(self.axis))
        self.kernel = param(init, rngs, shape, param_dtype, names)
        names = _common.axis_names(
            owner, "bias_axes", bias_axes, len(features), (None,) * len(features)
        )
        self.bias = param(bias_init, rngs, features, param_dtype, names, enabled=use_bias)
        self.dtype, self.recipe, self.dot_general = dtype, recipe, dot_general
        self.scales = scale_state(recipe)
        self.split = None if split is None else tuple(split)
        self.split_axis = split_axis

    def __call__(self, x: jax.Array) -> jax.Array:
        owner = type(self).__name__
        _common.in_features(owner, x, self.axis, self.in_features)
        axes = _common.contracted_axes(owner, self.axis, x.ndim)
        x = x.astype(self.dtype or x.dtype)
        kernel, bias = self.kernel[...], value_of(self.bias)
        dims = (axes, tuple(range(len(axes))))
        if self.dot_general is not None:
            y = self.dot_general(x, kernel.astype(x.dtype), (dims, ((), ())))
            y = y if bias is None else y + jnp.broadcast_to(bias.astype(y.dtype), y.shape)
            return split_output(y, self.split, self.split_axis, kernel.ndim - len(axes))
        state = state_value(self.scales, kernel, owner)
        return fp8jax.dense(x, kernel, bias, dims, recipe=self.recipe, state=state,
                            split=self.split, split_axis=self.split_axis,
                            preferred_element_type=x.dtype)  # fmt: skip


class LayerNormDenseGeneral(nnx.Module):
    """LayerNorm/RMSNorm fused with an FP8 dense; the NNX twin of the Linen module.

    Args:
      in_features: the hidden size (the last input axis).
      out_features: output size, or a tuple of output sizes.
      norm_type: ``"layernorm"`` or ``"rmsnorm"``.
      epsilon: added to the variance.
      zero_centered_gamma: store ``gamma - 1``.
      use_bias: add a bias of shape ``out_features``.
      return_layernorm_output: also return the normalized input.
      return_residual: also return the input itself, for a residual taken
        before the norm: its gradient then joins the norm's backward in one
        pass (see the Linen module).
      dtype, param_dtype, kernel_init, bias_init, recipe, rngs: as in DenseGeneral.
      scale_init: None gives ones (zeros if zero-centred).
      ln_bias_init: norm shift initializer.
      kernel_axes: logical names of the kernel (default ``("embed", None, ...)``).
      bias_axes: logical names of the bias (default all None).
      split, split_axis: return the output as pieces of these sizes along
        that feature axis, as ``fp8jax.layernorm_dense`` does (a fused QKV).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from fp8jax.flax import nnx as fnnx
      >>> layer = fnnx.LayerNormDenseGeneral(32, 64, norm_type="rmsnorm", rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((2, 16, 32))).shape
      (2, 16, 64)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int | Sequence[int],
        *,
        norm_type: str = "layernorm",
        epsilon: float = 1e-6,
        zero_centered_gamma: bool = False,
        use_bias: bool = True,
        return_layernorm_output: bool = False,
        return_residual: bool = False,
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init=default_kernel_init,
        bias_init=jax.nn.initializers.zeros,
        scale_init=None,
        ln_bias_init=jax.nn.initializers.zeros,
        kernel_axes: Sequence[str | None] | None = None,
        bias_axes: Sequence[str | None] | None = None,
        recipe: Recipe | None = None,
        split: Sequence[int] | None = None,
        split_axis: int = -2,
        rngs: nnx.Rngs,
    ):
        owner = type(self).__name__
        hidden = _common.positive_int(owner, "in_features", in_features)
        features = _common.features(owner, out_features, "out_features")
        self.norm_type = _common.norm_type(owner, norm_type)
        _common.flags(owner, zero_centered_gamma=zero_centered_gamma, use_bias=use_bias,
                      return_layernorm_output=return_layernorm_output,
                      return_residual=return_residual)  # fmt: skip
        _common.residual_output(owner, return_residual, return_layernorm_output)
        gamma_init = _common.gamma_init(zero_centered_gamma, scale_init)
        self.scale = param(gamma_init, rngs, (hidden,), param_dtype, (EMBED,))
        has_beta = _common.norm_beta(norm_type)
        self.ln_bias = param(ln_bias_init, rngs, (hidden,), param_dtype, (EMBED,), enabled=has_beta)
        shape = (hidden, *features)
        default = (EMBED,) + (None,) * len(features)
        names = _common.axis_names(owner, "kernel_axes", kernel_axes, len(shape), default)
        init = _common.fan_in_init(kernel_init, 1)
        self.kernel = param(init, rngs, shape, param_dtype, names)
        default = (None,) * len(features)
        names = _common.axis_names(owner, "bias_axes", bias_axes, len(features), default)
        self.bias = param(bias_init, rngs, features, param_dtype, names, enabled=use_bias)
        self.in_features, self.epsilon, self.zero_centered_gamma = (
            hidden,
            epsilon,
            zero_centered_gamma,
        )
        self.return_residual = return_residual
        self.return_layernorm_output, self.dtype, self.recipe = (
            return_layernorm_output,
            dtype,
            recipe,
        )
        self.scales = scale_state(recipe)
        self.split = None if split is None else tuple(split)
        self.split_axis = split_axis

    def __call__(self, x: jax.Array):
        _common.in_features(type(self).__name__, x, (-1,), (self.in_features,))
        return fp8jax.layernorm_dense(
            x.astype(self.dtype or x.dtype),
            self.scale[...],
            value_of(self.ln_bias),
            self.kernel[...],
            value_of(self.bias),
            norm_type=self.norm_type,
            zero_centered_gamma=self.zero_centered_gamma,
            epsilon=self.epsilon,
            recipe=self.recipe,
            state=state_value(self.scales, self.kernel[...], type(self).__name__),
            return_normalized=self.return_layernorm_output,
            return_residual=self.return_residual,
            split=self.split,
            split_axis=self.split_axis,
        )

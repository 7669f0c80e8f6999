"""Linen DenseGeneral and LayerNormDenseGeneral over ``fp8jax.dense`` / ``layernorm_dense``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import fp8jax
from fp8jax.flax import _common
from fp8jax.flax._common import EMBED
from fp8jax.flax.linen._base import param, scale_state
from fp8jax.ops.split import split_output
from fp8jax.recipes import Recipe

default_kernel_init = nn.initializers.lecun_normal()


class DenseGeneral(nn.Module):
    """FP8 dense over any input axes: ``fp8jax.dense`` with a ``(*in, *features)`` kernel.

    Attributes:
      features: output size, or a tuple of output sizes.
      axis: input axis (or axes) contracted with the kernel's leading axes.
      use_bias: add a bias of shape ``features``.
      dtype: compute and output dtype; None keeps the input's. The kernel is
        quantized straight from ``param_dtype``.
      param_dtype: dtype of the parameters.
      kernel_init: initializer, applied as to the kernel flattened to 2-D.
      bias_init: bias initializer.
      kernel_axes: logical axis names of the kernel (default: all None).
      bias_axes: logical axis names of the bias (default: all None).
      recipe: CurrentScaling (None) or DelayedScaling, whose state goes in
        the ``"fp8_state"`` collection.
      dot_general: a ``lax.dot_general``-like callable to use instead of FP8
        (a BF16 baseline, say); CurrentScaling only.
      split, split_axis: return the output as pieces of these sizes along
        that feature axis, as ``fp8jax.dense`` does (a fused QKV).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from fp8jax.flax import linen as fnn
      >>> layer = fnn.DenseGeneral(features=(4, 8), kernel_axes=("embed", "heads", "kv"))
      >>> x = jnp.ones((2, 16, 32))
      >>> variables = jax.jit(layer.init)(jax.random.key(0), x)
      >>> layer.apply(variables, x).shape
      (2, 16, 4, 8)
    """

    features: int | Sequence[int]
    _: dataclasses.KW_ONLY
    axis: int | Sequence[int] = -1
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = default_kernel_init
    bias_init: Any = jax.nn.initializers.zeros
    kernel_axes: Sequence[str | None] | None = None
    bias_axes: Sequence[str | None] | None = None
    recipe: Recipe | None = None
    dot_general: Callable | None = None
    split: Sequence[int] | None = None
    split_axis: int = -2

    def __post_init__(self):
        _common.features(type(self).__name__, self.features)
        _common.flags(type(self).__name__, use_bias=self.use_bias)
        _common.no_custom_dot_with_state(type(self).__name__, self.dot_general, self.recipe)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        owner = type(self).__name__
        features = _common.features(owner, self.features)
        axes = _common.contracted_axes(owner, self.axis, jnp.ndim(x))
        x = x.astype(self.dtype or x.dtype)
        shape = tuple(x.shape[a] for a in axes) + features
        names = _common.axis_names(
            owner, "kernel_axes", self.kernel_axes, len(shape), (None,) * len(shape)
        )
        init = _common.fan_in_init(self.kernel_init, len(axes))
        kernel = param(self, "kernel", init, shape, self.param_dtype, names)
        bias = None
        if self.use_bias:
            names = _common.axis_names(
                owner, "bias_axes", self.bias_axes, len(features), (None,) * len(features)
            )
            bias = param(self, "bias", self.bias_init, features, self.param_dtype, names)
        dims = (axes, tuple(range(len(axes))))
        if self.dot_general is not None:
            y = self.dot_general(x, kernel.astype(x.dtype), (dims, ((), ())))
            y = y if bias is None else y + jnp.broadcast_to(bias.astype(y.dtype), y.shape)
            return split_output(y, self.split, self.split_axis, len(features))
        state = scale_state(self, self.recipe, kernel)
        return fp8jax.dense(x, kernel, bias, dims, recipe=self.recipe, state=state,
                            split=self.split, split_axis=self.split_axis,
                            preferred_element_type=x.dtype)  # fmt: skip


class LayerNormDenseGeneral(nn.Module):
    """LayerNorm/RMSNorm fused with an FP8 dense: ``fp8jax.layernorm_dense``.

    The norm's parameters are ``scale`` and ``ln_bias``; the dense's are
    ``kernel`` ``(hidden, *features)`` and ``bias``.

    Attributes:
      features: output size, or a tuple of output sizes.
      norm_type: ``"layernorm"`` or ``"rmsnorm"``.
      epsilon: added to the variance.
      zero_centered_gamma: store ``gamma - 1``.
      use_bias: add a bias of shape ``features`` after the GEMM.
      return_layernorm_output: also return the normalized input (for a
        residual taken after the norm).
      return_residual: also return the input itself, for a residual taken
        before the norm: its gradient then joins the norm's backward in one
        pass (``fp8jax.layernorm_dense``'s ``return_residual``).
      dtype, param_dtype, kernel_init, bias_init, recipe: as in DenseGeneral.
      scale_init: norm scale initializer; None gives ones (zeros if zero-centred).
      ln_bias_init: norm shift initializer.
      kernel_axes: logical names of the kernel (default ``("embed", None, ...)``).
      bias_axes: logical names of the bias (default all None).
      split, split_axis: return the output as pieces of these sizes along
        that feature axis, as ``fp8jax.layernorm_dense`` does (a fused QKV).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from fp8jax.flax import linen as fnn
      >>> layer = fnn.LayerNormDenseGeneral(features=64, norm_type="rmsnorm")
      >>> x = jnp.ones((2, 16, 32))
      >>> variables = jax.jit(layer.init)(jax.random.key(0), x)
      >>> layer.apply(variables, x).shape
      (2, 16, 64)
    """

    features: int | Sequence[int]
    _: dataclasses.KW_ONLY
    norm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    use_bias: bool = True
    return_layernorm_output: bool = False
    return_residual: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = default_kernel_init
    bias_init: Any = jax.nn.initializers.zeros
    scale_init: Any = None
    ln_bias_init: Any = jax.nn.initializers.zeros
    kernel_axes: Sequence[str | None] | None = None
    bias_axes: Sequence[str | None] | None = None
    recipe: Recipe | None = None
    split: Sequence[int] | None = None
    split_axis: int = -2

    def __post_init__(self):
        owner = type(self).__name__
        _common.features(owner, self.features)
        _common.norm_type(owner, self.norm_type)
        _common.flags(owner, zero_centered_gamma=self.zero_centered_gamma, use_bias=self.use_bias,
                      return_layernorm_output=self.return_layernorm_output,
                      return_residual=self.return_residual)  # fmt: skip
        _common.residual_output(owner, self.return_residual, self.return_layernorm_output)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array):
        owner = type(self).__name__
        _common.rank(owner, x, at_least=1)
        features = _common.features(owner, self.features)
        x = x.astype(self.dtype or x.dtype)
        hidden, pd = x.shape[-1], self.param_dtype
        gamma_init = _common.gamma_init(self.zero_centered_gamma, self.scale_init)
        gamma = param(self, "scale", gamma_init, (hidden,), pd, (EMBED,))
        beta = None
        if _common.norm_beta(self.norm_type):
            beta = param(self, "ln_bias", self.ln_bias_init, (hidden,), pd, (EMBED,))
        shape = (hidden, *features)
        names = _common.axis_names(
            owner, "kernel_axes", self.kernel_axes, len(shape), (EMBED,) + (None,) * len(features)
        )
        kernel = param(self, "kernel", _common.fan_in_init(self.kernel_init, 1), shape, pd, names)
        bias = None
        if self.use_bias:
            names = _common.axis_names(
                owner, "bias_axes", self.bias_axes, len(features), (None,) * len(features)
            )
            bias = param(self, "bias", self.bias_init, features, pd, names)
        return fp8jax.layernorm_dense(
            x,
            gamma,
            beta,
            kernel,
            bias,
            norm_type=self.norm_type,
            zero_centered_gamma=self.zero_centered_gamma,
            epsilon=self.epsilon,
            recipe=self.recipe,
            state=scale_state(self, self.recipe, kernel),
            return_normalized=self.return_layernorm_output,
            return_residual=self.return_residual,
            split=self.split,
            split_axis=self.split_axis,
        )

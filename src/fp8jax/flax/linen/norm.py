"""Linen LayerNorm / RMSNorm over ``fp8jax.layernorm``."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import fp8jax
from fp8jax.flax import _common
from fp8jax.flax._common import EMBED
from fp8jax.flax.linen._base import param


class LayerNorm(nn.Module):
    """LayerNorm or RMSNorm over the last axis, statistics in f32.

    Attributes:
      norm_type: ``"layernorm"`` or ``"rmsnorm"`` (no bias).
      epsilon: added to the variance.
      zero_centered_gamma: store ``gamma - 1``; the scale initializes to 0.
      dtype: compute and output dtype; None keeps the input's.
      param_dtype: dtype of ``scale`` and ``bias``.
      scale_init: initializer of ``scale``; None gives ones (zeros if zero-centred).
      bias_init: initializer of ``bias``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from fp8jax.flax import linen as fnn
      >>> norm = fnn.LayerNorm(norm_type="rmsnorm")
      >>> x = jnp.ones((2, 8, 32))
      >>> variables = jax.jit(norm.init)(jax.random.key(0), x)
      >>> norm.apply(variables, x).shape
      (2, 8, 32)
    """

    _: dataclasses.KW_ONLY
    norm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    scale_init: Any = None
    bias_init: Any = jax.nn.initializers.zeros

    def __post_init__(self):
        _common.norm_type(type(self).__name__, self.norm_type)
        _common.flags(type(self).__name__, zero_centered_gamma=self.zero_centered_gamma)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        _common.rank(type(self).__name__, x, at_least=1)
        x = x.astype(self.dtype or x.dtype)
        shape, init = (x.shape[-1],), _common.gamma_init(self.zero_centered_gamma, self.scale_init)
        gamma = param(self, "scale", init, shape, self.param_dtype, (EMBED,))
        beta = None
        if _common.norm_beta(self.norm_type):
            beta = param(self, "bias", self.bias_init, shape, self.param_dtype, (EMBED,))
        return fp8jax.layernorm(
            x,
            gamma,
            beta,
            norm_type=self.norm_type,
            zero_centered_gamma=self.zero_centered_gamma,
            epsilon=self.epsilon,
        )

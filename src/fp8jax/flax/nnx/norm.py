"""NNX LayerNorm / RMSNorm over ``fp8jax.layernorm``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import fp8jax
from fp8jax.flax import _common
from fp8jax.flax._common import EMBED
from fp8jax.flax.nnx._base import param


class LayerNorm(nnx.Module):
    """LayerNorm or RMSNorm over the last axis; the NNX twin of the Linen module.

    Args:
      num_features: the hidden size.
      norm_type: ``"layernorm"`` or ``"rmsnorm"`` (no bias).
      epsilon: added to the variance.
      zero_centered_gamma: store ``gamma - 1``; the scale initializes to 0.
      dtype: compute and output dtype; None keeps the input's.
      param_dtype: dtype of ``scale`` and ``bias``.
      scale_init: None gives ones (zeros if zero-centred).
      bias_init: initializer of ``bias``.
      rngs: ``nnx.Rngs`` for the initializers.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from fp8jax.flax import nnx as fnnx
      >>> norm = fnnx.LayerNorm(32, norm_type="rmsnorm", rngs=nnx.Rngs(0))
      >>> norm(jnp.ones((2, 8, 32))).shape
      (2, 8, 32)
    """

    def __init__(
        self,
        num_features: int,
        *,
        norm_type: str = "layernorm",
        epsilon: float = 1e-6,
        zero_centered_gamma: bool = False,
        dtype=None,
        param_dtype=jnp.float32,
        scale_init=None,
        bias_init=jax.nn.initializers.zeros,
        rngs: nnx.Rngs,
    ):
        owner = type(self).__name__
        self.num_features = _common.positive_int(owner, "num_features", num_features)
        self.norm_type = _common.norm_type(owner, norm_type)
        _common.flags(owner, zero_centered_gamma=zero_centered_gamma)
        self.epsilon, self.zero_centered_gamma, self.dtype = epsilon, zero_centered_gamma, dtype
        shape, init = (num_features,), _common.gamma_init(zero_centered_gamma, scale_init)
        self.scale = param(init, rngs, shape, param_dtype, (EMBED,))
        has_beta = _common.norm_beta(norm_type)
        self.bias = param(bias_init, rngs, shape, param_dtype, (EMBED,), enabled=has_beta)

    def __call__(self, x: jax.Array) -> jax.Array:
        _common.in_features(type(self).__name__, x, (-1,), (self.num_features,))
        return fp8jax.layernorm(
            x.astype(self.dtype or x.dtype),
            self.scale[...],
            None if self.bias is None else self.bias[...],
            norm_type=self.norm_type,
            zero_centered_gamma=self.zero_centered_gamma,
            epsilon=self.epsilon,
        )

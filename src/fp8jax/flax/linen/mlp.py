"""Linen LayerNormMLP over ``fp8jax.layernorm_mlp``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import fp8jax
from fp8jax.flax import _common
from fp8jax.flax._common import ACT, EMBED, MLP
from fp8jax.flax.linen._base import param, scale_state
from fp8jax.flax.linen.dense import default_kernel_init
from fp8jax.recipes import Recipe
from fp8jax.scaling import MlpScaleState


class LayerNormMLP(nn.Module):
    """Norm -> FP8 GEMM -> (gated) activation -> FP8 GEMM, as one fused op.

    Parameters: ``scale`` and ``ln_bias`` (norm), ``kernel_1`` ``(hidden,
    len(activations), intermediate_dim)``, ``bias_1``, ``kernel_2``
    ``(intermediate_dim, hidden)``, ``bias_2``.

    Attributes:
      intermediate_dim: the MLP's inner width.
      activations: ``("gelu", "linear")`` (GeGLU), ``("silu", "linear")``
        (SwiGLU), or one name for a plain MLP.
      norm_type: ``"layernorm"`` or ``"rmsnorm"``.
      epsilon: added to the variance.
      zero_centered_gamma: store ``gamma - 1``.
      use_bias: biases after both GEMMs.
      return_layernorm_output: also return the normalized input.
      return_residual: also return the input itself, for the residual
        connection: its gradient then joins the norm's backward in one pass
        (``fp8jax.layernorm_mlp``'s ``return_residual``).
      dtype, param_dtype, kernel_init, bias_init, scale_init, ln_bias_init,
      recipe: as in LayerNormDenseGeneral.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from fp8jax.flax import linen as fnn
      >>> mlp = fnn.LayerNormMLP(intermediate_dim=64, activations=("silu", "linear"))
      >>> x = jnp.ones((2, 8, 32))
      >>> variables = jax.jit(mlp.init)(jax.random.key(0), x)
      >>> mlp.apply(variables, x).shape
      (2, 8, 32)
    """

    intermediate_dim: int
    _: dataclasses.KW_ONLY
    activations: Sequence[str] = ("gelu", "linear")
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
    recipe: Recipe | None = None

    def __post_init__(self):
        owner = type(self).__name__
        _common.positive_int(owner, "intermediate_dim", self.intermediate_dim)
        _common.activations(owner, self.activations)
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
        acts = _common.activations(owner, self.activations)
        x = x.astype(self.dtype or x.dtype)
        hidden, ffn, pd = x.shape[-1], self.intermediate_dim, self.param_dtype
        gamma_init = _common.gamma_init(self.zero_centered_gamma, self.scale_init)
        gamma = param(self, "scale", gamma_init, (hidden,), pd, (EMBED,))
        beta = None
        if _common.norm_beta(self.norm_type):
            beta = param(self, "ln_bias", self.ln_bias_init, (hidden,), pd, (EMBED,))
        init = _common.fan_in_init(self.kernel_init, 1)
        kernel_1 = param(self, "kernel_1", init, (hidden, len(acts), ffn), pd, (EMBED, ACT, MLP))
        kernel_2 = param(self, "kernel_2", init, (ffn, hidden), pd, (MLP, EMBED))
        bias_1 = bias_2 = None
        if self.use_bias:
            bias_1 = param(self, "bias_1", self.bias_init, (len(acts), ffn), pd, (ACT, MLP))
            bias_2 = param(self, "bias_2", self.bias_init, (hidden,), pd, (EMBED,))
        norm = {
            "norm_type": self.norm_type,
            "zero_centered_gamma": self.zero_centered_gamma,
            "epsilon": self.epsilon,
        }
        state = scale_state(self, self.recipe, kernel_1, MlpScaleState)
        y = fp8jax.layernorm_mlp(
            x, gamma, beta, kernel_1, kernel_2, bias_1, bias_2,
            activations=acts, recipe=self.recipe, state=state,
            return_residual=self.return_residual, **norm,
        )  # fmt: skip
        if not self.return_layernorm_output:
            return y
        # The fused op does not return its normalized input; this recomputes it
        # with the same parameters (elementwise work XLA may share with the op).
        return y, fp8jax.layernorm(x, gamma, beta, **norm)

"""NNX LayerNormMLP over ``fp8jax.layernorm_mlp``."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

import fp8jax
from fp8jax.flax import _common
from fp8jax.flax._common import ACT, EMBED, MLP
from fp8jax.flax.nnx._base import param, scale_state, state_value, value_of
from fp8jax.flax.nnx.dense import default_kernel_init
from fp8jax.recipes import Recipe
from fp8jax.scaling import MlpScaleState


class LayerNormMLP(nnx.Module):
    """Norm -> FP8 GEMM -> (gated) activation -> FP8 GEMM; the NNX twin of the Linen module.

    Args:
      in_features: the hidden size (input and output width).
      intermediate_dim: the MLP's inner width.
      activations: ``("gelu", "linear")`` (GeGLU), ``("silu", "linear")``
        (SwiGLU), or one name for a plain MLP.
      norm_type, epsilon, zero_centered_gamma: the norm's settings.
      use_bias: biases after both GEMMs.
      return_layernorm_output: also return the normalized input.
      return_residual: also return the input itself, for a residual taken
        before the norm: its gradient then joins the norm's backward in one
        pass (see the Linen module).
      dtype, param_dtype, kernel_init, bias_init, scale_init, ln_bias_init,
      recipe, rngs: as in LayerNormDenseGeneral.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from fp8jax.flax import nnx as fnnx
      >>> mlp = fnnx.LayerNormMLP(32, 64, activations=("silu", "linear"), rngs=nnx.Rngs(0))
      >>> mlp(jnp.ones((2, 8, 32))).shape
      (2, 8, 32)
    """

    def __init__(
        self,
        in_features: int,
        intermediate_dim: int,
        *,
        activations: Sequence[str] = ("gelu", "linear"),
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
        recipe: Recipe | None = None,
        rngs: nnx.Rngs,
    ):
        owner = type(self).__name__
        hidden = _common.positive_int(owner, "in_features", in_features)
        ffn = _common.positive_int(owner, "intermediate_dim", intermediate_dim)
        self.activations = _common.activations(owner, activations)
        self.norm_type = _common.norm_type(owner, norm_type)
        _common.flags(owner, zero_centered_gamma=zero_centered_gamma, use_bias=use_bias,
                      return_layernorm_output=return_layernorm_output,
                      return_residual=return_residual)  # fmt: skip
        _common.residual_output(owner, return_residual, return_layernorm_output)
        n_act, pd = len(self.activations), param_dtype
        gamma_init = _common.gamma_init(zero_centered_gamma, scale_init)
        self.scale = param(gamma_init, rngs, (hidden,), pd, (EMBED,))
        has_beta = _common.norm_beta(norm_type)
        self.ln_bias = param(ln_bias_init, rngs, (hidden,), pd, (EMBED,), enabled=has_beta)
        init = _common.fan_in_init(kernel_init, 1)
        self.kernel_1 = param(init, rngs, (hidden, n_act, ffn), pd, (EMBED, ACT, MLP))
        self.kernel_2 = param(init, rngs, (ffn, hidden), pd, (MLP, EMBED))
        self.bias_1 = param(bias_init, rngs, (n_act, ffn), pd, (ACT, MLP), enabled=use_bias)
        self.bias_2 = param(bias_init, rngs, (hidden,), pd, (EMBED,), enabled=use_bias)
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
        self.scales = scale_state(recipe, MlpScaleState)

    def __call__(self, x: jax.Array):
        _common.in_features(type(self).__name__, x, (-1,), (self.in_features,))
        x = x.astype(self.dtype or x.dtype)
        gamma, beta = self.scale[...], value_of(self.ln_bias)
        norm = {
            "norm_type": self.norm_type,
            "zero_centered_gamma": self.zero_centered_gamma,
            "epsilon": self.epsilon,
        }
        y = fp8jax.layernorm_mlp(
            x, gamma, beta, self.kernel_1[...], self.kernel_2[...],
            value_of(self.bias_1), value_of(self.bias_2),
            activations=self.activations, recipe=self.recipe,
            state=state_value(self.scales, self.kernel_1[...], type(self).__name__),
            return_residual=self.return_residual, **norm,
        )  # fmt: skip
        if not self.return_layernorm_output:
            return y
        # As in the Linen module: the fused op's normalized input, recomputed.
        return y, fp8jax.layernorm(x, gamma, beta, **norm)

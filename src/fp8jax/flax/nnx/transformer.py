"""NNX TransformerLayer: MultiHeadAttention + LayerNormMLP or MoEBlock, with residuals."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from fp8jax.flax import _attention, _common, _moe
from fp8jax.flax._common import RESIDUAL
from fp8jax.flax._moe import MoEConfig
from fp8jax.flax.nnx.attention import MultiHeadAttention
from fp8jax.flax.nnx.dense import default_kernel_init
from fp8jax.flax.nnx.mlp import LayerNormMLP
from fp8jax.flax.nnx.moe import MoEBlock
from fp8jax.flax.nnx.norm import LayerNorm
from fp8jax.recipes import Recipe
from fp8jax.sharding import constrain


class TransformerLayer(nnx.Module):
    """One transformer block; the NNX twin of :class:`fp8jax.flax.linen.TransformerLayer`.

    With ``moe=MoEConfig(...)`` the MLP is a norm (``self.moe_norm``) and an
    :class:`MoEBlock` (``self.moe``, ``self.mlp`` None), as in the Linen
    module; the last call's load-balancing loss is ``self.moe.aux_loss`` (one
    per layer, stacked, for layers made by ``nnx.vmap`` and run by ``nnx.scan``).

    Args:
      num_heads: query heads.
      in_features: the hidden size.
      intermediate_dim: the MLP's inner width (each expert's, with ``moe``).
      num_kv_heads, head_dim, causal, use_rope, rope_base,
      attention_implementation, attention_hadamard: as in MultiHeadAttention.
      activations: as in LayerNormMLP; ``("silu", "linear")`` is SwiGLU. With
        ``moe``, a gated pair ``(act, "linear")``: the experts' gate activation.
      moe: None (a dense MLP) or an :class:`MoEConfig` (see the Linen module).
      norm_type: ``"layernorm"`` or ``"rmsnorm"``, for every norm.
      norm_position: ``"pre"`` or ``"post"`` (see the Linen module).
      residual_from_norm: pre-norm only; residuals from the norm's output.
      zero_centered_gamma, epsilon: norm settings.
      use_bias: biases on every GEMM.
      dropout_rate: dropout on the attention and MLP outputs.
      deterministic: disable dropout by default; may be overridden per call.
      dtype, param_dtype, kernel_init, bias_init, recipe: as in DenseGeneral.
      rngs: ``nnx.Rngs`` for the initializers and dropout.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from fp8jax.flax import nnx as fnnx
      >>> layer = fnnx.TransformerLayer(4, 32, 64, causal=True, rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((2, 8, 32))).shape
      (2, 8, 32)
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        intermediate_dim: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        activations: Sequence[str] = ("gelu", "linear"),
        moe: MoEConfig | None = None,
        norm_type: str = "layernorm",
        norm_position: str = "pre",
        residual_from_norm: bool = False,
        zero_centered_gamma: bool = False,
        epsilon: float = 1e-6,
        causal: bool = False,
        use_rope: bool = False,
        rope_base: float = 10000.0,
        use_bias: bool = True,
        dropout_rate: float = 0.0,
        deterministic: bool = False,
        attention_implementation: str | None = None,
        attention_hadamard: bool = False,
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init=default_kernel_init,
        bias_init=jax.nn.initializers.zeros,
        recipe: Recipe | None = None,
        rngs: nnx.Rngs,
    ):
        owner = type(self).__name__
        # Checked here too, so that the errors name this module, not its attention.
        n, _ = _common.heads(owner, num_heads, num_kv_heads)
        hidden = _common.positive_int(owner, "in_features", in_features)
        _common.head_dim(owner, hidden, n, head_dim)
        _common.norm_type(owner, norm_type)
        self.pre = _common.norm_position(owner, norm_position) == "pre"
        _common.residual_from_norm(owner, residual_from_norm, norm_position)
        rate = _common.dropout_rate(owner, dropout_rate)
        _common.rope_base(owner, rope_base)
        _common.flags(owner, residual_from_norm=residual_from_norm,
                      zero_centered_gamma=zero_centered_gamma, causal=causal, use_rope=use_rope,
                      use_bias=use_bias, deterministic=deterministic)  # fmt: skip
        _attention.check_hadamard(owner, attention_hadamard, attention_implementation)
        _common.positive_int(owner, "intermediate_dim", intermediate_dim)
        _common.activations(owner, activations)
        block = None
        if moe is not None:
            block = _moe.block_settings(owner, moe, intermediate_dim, activations, recipe)
        norm = {
            "norm_type": norm_type,
            "zero_centered_gamma": zero_centered_gamma,
            "epsilon": epsilon,
            "dtype": dtype,
            "param_dtype": param_dtype,
            "rngs": rngs,
        }
        dense = {
            "use_bias": use_bias,
            "kernel_init": kernel_init,
            "bias_init": bias_init,
            "recipe": recipe,
        }
        self.attention = MultiHeadAttention(
            num_heads,
            in_features,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            causal=causal,
            use_rope=use_rope,
            rope_base=rope_base,
            input_layernorm=self.pre,
            return_layernorm_output=residual_from_norm,
            # Pre-norm, each residual is the norm's input, passed back by the fused
            # op so that its gradient joins the norm's backward (fp8jax.kernels.norm_backward).
            return_residual=self.pre and not residual_from_norm,
            dropout_rate=rate,
            deterministic=deterministic,
            attention_implementation=attention_implementation,
            attention_hadamard=attention_hadamard,
            **norm,
            **dense,
        )
        if block is None:
            self.moe_norm = self.moe = None
            self.mlp = LayerNormMLP(
                in_features,
                intermediate_dim,
                activations=activations,
                return_layernorm_output=residual_from_norm or not self.pre,
                return_residual=self.pre and not residual_from_norm,
                **norm,
                **dense,
            )
        else:
            # As in the Linen module: the router and experts read the normalized input.
            self.mlp = None
            self.moe_norm = LayerNorm(in_features, **norm)
            self.moe = MoEBlock(
                in_features,
                **block,
                dtype=dtype,
                param_dtype=param_dtype,
                kernel_init=kernel_init,
                recipe=recipe,
                rngs=rngs,
            )
            self.moe_residual_from_norm = residual_from_norm or not self.pre
        self.dropout = nnx.Dropout(rate, deterministic=deterministic, rngs=rngs) if rate else None
        self.output_norm = None if self.pre else LayerNorm(in_features, **norm)
        self.dtype = dtype

    def __call__(self, x, mask=None, positions=None, deterministic: bool | None = None):
        """``x`` ``(batch, seq, hidden)`` -> same shape; arguments as in MultiHeadAttention."""
        _common.rank(type(self).__name__, x, expected=3)
        _common.deterministic(type(self).__name__, deterministic)
        # The residual stream: batch split over dp/fsdp, sequence over sp (if any).
        x = constrain(x.astype(self.dtype or x.dtype), RESIDUAL)
        a = self.attention(x, mask, positions, deterministic)
        a, residual = a if self.pre else (a, x)
        h = constrain(residual + a, RESIDUAL)
        if self.moe is None:
            m, residual = self.mlp(h)
        else:
            normed = self.moe_norm(h)
            m = self.moe(normed)
            residual = normed if self.moe_residual_from_norm else h
        if self.dropout is not None:
            m = self.dropout(m, deterministic=deterministic)
        y = constrain(residual + m, RESIDUAL)
        return y if self.pre else self.output_norm(y)

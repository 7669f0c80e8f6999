"""Linen TransformerLayer: MultiHeadAttention + LayerNormMLP or MoEBlock, with residuals."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fp8jax.flax import _attention, _common, _moe
from fp8jax.flax._common import RESIDUAL
from fp8jax.flax._moe import MoEConfig
from fp8jax.flax.linen.attention import MultiHeadAttention
from fp8jax.flax.linen.dense import default_kernel_init
from fp8jax.flax.linen.mlp import LayerNormMLP
from fp8jax.flax.linen.moe import MoEBlock
from fp8jax.flax.linen.norm import LayerNorm
from fp8jax.recipes import Recipe
from fp8jax.sharding import constrain


class TransformerLayer(nn.Module):
    """One transformer block; four FP8 GEMMs forward (QKV, out, fc1, fc2), eight backward.

    ``norm_position="pre"`` (default): ``h = x + attn(norm(x))``,
    ``y = h + mlp(norm(h))``, both norms fused into the following GEMM.
    ``residual_from_norm=True`` takes each residual from the norm's output
    instead (TransformerEngine's ``apply_residual_connection_post_layernorm``).

    ``norm_position="post"`` (original Transformer, BERT):
    ``h = norm_1(x + attn(x))``, ``y = norm_2(h + mlp(h))``. ``norm_1`` is the
    MLP's own fused norm (so its parameters are under ``mlp``), and ``norm_2``
    is the ``output_norm`` submodule.

    ``moe=MoEConfig(num_experts, top_k)`` makes it an MoE layer: the MLP
    becomes a norm (the ``moe_norm`` submodule, in both norm positions) and an
    :class:`MoEBlock` (``moe``) on its output, with the same residuals and
    dropout: the FP8 GEMMs are QKV, out and the experts' two grouped GEMMs
    (the router stays f32). The block's auxiliary load-balancing loss is sown
    at ``["intermediates"]["moe"]["aux_loss"]`` (``apply(...,
    mutable=["intermediates"])``; stacked per layer under ``nn.scan`` with
    ``variable_axes={"intermediates": 0}``).

    Attributes:
      num_heads: query heads.
      intermediate_dim: the MLP's inner width (each expert's, with ``moe``).
      num_kv_heads, head_dim, causal, use_rope, rope_base,
      attention_implementation, attention_hadamard: as in MultiHeadAttention.
      activations: as in LayerNormMLP; ``("silu", "linear")`` is SwiGLU. With
        ``moe``, a gated pair ``(act, "linear")``: the experts' gate activation.
      moe: None (a dense MLP) or an :class:`MoEConfig`; see above. The
        experts have no biases and take CurrentScaling or BlockScaling.
      norm_type: ``"layernorm"`` or ``"rmsnorm"``, for every norm.
      norm_position: ``"pre"`` or ``"post"``.
      residual_from_norm: pre-norm only; see above.
      zero_centered_gamma, epsilon: norm settings.
      use_bias: biases on every GEMM.
      dropout_rate: dropout on the attention and MLP outputs, before each residual add.
      deterministic: disable dropout; may also be passed at call time.
      dtype, param_dtype, kernel_init, bias_init, recipe: as in DenseGeneral.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from fp8jax.flax import linen as fnn
      >>> layer = fnn.TransformerLayer(num_heads=4, intermediate_dim=64, causal=True)
      >>> x = jnp.ones((2, 8, 32))
      >>> variables = jax.jit(layer.init)(jax.random.key(0), x)
      >>> layer.apply(variables, x).shape
      (2, 8, 32)
    """

    num_heads: int
    intermediate_dim: int
    _: dataclasses.KW_ONLY
    num_kv_heads: int | None = None
    head_dim: int | None = None
    activations: Sequence[str] = ("gelu", "linear")
    moe: MoEConfig | None = None
    norm_type: str = "layernorm"
    norm_position: str = "pre"
    residual_from_norm: bool = False
    zero_centered_gamma: bool = False
    epsilon: float = 1e-6
    causal: bool = False
    use_rope: bool = False
    rope_base: float = 10000.0
    use_bias: bool = True
    dropout_rate: float = 0.0
    deterministic: bool | None = None
    attention_implementation: str | None = None
    attention_hadamard: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = default_kernel_init
    bias_init: Any = jax.nn.initializers.zeros
    recipe: Recipe | None = None

    def __post_init__(self):
        owner = type(self).__name__
        _common.heads(owner, self.num_heads, self.num_kv_heads)
        _common.positive_int(owner, "intermediate_dim", self.intermediate_dim)
        _common.activations(owner, self.activations)
        _common.norm_type(owner, self.norm_type)
        _common.norm_position(owner, self.norm_position)
        _common.residual_from_norm(owner, self.residual_from_norm, self.norm_position)
        _common.dropout_rate(owner, self.dropout_rate)
        _common.rope_base(owner, self.rope_base)
        _common.flags(owner, residual_from_norm=self.residual_from_norm,
                      zero_centered_gamma=self.zero_centered_gamma, causal=self.causal,
                      use_rope=self.use_rope, use_bias=self.use_bias)  # fmt: skip
        _common.deterministic(owner, self.deterministic)
        _attention.check_hadamard(owner, self.attention_hadamard, self.attention_implementation)
        if self.moe is not None:
            _moe.block_settings(owner, self.moe, self.intermediate_dim, self.activations,
                                self.recipe)  # fmt: skip
        super().__post_init__()

    @nn.compact
    def __call__(self, x, mask=None, positions=None, deterministic: bool | None = None):
        """``x`` ``(batch, seq, hidden)`` -> same shape; arguments as in MultiHeadAttention."""
        owner = type(self).__name__
        _common.rank(owner, x, expected=3)
        _common.deterministic(owner, deterministic)
        # Checked here too, so that the error names this module, not its attention.
        n, _ = _common.heads(owner, self.num_heads, self.num_kv_heads)
        _common.head_dim(owner, x.shape[-1], n, self.head_dim)
        # The residual stream: batch split over dp/fsdp, sequence over sp (if any).
        x = constrain(x.astype(self.dtype or x.dtype), RESIDUAL)
        pre, from_norm = self.norm_position == "pre", self.residual_from_norm
        # Pre-norm, each residual is the norm's input, passed back by the fused
        # op so that its gradient joins the norm's backward (fp8jax.kernels.norm_backward).
        passed_residual = pre and not from_norm
        norm = {
            "norm_type": self.norm_type,
            "zero_centered_gamma": self.zero_centered_gamma,
            "epsilon": self.epsilon,
            "dtype": self.dtype,
            "param_dtype": self.param_dtype,
        }
        dense = {
            "use_bias": self.use_bias,
            "kernel_init": self.kernel_init,
            "bias_init": self.bias_init,
            "recipe": self.recipe,
        }
        a = MultiHeadAttention(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            causal=self.causal,
            use_rope=self.use_rope,
            rope_base=self.rope_base,
            input_layernorm=pre,
            return_layernorm_output=from_norm,
            return_residual=passed_residual,
            dropout_rate=self.dropout_rate,
            deterministic=self.deterministic,
            attention_implementation=self.attention_implementation,
            attention_hadamard=self.attention_hadamard,
            name="attention",
            **norm,
            **dense,
        )(x, mask, positions, deterministic)
        a, residual = a if pre else (a, x)
        h = constrain(residual + a, RESIDUAL)
        if self.moe is None:
            m, residual = LayerNormMLP(
                self.intermediate_dim,
                activations=self.activations,
                return_layernorm_output=from_norm or not pre,
                return_residual=passed_residual,
                name="mlp",
                **norm,
                **dense,
            )(h)
        else:
            # The router and the experts read the normalized input, so the
            # norm is a module of its own, not fused into a GEMM.
            normed = LayerNorm(name="moe_norm", **norm)(h)
            block = _moe.block_settings(type(self).__name__, self.moe, self.intermediate_dim,
                                        self.activations, self.recipe)  # fmt: skip
            m = MoEBlock(
                **block,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                kernel_init=self.kernel_init,
                recipe=self.recipe,
                name="moe",
            )(normed)
            residual = normed if from_norm or not pre else h
        if self.dropout_rate > 0:
            deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
            m = nn.Dropout(self.dropout_rate)(m, deterministic=deterministic)
        y = constrain(residual + m, RESIDUAL)
        return y if pre else LayerNorm(name="output_norm", **norm)(y)

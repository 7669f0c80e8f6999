"""Linen MultiHeadAttention: FP8 QKV and output projections around a BF16 attention core."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fp8jax.flax import _attention, _common
from fp8jax.flax._common import EMBED, HEADS, KV, QKV, RESIDUAL
from fp8jax.flax.linen.dense import DenseGeneral, LayerNormDenseGeneral, default_kernel_init
from fp8jax.recipes import Recipe
from fp8jax.sharding import constrain


class MultiHeadAttention(nn.Module):
    """Self-attention with one fused FP8 QKV GEMM and an FP8 output GEMM.

    The QKV kernel is ``(hidden, num_kv_heads, group + 2, head_dim)`` with
    ``group = num_heads // num_kv_heads``: each key/value head is stored next
    to the query heads it serves (then its key, then its value), so sharding
    the ``heads`` axis keeps every group on one device. The attention core is
    ``jax.nn.dot_product_attention`` in the compute dtype (BF16 in training);
    it is not quantized.

    Attributes:
      num_heads: query heads.
      num_kv_heads: key/value heads (GQA); must divide num_heads. None: num_heads.
      head_dim: width of a head; None: hidden // num_heads.
      causal: apply a causal mask.
      use_rope: rotary position embeddings on queries and keys.
      rope_base: RoPE wavelength base.
      input_layernorm: normalize the input, fused into the QKV GEMM (pre-norm).
      norm_type, epsilon, zero_centered_gamma: that norm's settings.
      return_layernorm_output: also return the normalized input.
      return_residual: also return the input itself, from the fused norm, for
        the residual connection: its gradient then joins the norm's backward
        in one pass (``fp8jax.layernorm_dense``'s ``return_residual``).
      use_bias: biases on the QKV and output projections.
      dropout_rate: dropout on the output (the fused attention core has no
        probability dropout).
      deterministic: disable dropout; may also be passed at call time.
      attention_implementation: ``None`` (XLA), ``"xla"``, ``"cudnn"`` or ``"fp8"``
        (:func:`fp8jax.dot_product_attention`: head_dim 64 or 128, no mask).
      attention_hadamard: with ``"fp8"``, rotate each head's queries and keys
        by a fixed randomized Hadamard matrix before quantizing (the op's
        ``hadamard``): spreads outlier channels over the head at no cost in
        exact arithmetic.
      dtype, param_dtype, kernel_init, bias_init, recipe: as in DenseGeneral.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from fp8jax.flax import linen as fnn
      >>> attn = fnn.MultiHeadAttention(num_heads=4, num_kv_heads=2, causal=True, use_rope=True)
      >>> x = jnp.ones((2, 8, 32))
      >>> variables = jax.jit(attn.init)(jax.random.key(0), x)
      >>> attn.apply(variables, x).shape
      (2, 8, 32)
    """

    num_heads: int
    _: dataclasses.KW_ONLY
    num_kv_heads: int | None = None
    head_dim: int | None = None
    causal: bool = False
    use_rope: bool = False
    rope_base: float = 10000.0
    input_layernorm: bool = True
    norm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    return_layernorm_output: bool = False
    return_residual: bool = False
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
        _common.norm_type(owner, self.norm_type)
        _common.dropout_rate(owner, self.dropout_rate)
        _common.rope_base(owner, self.rope_base)
        _common.flags(owner, causal=self.causal, use_rope=self.use_rope,
                      input_layernorm=self.input_layernorm,
                      zero_centered_gamma=self.zero_centered_gamma,
                      return_layernorm_output=self.return_layernorm_output,
                      return_residual=self.return_residual, use_bias=self.use_bias)  # fmt: skip
        _common.deterministic(owner, self.deterministic)
        _attention.check_hadamard(owner, self.attention_hadamard, self.attention_implementation)
        _common.layernorm_output(owner, self.return_layernorm_output, self.input_layernorm)
        _common.residual_output(owner, self.return_residual, self.return_layernorm_output,
                                self.input_layernorm)  # fmt: skip
        super().__post_init__()

    @nn.compact
    def __call__(self, x, mask=None, positions=None, deterministic: bool | None = None):
        """Attends ``x`` ``(batch, seq, hidden)`` to itself.

        Args:
          x: the input, rank 3.
          mask: optional boolean mask broadcastable to ``(batch, heads, seq, seq)``;
            True attends.
          positions: RoPE positions ``(seq,)`` or ``(batch, seq)``; default ``arange(seq)``.
          deterministic: overrides the attribute; needed when dropout_rate > 0.

        Returns:
          ``(batch, seq, hidden)``, or ``(y, normalized_x)`` with return_layernorm_output,
          or ``(y, x)`` with return_residual.
        """
        owner = type(self).__name__
        _common.rank(owner, x, expected=3)
        _common.deterministic(owner, deterministic)
        hidden = x.shape[-1]
        n, n_kv = _common.heads(owner, self.num_heads, self.num_kv_heads)
        d = _common.head_dim(owner, hidden, n, self.head_dim)
        group = n // n_kv
        x = x.astype(self.dtype or x.dtype)
        common = {
            "use_bias": self.use_bias,
            "dtype": self.dtype,
            "param_dtype": self.param_dtype,
            "kernel_init": self.kernel_init,
            "bias_init": self.bias_init,
            "recipe": self.recipe,
        }
        qkv_shape = {"features": (n_kv, group + 2, d), "kernel_axes": (EMBED, HEADS, QKV, KV)}
        qkv_shape["bias_axes"] = (HEADS, QKV, KV)
        qkv_shape["split"] = (group, 1, 1)  # q, k, v as pieces (fp8jax.ops.split)
        if self.input_layernorm:
            qkv = LayerNormDenseGeneral(
                norm_type=self.norm_type,
                epsilon=self.epsilon,
                zero_centered_gamma=self.zero_centered_gamma,
                return_layernorm_output=self.return_layernorm_output,
                return_residual=self.return_residual,
                name="qkv",
                **qkv_shape,
                **common,
            )(x)
        else:
            qkv = DenseGeneral(name="qkv", **qkv_shape, **common)(x)
        # The normalized input or the input itself, as the fused norm returns it.
        passes_input = self.return_layernorm_output or self.return_residual
        qkv, passed = qkv if passes_input else (qkv, None)
        o = _attention.attend(
            qkv,
            num_heads=n,
            rope_base=self.rope_base if self.use_rope else None,
            positions=positions,
            mask=mask,
            causal=self.causal,
            implementation=self.attention_implementation,
            hadamard=self.attention_hadamard,
        )
        y = DenseGeneral(
            features=hidden,
            axis=(-2, -1),
            kernel_axes=(HEADS, KV, EMBED),
            bias_axes=(EMBED,),
            name="out",
            **common,
        )(o)
        # Row-parallel: under sequence parallelism this is a reduce-scatter.
        y = constrain(y, RESIDUAL)
        if self.dropout_rate > 0:
            deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
            y = nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
        return y if passed is None else (y, passed)

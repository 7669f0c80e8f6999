"""NNX MultiHeadAttention: FP8 QKV and output projections around a BF16 attention core."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from fp8jax.flax import _attention, _common
from fp8jax.flax._common import EMBED, HEADS, KV, QKV, RESIDUAL
from fp8jax.flax.nnx.dense import DenseGeneral, LayerNormDenseGeneral, default_kernel_init
from fp8jax.recipes import Recipe
from fp8jax.sharding import constrain


class MultiHeadAttention(nnx.Module):
    """Self-attention with one fused FP8 QKV GEMM and an FP8 output GEMM.

    The NNX twin of :class:`fp8jax.flax.linen.MultiHeadAttention`; see there
    for the QKV kernel layout ``(hidden, num_kv_heads, group + 2, head_dim)``.

    Args:
      num_heads: query heads.
      in_features: the hidden size.
      num_kv_heads: key/value heads (GQA); must divide num_heads. None: num_heads.
      head_dim: width of a head; None: in_features // num_heads.
      causal: apply a causal mask.
      use_rope: rotary position embeddings on queries and keys.
      rope_base: RoPE wavelength base.
      input_layernorm: normalize the input, fused into the QKV GEMM (pre-norm).
      norm_type, epsilon, zero_centered_gamma: that norm's settings.
      return_layernorm_output: also return the normalized input.
      return_residual: also return the input itself, from the fused norm, for
        the residual connection: its gradient then joins the norm's backward
        in one pass (see the Linen module).
      use_bias: biases on the QKV and output projections.
      dropout_rate: dropout on the output.
      deterministic: disable dropout by default; may be overridden per call.
      attention_implementation: ``None`` (XLA), ``"xla"``, ``"cudnn"`` or ``"fp8"``
        (:func:`fp8jax.dot_product_attention`: head_dim 64 or 128, no mask).
      attention_hadamard: with ``"fp8"``, rotate queries and keys by a fixed
        randomized Hadamard matrix before quantizing (see the Linen module).
      dtype, param_dtype, kernel_init, bias_init, recipe: as in DenseGeneral.
      rngs: ``nnx.Rngs`` for the initializers and dropout.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from fp8jax.flax import nnx as fnnx
      >>> attn = fnnx.MultiHeadAttention(4, 32, num_kv_heads=2, causal=True, rngs=nnx.Rngs(0))
      >>> attn(jnp.ones((2, 8, 32))).shape
      (2, 8, 32)
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        causal: bool = False,
        use_rope: bool = False,
        rope_base: float = 10000.0,
        input_layernorm: bool = True,
        norm_type: str = "layernorm",
        epsilon: float = 1e-6,
        zero_centered_gamma: bool = False,
        return_layernorm_output: bool = False,
        return_residual: bool = False,
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
        n, n_kv = _common.heads(owner, num_heads, num_kv_heads)
        hidden = _common.positive_int(owner, "in_features", in_features)
        d = _common.head_dim(owner, hidden, n, head_dim)
        _common.norm_type(owner, norm_type)
        rate = _common.dropout_rate(owner, dropout_rate)
        rope_base = _common.rope_base(owner, rope_base)
        _common.flags(owner, causal=causal, use_rope=use_rope, input_layernorm=input_layernorm,
                      zero_centered_gamma=zero_centered_gamma,
                      return_layernorm_output=return_layernorm_output,
                      return_residual=return_residual, use_bias=use_bias,
                      deterministic=deterministic)  # fmt: skip
        _attention.check_hadamard(owner, attention_hadamard, attention_implementation)
        _common.layernorm_output(owner, return_layernorm_output, input_layernorm)
        _common.residual_output(owner, return_residual, return_layernorm_output, input_layernorm)
        common = {
            "use_bias": use_bias,
            "dtype": dtype,
            "param_dtype": param_dtype,
            "kernel_init": kernel_init,
            "bias_init": bias_init,
            "recipe": recipe,
            "rngs": rngs,
        }
        qkv = {
            "out_features": (n_kv, n // n_kv + 2, d),
            "kernel_axes": (EMBED, HEADS, QKV, KV),
            "bias_axes": (HEADS, QKV, KV),
            "split": (n // n_kv, 1, 1),  # q, k, v as pieces (fp8jax.ops.split)
        }
        if input_layernorm:
            self.qkv = LayerNormDenseGeneral(
                hidden,
                norm_type=norm_type,
                epsilon=epsilon,
                zero_centered_gamma=zero_centered_gamma,
                return_layernorm_output=return_layernorm_output,
                return_residual=return_residual,
                **qkv,
                **common,
            )
        else:
            self.qkv = DenseGeneral(hidden, **qkv, **common)
        self.out = DenseGeneral(
            (n, d), hidden, axis=(-2, -1), kernel_axes=(HEADS, KV, EMBED), bias_axes=(EMBED,),
            **common,
        )  # fmt: skip
        self.dropout = nnx.Dropout(rate, deterministic=deterministic, rngs=rngs) if rate else None
        self.num_heads, self.in_features, self.dtype = n, hidden, dtype
        self.causal, self.rope_base = causal, rope_base if use_rope else None
        # The fused norm passes back the normalized input or the input itself.
        self.passes_input = return_layernorm_output or return_residual
        self.attention_implementation = attention_implementation
        self.attention_hadamard = attention_hadamard

    def __call__(self, x, mask=None, positions=None, deterministic: bool | None = None):
        """Attends ``x`` ``(batch, seq, hidden)`` to itself; arguments as in the Linen module."""
        owner = type(self).__name__
        _common.rank(owner, x, expected=3)
        _common.deterministic(owner, deterministic)
        _common.in_features(owner, x, (-1,), (self.in_features,))
        x = x.astype(self.dtype or x.dtype)
        qkv, passed = self.qkv(x) if self.passes_input else (self.qkv(x), None)
        o = _attention.attend(
            qkv,
            num_heads=self.num_heads,
            rope_base=self.rope_base,
            positions=positions,
            mask=mask,
            causal=self.causal,
            implementation=self.attention_implementation,
            hadamard=self.attention_hadamard,
        )
        # Row-parallel: under sequence parallelism this is a reduce-scatter.
        y = constrain(self.out(o), RESIDUAL)
        if self.dropout is not None:
            y = self.dropout(y, deterministic=deterministic)
        return y if passed is None else (y, passed)

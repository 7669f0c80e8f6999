"""The BF16 twin of :class:`fp8jax.flax.linen.TransformerLayer`, for baselines.

Same parameter names, shapes, initializers and logical axis names as the FP8
layer (pre-norm), created in the same order under the same module names, so
``init`` with the same key gives bitwise the same parameters. The only
difference is the matmuls: plain BF16 ``lax.dot_general`` instead of FP8. The
norms and the attention core are the ones the FP8 layer uses, so an FP8 vs
BF16 comparison differs in the GEMMs and nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import fp8jax
from fp8jax.activations import gated
from fp8jax.flax import _attention, _common, _moe
from fp8jax.flax._common import ACT, EMBED, HEADS, KV, MLP, QKV, RESIDUAL
from fp8jax.flax._moe import MoEConfig
from fp8jax.flax.linen._base import param
from fp8jax.flax.linen.dense import default_kernel_init
from fp8jax.flax.linen.moe import MoEBlock
from fp8jax.flax.linen.norm import LayerNorm
from fp8jax.ops.gemm import add_bias
from fp8jax.sharding import constrain


def _bf16_dot(x, kernel, n_contract: int):
    """``x``'s last ``n_contract`` axes against ``kernel``'s first, BF16 operands and result."""
    dims = (tuple(range(x.ndim - n_contract, x.ndim)), tuple(range(n_contract)))
    return jax.lax.dot_general(
        x.astype(jnp.bfloat16), kernel.astype(jnp.bfloat16), (dims, ((), ()))
    )


class _Norm(nn.Module):
    """Creates a norm's ``scale`` (and ``ln_bias``) where the FP8 fused modules do."""

    norm_type: str
    epsilon: float
    param_dtype: Any

    def norm(self, x):
        shape, pd = (x.shape[-1],), self.param_dtype
        gamma = param(self, "scale", jax.nn.initializers.ones, shape, pd, (EMBED,))
        beta = None
        if _common.norm_beta(self.norm_type):
            beta = param(self, "ln_bias", jax.nn.initializers.zeros, shape, pd, (EMBED,))
        return fp8jax.layernorm(x, gamma, beta, norm_type=self.norm_type, epsilon=self.epsilon)


class _NormDense(_Norm):
    """LayerNormDenseGeneral's parameters (``scale``, ``ln_bias``, ``kernel``, ``bias``)."""

    features: tuple[int, ...] = ()
    kernel_axes: tuple = ()
    bias_axes: tuple = ()
    use_bias: bool = False

    @nn.compact
    def __call__(self, x):
        normed = self.norm(x)
        init = _common.fan_in_init(default_kernel_init, 1)
        shape = (x.shape[-1], *self.features)
        kernel = param(self, "kernel", init, shape, self.param_dtype, self.kernel_axes)
        y = _bf16_dot(normed, kernel, 1)
        if self.use_bias:
            zeros = jax.nn.initializers.zeros
            bias = param(self, "bias", zeros, self.features, self.param_dtype, self.bias_axes)
            y = add_bias(y, bias, len(self.features))
        return y


class _OutDense(nn.Module):
    """The attention output projection: DenseGeneral over ``(heads, head_dim)``."""

    hidden: int
    use_bias: bool
    param_dtype: Any

    @nn.compact
    def __call__(self, o):
        shape = (*o.shape[-2:], self.hidden)
        init = _common.fan_in_init(default_kernel_init, 2)
        kernel = param(self, "kernel", init, shape, self.param_dtype, (HEADS, KV, EMBED))
        y = _bf16_dot(o, kernel, 2)
        if self.use_bias:
            zeros = jax.nn.initializers.zeros
            bias = param(self, "bias", zeros, (self.hidden,), self.param_dtype, (EMBED,))
            y = add_bias(y, bias, 1)
        return y


class _Attention(nn.Module):
    num_heads: int
    num_kv_heads: int
    causal: bool
    rope_base: float | None
    norm: dict
    use_bias: bool
    attention_implementation: str | None
    attention_hadamard: bool

    @nn.compact
    def __call__(self, x):
        hidden, n, n_kv = x.shape[-1], self.num_heads, self.num_kv_heads
        d = _common.head_dim("Bf16TransformerLayer", hidden, n, None)
        qkv = _NormDense(
            features=(n_kv, n // n_kv + 2, d),
            kernel_axes=(EMBED, HEADS, QKV, KV),
            bias_axes=(HEADS, QKV, KV),
            use_bias=self.use_bias,
            name="qkv",
            **self.norm,
        )(x)
        o = _attention.attend(
            qkv,
            num_heads=n,
            rope_base=self.rope_base,
            positions=None,
            mask=None,
            causal=self.causal,
            implementation=self.attention_implementation,
            hadamard=self.attention_hadamard,
        )
        y = _OutDense(hidden, self.use_bias, self.norm["param_dtype"], name="out")(o)
        return constrain(y, RESIDUAL)


class _Mlp(_Norm):
    """LayerNormMLP's parameters, in its order: norm, kernel_1, kernel_2, bias_1, bias_2."""

    intermediate_dim: int = 1
    activations: tuple[str, ...] = ()
    use_bias: bool = False

    @nn.compact
    def __call__(self, x):
        hidden, ffn, pd = x.shape[-1], self.intermediate_dim, self.param_dtype
        n_act = len(self.activations)
        normed = self.norm(x)
        init = _common.fan_in_init(default_kernel_init, 1)
        kernel_1 = param(self, "kernel_1", init, (hidden, n_act, ffn), pd, (EMBED, ACT, MLP))
        kernel_2 = param(self, "kernel_2", init, (ffn, hidden), pd, (MLP, EMBED))
        pre = _bf16_dot(normed, kernel_1, 1)
        if self.use_bias:
            zeros = jax.nn.initializers.zeros
            bias_1 = param(self, "bias_1", zeros, (n_act, ffn), pd, (ACT, MLP))
            bias_2 = param(self, "bias_2", zeros, (hidden,), pd, (EMBED,))
            pre = add_bias(pre, bias_1, 2)
        # Rematerialized: the backward keeps only the bf16 pre-activation, as the
        # FP8 block does. Plain autodiff kept five f32 copies of (tokens, ffn)
        # per layer, 57 GB of stacked residuals in the medium GPT on the H200.
        gate = jax.checkpoint(functools.partial(gated, names=self.activations, dtype=jnp.bfloat16))
        y = _bf16_dot(gate(pre), kernel_2, 1)
        if self.use_bias:
            y = add_bias(y, bias_2, 1)
        return y


class Bf16TransformerLayer(nn.Module):
    """A pre-norm transformer block with BF16 GEMMs and the FP8 layer's parameters.

    Attributes mean what they mean in :class:`fp8jax.flax.linen.TransformerLayer`;
    only the pre-norm layout without dropout is supported. Compute is BF16.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from fp8jax.flax import linen as fnn
      >>> from fp8jax.models.bf16_layer import Bf16TransformerLayer
      >>> kw = dict(num_heads=4, intermediate_dim=64, causal=True)
      >>> x = jnp.ones((2, 8, 32), jnp.bfloat16)
      >>> p8 = jax.jit(fnn.TransformerLayer(**kw).init)(jax.random.key(0), x)
      >>> p16 = jax.jit(Bf16TransformerLayer(**kw).init)(jax.random.key(0), x)
      >>> jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), p8, p16))
      True
    """

    num_heads: int
    intermediate_dim: int
    _: dataclasses.KW_ONLY
    num_kv_heads: int | None = None
    activations: Sequence[str] = ("gelu", "linear")
    norm_type: str = "layernorm"
    epsilon: float = 1e-6
    causal: bool = False
    use_rope: bool = False
    rope_base: float = 10000.0
    use_bias: bool = True
    attention_implementation: str | None = None
    attention_hadamard: bool = False
    param_dtype: Any = jnp.float32
    moe: MoEConfig | None = None  # its fp8 is ignored: the experts run in BF16

    @nn.compact
    def __call__(self, x):
        """``x`` ``(batch, seq, hidden)`` -> the same shape, in BF16."""
        owner = type(self).__name__
        _common.rank(owner, x, expected=3)
        n, n_kv = _common.heads(owner, self.num_heads, self.num_kv_heads)
        # The same activation constraints as the FP8 layer, so that under a
        # mesh both partition alike (no-ops without fp8jax.sharding.use_mesh).
        x = constrain(x.astype(jnp.bfloat16), RESIDUAL)
        norm = {"norm_type": self.norm_type, "epsilon": self.epsilon}
        norm["param_dtype"] = self.param_dtype
        a = _Attention(
            num_heads=n,
            num_kv_heads=n_kv,
            causal=self.causal,
            rope_base=self.rope_base if self.use_rope else None,
            norm=norm,
            use_bias=self.use_bias,
            attention_implementation=self.attention_implementation,
            attention_hadamard=self.attention_hadamard,
            name="attention",
        )(x)
        h = constrain(x + a, RESIDUAL)
        if self.moe is not None:
            # The FP8 layer's MoE branch and parameter names, with BF16 experts.
            moe = dataclasses.replace(self.moe, fp8=False)
            block = _moe.block_settings(owner, moe, self.intermediate_dim, self.activations, None)
            normed = LayerNorm(name="moe_norm", **norm)(h)
            m = MoEBlock(**block, dtype=jnp.bfloat16, param_dtype=self.param_dtype,
                         name="moe")(normed)  # fmt: skip
            return constrain(h + m, RESIDUAL)
        m = _Mlp(
            intermediate_dim=self.intermediate_dim,
            activations=_common.activations(owner, self.activations),
            use_bias=self.use_bias,
            name="mlp",
            **norm,
        )(h)
        return constrain(h + m, RESIDUAL)

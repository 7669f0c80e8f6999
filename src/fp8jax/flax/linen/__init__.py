"""Flax Linen modules with FP8 GEMMs: thin wrappers over the fp8jax ops.

Under DelayedScaling each module's scale state lives in the ``"fp8_state"``
collection, created by ``init``; see :func:`fp8jax.flax.make_train_step`.
Under CurrentScaling (the default) modules keep no FP8 state.
"""

from fp8jax.flax._moe import MoEConfig
from fp8jax.flax.linen.attention import MultiHeadAttention
from fp8jax.flax.linen.dense import DenseGeneral, LayerNormDenseGeneral
from fp8jax.flax.linen.mlp import LayerNormMLP
from fp8jax.flax.linen.moe import MoEBlock
from fp8jax.flax.linen.norm import LayerNorm
from fp8jax.flax.linen.transformer import TransformerLayer

__all__ = [
    "DenseGeneral",
    "LayerNorm",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "MoEBlock",
    "MoEConfig",
    "MultiHeadAttention",
    "TransformerLayer",
]

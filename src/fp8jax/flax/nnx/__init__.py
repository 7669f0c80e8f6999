"""Flax NNX modules with FP8 GEMMs: the same math as :mod:`fp8jax.flax.linen`.

Under DelayedScaling each op's scale state is an :class:`Fp8State` variable,
created in ``__init__``; :func:`train_step` differentiates with respect to it
and swaps the new state in. Under CurrentScaling modules keep no FP8 state.
"""

from fp8jax.flax._moe import MoEConfig
from fp8jax.flax.nnx._base import Fp8State
from fp8jax.flax.nnx.attention import MultiHeadAttention
from fp8jax.flax.nnx.dense import DenseGeneral, LayerNormDenseGeneral
from fp8jax.flax.nnx.mlp import LayerNormMLP
from fp8jax.flax.nnx.moe import MoEBlock
from fp8jax.flax.nnx.norm import LayerNorm
from fp8jax.flax.nnx.train import train_step
from fp8jax.flax.nnx.transformer import TransformerLayer

__all__ = [
    "DenseGeneral",
    "Fp8State",
    "LayerNorm",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "MoEBlock",
    "MoEConfig",
    "MultiHeadAttention",
    "TransformerLayer",
    "train_step",
]

"""Flax integration: Linen and NNX modules, an FP8 ``dot_general``, train steps, checkpoints.

* :mod:`fp8jax.flax.linen` and :mod:`fp8jax.flax.nnx`: LayerNorm,
  DenseGeneral, LayerNormDenseGeneral, LayerNormMLP, MultiHeadAttention,
  MoEBlock and TransformerLayer (dense, or MoE with ``moe=MoEConfig(...)``),
  the same math in both APIs.
* :data:`fp8_dot_general` / :class:`Fp8DotGeneral`: pass to
  ``nn.Dense(dot_general=...)``, ``nnx.Linear(dot_general=...)`` and friends
  to make an existing model's GEMMs FP8 (CurrentScaling).
* :class:`TrainState` and :func:`make_train_step` (Linen),
  :func:`fp8jax.flax.nnx.train_step` (NNX): optax on params, FP8 state swapped in.
* :mod:`fp8jax.flax.checkpoint`: orbax save / restore of all of it.
"""

from fp8jax.flax.dot_general import Fp8DotGeneral, fp8_dot_general
from fp8jax.flax.train import (
    FP8_COLLECTION,
    Fp8StateNotDifferentiatedWarning,
    TrainState,
    make_train_step,
)

__all__ = [
    "FP8_COLLECTION",
    "Fp8DotGeneral",
    "Fp8StateNotDifferentiatedWarning",
    "TrainState",
    "fp8_dot_general",
    "make_train_step",
]

"""Logical axis names: the vocabulary the modules, the models and the sharding rules share.

A leaf module (it imports nothing), so that :mod:`fp8jax.sharding` can map
these names to mesh axes without importing the Flax layer that uses them.
Names no sharding rule mentions stay replicated.
"""

from __future__ import annotations

# Logical axis names of the parameters.
EMBED = "embed"  # the model (hidden) width
MLP = "mlp"  # the MLP's inner width
ACT = "act"  # the branches of a gated activation (2 for GeGLU / SwiGLU)
HEADS = "heads"  # attention heads; for the fused QKV kernel, the key/value heads
QKV = "qkv"  # inside a key/value group: its query heads, then the key, then the value
KV = "kv"  # the per-head width
LAYERS = "layers"  # the stacking axis nn.scan adds (PARTITION_NAME in the tests and docs)
EXPERT = "expert"  # the experts of an MoE block's wi and wo (fp8jax.flax._moe.EXPERT)
# Logical axis names of activations, for sharding constraints inside the layers.
BATCH = "batch"  # the batch axis
LENGTH = "length"  # the sequence axis where tokens are independent (norms, MLP, residuals)
RESIDUAL = (BATCH, LENGTH, None)  # the residual stream (batch, seq, hidden)

"""Two-layer models whose layers are scanned (stacked params and FP8 state), Linen and NNX."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from fp8jax.flax import linen as fnn
from fp8jax.flax import nnx as fnnx

HIDDEN, HEADS, FFN, LAYERS = 32, 4, 64, 2
LAYER_KW = {"num_kv_heads": 2, "causal": True, "use_rope": True, "dtype": jnp.bfloat16}


class _LinenBlock(nn.Module):
    recipe: object = None

    @nn.compact
    def __call__(self, h, _):
        return fnn.TransformerLayer(HEADS, FFN, recipe=self.recipe, **LAYER_KW)(h), None


class LinenStack(nn.Module):
    """``LAYERS`` TransformerLayers under ``nn.scan``: FP8 state stacked like the params."""

    recipe: object = None

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            _LinenBlock,
            variable_axes={"params": 0, "fp8_state": 0},
            split_rngs={"params": True},
            length=LAYERS,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        y, _ = stack(recipe=self.recipe, name="layers")(x.astype(jnp.bfloat16), None)
        return y.astype(jnp.float32)


class NnxStack(nnx.Module):
    """``LAYERS`` TransformerLayers created by ``nnx.vmap`` and run by ``nnx.scan``."""

    def __init__(self, recipe=None, *, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return fnnx.TransformerLayer(HEADS, HIDDEN, FFN, recipe=recipe, **LAYER_KW, rngs=rngs)

        self.layers = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(h, layer):
            return layer(h)

        return body(x.astype(jnp.bfloat16), self.layers).astype(jnp.float32)


def batch(seed=0, size=8, seq=8):
    """A copy task: predict the previous position's features (needs the causal attention)."""
    x = jax.random.normal(jax.random.key(seed), (size, seq, HIDDEN))
    return x, jnp.roll(x, 1, axis=1) * 0.5


def mse(pred, target):
    return jnp.mean(jnp.square(pred - target))


class _LinenMlpBlock(nn.Module):
    recipe: object = None

    @nn.compact
    def __call__(self, h, _):
        return h + fnn.LayerNormMLP(FFN, recipe=self.recipe)(h), None


class LinenMlpStack(nn.Module):
    """``LAYERS`` residual LayerNormMLPs under ``nn.scan``: cheap to compile, stacked state."""

    recipe: object = None

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            _LinenMlpBlock,
            variable_axes={"params": 0, "fp8_state": 0},
            split_rngs={"params": True},
            length=LAYERS,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        return stack(recipe=self.recipe, name="layers")(x, None)[0]


class NnxMlpStack(nnx.Module):
    """The NNX twin of LinenMlpStack."""

    def __init__(self, recipe=None, *, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return fnnx.LayerNormMLP(HIDDEN, FFN, recipe=recipe, rngs=rngs)

        self.layers = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(h, layer):
            return h + layer(h)

        return body(x, self.layers)

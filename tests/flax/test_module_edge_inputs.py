"""Flax modules with a single token (rank-1 input) or no tokens at all (issue 32, items 3-4).

The modules pass their input's leading axes through to the ops, so a
rank-1 input is one token and an empty batch gives an empty output and zero
parameter gradients, as ``jnp`` would; the DelayedScaling state records
amax 0 (no information) for the empty input and keeps its scale.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp8jax
from fp8jax.flax import linen as fnn
from fp8jax.flax import nnx as fnnx

RECIPE = fp8jax.DelayedScaling(amax_history_len=4)
DIFF = nnx.DiffState(0, nnx.Any(nnx.Param, fnnx.Fp8State))
MODULES = {
    "DenseGeneral": lambda: fnnx.DenseGeneral(16, 8, recipe=RECIPE, rngs=nnx.Rngs(0)),
    "LayerNormDenseGeneral": lambda: fnnx.LayerNormDenseGeneral(
        16, 8, recipe=RECIPE, rngs=nnx.Rngs(0)
    ),
    "LayerNormMLP": lambda: fnnx.LayerNormMLP(16, 32, recipe=RECIPE, rngs=nnx.Rngs(0)),
}


# The calls are jitted, as a model runs: eagerly each step of a module was a CPU program
# of its own (60-140 compiles a test).
_call = nnx.jit(lambda model, x: model(x))


@pytest.mark.parametrize("name", list(MODULES))
def test_a_rank1_input_is_one_token(name):
    model = MODULES[name]()
    x = jax.random.normal(jax.random.key(0), (16,))
    np.testing.assert_array_equal(_call(model, x), _call(model, x[None])[0])
    # The backward runs too (it crashed in lax for a rank-1 operand).
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2), argnums=DIFF))(model)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


def test_a_rank1_input_is_one_token_to_both_moe_blocks():
    # Linen's MoEBlock refused it (rank >= 2) where its NNX twin took it.
    x = jax.random.normal(jax.random.key(0), (16,))
    block = fnn.MoEBlock(num_experts=4, top_k=2, ffn=8)
    variables = jax.jit(block.init)(jax.random.key(1), x)
    apply = jax.jit(block.apply)
    np.testing.assert_array_equal(apply(variables, x), apply(variables, x[None])[0])
    model = fnnx.MoEBlock(16, num_experts=4, top_k=2, ffn=8, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(_call(model, x), _call(model, x[None])[0])


@pytest.mark.parametrize("name", list(MODULES))
def test_an_empty_batch_gives_empty_output_and_zero_param_gradients(name):
    model = MODULES[name]()
    x = jnp.ones((0, 16))
    assert _call(model, x).shape[0] == 0
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x)), argnums=DIFF))(model)
    params, state = nnx.split_state(grads, nnx.Param, fnnx.Fp8State)
    for g in jax.tree.leaves(params):
        np.testing.assert_array_equal(g, jnp.zeros_like(g))
    # The state's gradient is its next state: the empty input and its empty
    # gradient recorded amax 0 and kept scale 1.
    old = model.scales.get_value()
    new = fp8jax.take_new_state(old, jax.tree.leaves(state, is_leaf=_is_group)[0])
    first = new if isinstance(new, fp8jax.DotScaleState) else new.fc1
    for role in (first.x, first.grad):
        assert float(role.amax_history[0]) == 0.0
        assert float(role.scale) == 1.0


def _is_group(node):
    return isinstance(node, fp8jax.DotScaleState | fp8jax.MlpScaleState)

"""Linen <-> NNX parity: the same parameters give the same outputs, gradients and FP8 state."""

import flax.linen as nn
import flax_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fp8jax
from fp8jax.flax import TrainState, make_train_step
from fp8jax.flax import linen as fnn
from fp8jax.flax import nnx as fnnx

DELAYED = fp8jax.DelayedScaling(amax_history_len=4)

# name -> (Linen module, NNX constructor taking (hidden, dtype, rngs)); same config.
MODULES = {
    "LayerNorm": (
        lambda dt: fnn.LayerNorm(norm_type="rmsnorm", dtype=dt),
        lambda h, dt, rngs: fnnx.LayerNorm(h, norm_type="rmsnorm", dtype=dt, rngs=rngs),
    ),
    "DenseGeneral": (
        lambda dt: fnn.DenseGeneral((4, 8), dtype=dt, recipe=DELAYED),
        lambda h, dt, rngs: fnnx.DenseGeneral(h, (4, 8), dtype=dt, recipe=DELAYED, rngs=rngs),
    ),
    "LayerNormDenseGeneral": (
        lambda dt: fnn.LayerNormDenseGeneral(48, dtype=dt, zero_centered_gamma=True),
        lambda h, dt, rngs: fnnx.LayerNormDenseGeneral(
            h, 48, dtype=dt, zero_centered_gamma=True, rngs=rngs
        ),
    ),
    "LayerNormMLP": (
        lambda dt: fnn.LayerNormMLP(64, activations=("silu", "linear"), dtype=dt),
        lambda h, dt, rngs: fnnx.LayerNormMLP(
            h, 64, activations=("silu", "linear"), dtype=dt, rngs=rngs
        ),
    ),
    "MultiHeadAttention": (
        lambda dt: fnn.MultiHeadAttention(4, num_kv_heads=2, causal=True, use_rope=True, dtype=dt),
        lambda h, dt, rngs: fnnx.MultiHeadAttention(
            4, h, num_kv_heads=2, causal=True, use_rope=True, dtype=dt, rngs=rngs
        ),
    ),
    "TransformerLayer": (
        lambda dt: fnn.TransformerLayer(4, 64, norm_position="post", dtype=dt, recipe=DELAYED),
        lambda h, dt, rngs: fnnx.TransformerLayer(
            4, h, 64, norm_position="post", dtype=dt, recipe=DELAYED, rngs=rngs
        ),
    ),
}


def nnx_from_linen(make_nnx, variables):
    """The NNX module built abstractly, then filled with the Linen variables."""
    abstract = nnx.eval_shape(lambda: make_nnx(rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    pure = ref.linen_to_nnx_dict(variables)
    assert jax.tree.structure(nnx.to_pure_dict(state)) == jax.tree.structure(pure)
    nnx.replace_by_pure_dict(state, pure)
    return graphdef, state


@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 8, 32), (1, 16, 64)], ids=["h32", "h64"])
def test_same_params_same_outputs(name, dtype, shape):
    make_linen, make_nnx = MODULES[name]
    x = jax.random.normal(jax.random.key(0), shape)
    layer = make_linen(dtype)
    variables = ref.init(layer, x)
    graphdef, state = nnx_from_linen(lambda rngs: make_nnx(shape[-1], dtype, rngs), variables)
    want = jax.jit(layer.apply)(variables, x)
    got = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))(state, x)
    assert got.dtype == want.dtype == dtype
    # The same ops on the same values in the same order.
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_one_train_step_agrees():
    x = jax.random.normal(jax.random.key(0), (4, 8, 32))
    y = jnp.roll(x, 1, axis=1)
    layer = fnn.TransformerLayer(4, 64, causal=True, use_rope=True, recipe=DELAYED)
    variables = ref.init(layer, x)
    tx = optax.sgd(0.1)

    def loss_fn(variables, batch):
        return jnp.mean(jnp.square(layer.apply(variables, batch[0]) - batch[1]))

    state, linen_loss = jax.jit(make_train_step(loss_fn, tx))(
        TrainState.create(variables, tx), (x, y)
    )

    graphdef, nnx_state = nnx_from_linen(
        lambda rngs: fnnx.TransformerLayer(
            4, 32, 64, causal=True, use_rope=True, recipe=DELAYED, rngs=rngs
        ),
        variables,
    )
    model = nnx.merge(graphdef, nnx_state)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = nnx.jit(fnnx.train_step, static_argnames=("loss_fn",))
    nnx_loss = step(model, optimizer, lambda m, b: jnp.mean(jnp.square(m(b[0]) - b[1])), (x, y))
    np.testing.assert_allclose(nnx_loss, linen_loss, rtol=1e-6)
    want = ref.linen_to_nnx_dict({"params": state.params, "fp8_state": state.fp8_state})
    got = nnx.to_pure_dict(nnx.state(model))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
    assert float(model.attention.qkv.scales.get_value().x.scale) != 1.0


def test_nnx_dropout_uses_and_advances_its_rng_stream():
    layer = fnnx.MultiHeadAttention(4, 32, dropout_rate=0.5, rngs=nnx.Rngs(0, dropout=1))
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    # Called under nnx.jit, which writes the RNG stream's count back after each call as an
    # eager call does (eagerly, each step of the layer compiled on its own: 86 compiles).
    call = nnx.jit(lambda layer, x: layer(x))
    first, second = call(layer, x), call(layer, x)
    assert not np.allclose(first, second)  # a fresh dropout key per call
    layer.eval()
    np.testing.assert_array_equal(call(layer, x), call(layer, x))
    deterministic = nnx.jit(lambda layer, x: layer(x, deterministic=True))
    np.testing.assert_array_equal(deterministic(layer, x), call(layer, x))
    layer.train()
    optimizer = nnx.Optimizer(layer, optax.sgd(0.1), wrt=nnx.Param)

    def count():
        return [int(c) for c in jax.tree.leaves(nnx.state(layer, nnx.RngCount))]

    before = count()
    step = nnx.jit(fnnx.train_step, static_argnames=("loss_fn",))
    step(layer, optimizer, lambda m, b: jnp.mean(jnp.square(m(b))), x)
    assert count() != before  # the train step wrote the RNG counts back


def test_nnx_params_carry_the_linen_logical_names():
    layer = nnx.eval_shape(lambda: fnnx.TransformerLayer(4, 32, 64, rngs=nnx.Rngs(0)))
    linen = fnn.TransformerLayer(4, 64)
    want = nn.get_partition_spec(
        jax.eval_shape(linen.init, jax.random.key(0), jnp.ones((1, 4, 32)))
    )
    got = nnx.get_partition_spec(nnx.state(layer, nnx.Param))
    assert nnx.to_pure_dict(got) == want["params"]

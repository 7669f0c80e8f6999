"""fp8jax.flax.fp8_dot_general as a drop-in for Flax's own layers (Linen and NNX)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp8jax
from fp8jax.flax import Fp8DotGeneral, fp8_dot_general
from fp8jax.verify.jaxpr_dots import jaxpr_dots
from numerics import assert_within, current_scale, gemm_error_bound


def test_linen_dense_is_fp8_and_within_bound():
    x = jax.random.normal(jax.random.key(0), (16, 32))
    layer = nn.Dense(24, dot_general=fp8_dot_general)
    variables = layer.init(jax.random.key(1), x)
    # Jitted, one program each: eagerly every step compiled on its own.
    y = jax.jit(layer.apply)(variables, x)
    want = jax.jit(nn.Dense(24).apply)(variables, x)
    xs, ks = np.asarray(x, np.float64), np.asarray(variables["params"]["kernel"], np.float64)
    bound = gemm_error_bound(
        xs, ks, "e4m3", "e4m3", current_scale(xs, "e4m3"), current_scale(ks, "e4m3"),
        "mk,kn->mn", jnp.float32,
    )  # fmt: skip
    assert_within(y, want, bound, "nn.Dense(dot_general=fp8_dot_general)")

    def loss(v):
        return jnp.mean(jnp.square(layer.apply(v, x)))

    dots = jaxpr_dots(jax.grad(loss), variables)
    # Forward, dgrad and wgrad (the custom_vjp's backward computes both gradients).
    assert [d.is_fp8 for d in dots] == [True, True, True]


def test_linen_attention_projections_are_fp8():
    x = jnp.ones((2, 8, 32))
    attn = nn.MultiHeadDotProductAttention(
        num_heads=4, qkv_dot_general=fp8_dot_general, out_dot_general=fp8_dot_general
    )
    variables = jax.jit(attn.init)(jax.random.key(0), x)  # only traced below: values unused
    dots = jaxpr_dots(lambda v: attn.apply(v, x), variables)
    assert sum(d.is_fp8 for d in dots) == 4  # query, key, value, out; the core stays high


def test_nnx_linear_is_fp8():
    layer = nnx.Linear(32, 16, dot_general=fp8_dot_general, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (8, 32))
    plain = nnx.Linear(32, 16, rngs=nnx.Rngs(0))
    y = layer(x)
    assert float(jnp.linalg.norm(y - plain(x)) / jnp.linalg.norm(plain(x))) < 0.08
    dots = jaxpr_dots(
        lambda x: nnx.Linear(32, 16, dot_general=fp8_dot_general, rngs=nnx.Rngs(0))(x), x
    )
    assert any(d.is_fp8 for d in dots)


def test_exactly_representable_inputs_pass_through_and_out_sharding_is_refused():
    # All-ones inputs are exact in FP8 under any recipe: what the recipe changes is
    # tested in tests/flax/test_flax_dot_general_recipe.py.
    dot = Fp8DotGeneral(recipe=fp8jax.CurrentScaling(margin=1))
    x, w = jnp.ones((4, 8)), jnp.ones((8, 2))
    np.testing.assert_allclose(dot(x, w, (((1,), (0,)), ((), ()))), x @ w, rtol=1e-6)
    with pytest.raises(NotImplementedError, match="out_sharding"):
        dot(x, w, (((1,), (0,)), ((), ())), out_sharding=jax.sharding.PartitionSpec())

"""Fp8DotGeneral runs with the recipe it is given, and refuses out_sharding.

All-ones inputs quantize exactly under any recipe, so these inputs are chosen
where the recipe shows (tests/ops/test_formats_through_ops.py derives them):
an E4M3 subnormal that a margin rounds differently, a cotangent element that
only E4M3 holds.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.flax import Fp8DotGeneral
from fp8jax.verify.jaxpr_dots import jaxpr_dots

N = 16
DIMS = (((1,), (0,)), ((), ()))
# Kernel: identity, with amax 448 so its scale is 1 (row 0 of x never meets that entry).
W = jnp.eye(N, dtype=jnp.float32).at[N - 1, N - 1].set(448.0)


def test_the_margin_of_its_recipe_applies():
    # amax 448: margin 0 keeps 3 * 2**-9 exact; margin 1 rounds it to 2**-7.
    x = jnp.zeros((N, N), jnp.float32).at[0, :2].set(jnp.asarray([448.0, 3 * 2.0**-9]))
    y0 = np.asarray(Fp8DotGeneral()(x, W, DIMS))
    y1 = np.asarray(Fp8DotGeneral(recipe=fp8jax.CurrentScaling(margin=1))(x, W, DIMS))
    assert (y0[0, 1], y1[0, 1]) == (3 * 2.0**-9, 2.0**-7)


def test_the_formats_of_its_recipe_apply():
    x = jnp.zeros((N, N), jnp.float32).at[0, 0].set(1.0)
    g = jnp.zeros((N, N), jnp.float32).at[0, :2].set(jnp.asarray([448.0, 1.125]))
    dot = Fp8DotGeneral(recipe=fp8jax.CurrentScaling(formats=fp8jax.ALL_E4M3))
    _, vjp = jax.vjp(lambda x: dot(x, W, DIMS), x)
    # E5M2 would round 1.125 to 1.0 (HYBRID, the default).
    assert float(vjp(g)[0][0, 1]) == 1.125
    dots = jaxpr_dots(jax.grad(lambda x, w: dot(x, w, DIMS).sum(), argnums=(0, 1)), x, W)
    assert {f for d in dots for f in d.operand_formats} == {"float8_e4m3fn"}


def test_out_sharding_is_refused():
    x = jnp.ones((4, 8))
    with pytest.raises(NotImplementedError, match="out_sharding"):
        Fp8DotGeneral()(x, jnp.ones((8, 2)), DIMS, out_sharding=jax.sharding.PartitionSpec())

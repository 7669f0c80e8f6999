"""The output dtype of dot_general, dense and einsum follows JAX's (issue 56, item 6).

A float16 activation times a float32 kernel is float32 in ``lax.dot_general``
and ``jnp.einsum``; fp8jax's drop-ins returned float16 and overflowed to inf.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import fp8jax

DIMS = (((1,), (0,)), ((), ()))
PAIRS = [
    (jnp.float16, jnp.float32),
    (jnp.float32, jnp.float16),
    (jnp.bfloat16, jnp.float32),
    (jnp.bfloat16, jnp.float16),
    (jnp.float16, jnp.bfloat16),
    (jnp.bfloat16, jnp.bfloat16),
]


def _ops():
    return {
        "dot_general": (
            lambda x, w, **kw: fp8jax.dot_general(x, w, DIMS, **kw),
            lambda x, w: lax.dot_general(x, w, DIMS),
        ),
        "dense": (
            lambda x, w, **kw: fp8jax.dense(x, w, **kw),
            lambda x, w: lax.dot_general(x, w, DIMS),
        ),
        "einsum": (
            lambda x, w, **kw: fp8jax.einsum("td,df->tf", x, w, **kw),
            lambda x, w: jnp.einsum("td,df->tf", x, w),
        ),
    }


@pytest.mark.parametrize("op", ["dot_general", "dense", "einsum"])
@pytest.mark.parametrize(("x_dtype", "w_dtype"), PAIRS)
def test_output_dtype_is_jaxs(op, x_dtype, w_dtype):
    ours, theirs = _ops()[op]
    x, w = jnp.ones((4, 32), x_dtype), jnp.ones((32, 8), w_dtype)
    with jax.numpy_dtype_promotion("standard"):  # jnp.einsum's own rule, for the reference
        want = jax.eval_shape(theirs, x, w).dtype
    assert ours(x, w).dtype == want


@pytest.mark.parametrize("op", ["dot_general", "dense", "einsum"])
def test_float16_times_float32_does_not_overflow(op):
    # 200 * 0.5 * 4096 = 409600, past float16's 65504. Both operands are one
    # value, which current scaling maps to 448 exactly: the product is exact.
    ours, _ = _ops()[op]
    x = jnp.full((4, 4096), 200.0, jnp.float16)
    w = jnp.full((4096, 8), 0.5, jnp.float32)
    y = ours(x, w)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(y, np.full((4, 8), 409600.0, np.float32))
    dx, dw = jax.grad(lambda x, w: jnp.sum(ours(x, w)), argnums=(0, 1))(x, w)
    assert (dx.dtype, dw.dtype) == (jnp.float16, jnp.float32)


@pytest.mark.parametrize("op", ["dot_general", "dense", "einsum"])
@pytest.mark.parametrize("preferred", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_preferred_element_type_is_honoured(op, preferred):
    ours, _ = _ops()[op]
    x, w = jnp.ones((4, 32), jnp.float16), jnp.ones((32, 8), jnp.float32)
    assert ours(x, w, preferred_element_type=preferred).dtype == preferred


def test_modules_keep_computing_in_the_activations_dtype():
    # Flax's convention: float32 parameters, the output in the input's dtype.
    from flax import nnx

    from fp8jax.flax import nnx as fnnx

    layer = fnnx.DenseGeneral(32, 8, rngs=nnx.Rngs(0))
    assert layer(jnp.ones((4, 32), jnp.bfloat16)).dtype == jnp.bfloat16


@pytest.mark.parametrize("op", ["dot_general", "dense", "einsum"])
@pytest.mark.parametrize("magnitude", [1.0, 2.0**-6], ids=["unit", "small"])
def test_float16_operands_give_exact_float16_values(op, magnitude):
    # Current scaling maps one-valued operands to the format's maximum exactly,
    # so the products are exact. Unscaled, the GEMM's sums (448**2 * 32 forward,
    # 57344 * 448 * 8 for the input gradient) are beyond float16's 65504, and
    # for small operands the combined scale (2**-6 / 448)**2 is below its
    # smallest subnormal: a float16 GEMM gave inf, NaN and zeros.
    ours, _ = _ops()[op]
    x = jnp.full((4, 32), 0.25 * magnitude, jnp.float16)
    w = jnp.full((32, 8), 0.5 * magnitude, jnp.float16)
    y = ours(x, w)
    assert y.dtype == jnp.float16
    np.testing.assert_array_equal(y, np.full((4, 8), 4.0 * magnitude**2, np.float16))
    dx, dw = jax.grad(lambda x, w: jnp.sum(ours(x, w)), argnums=(0, 1))(x, w)
    np.testing.assert_array_equal(dx, np.full((4, 32), 4.0 * magnitude, np.float16))
    np.testing.assert_array_equal(dw, np.full((32, 8), 1.0 * magnitude, np.float16))


def test_float16_fused_ops_stay_finite():
    # The fused ops' GEMMs write x.dtype: float16 here (see the test above).
    x = jax.random.normal(jax.random.key(0), (4, 32), jnp.float16)
    gamma = jnp.ones((32,), jnp.float16)
    kernel = (0.1 * jax.random.normal(jax.random.key(1), (32, 8))).astype(jnp.float16)
    k1 = (0.1 * jax.random.normal(jax.random.key(2), (32, 2, 16))).astype(jnp.float16)
    k2 = (0.1 * jax.random.normal(jax.random.key(3), (16, 32))).astype(jnp.float16)

    def loss(x, kernel, k1, k2):
        y1 = fp8jax.layernorm_dense(x, gamma, None, kernel)
        y2 = fp8jax.layernorm_mlp(x, gamma, None, k1, k2)
        return jnp.sum(y1.astype(jnp.float32)) + jnp.sum(y2.astype(jnp.float32)), (y1, y2)

    grads, outputs = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, kernel, k1, k2)
    for value in (*outputs, *grads):
        assert value.dtype == jnp.float16
        assert bool(jnp.all(jnp.isfinite(value)))

"""fp8jax.layernorm: values and gradients against an f32 reference; errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax


def reference_norm(x, gamma, beta, norm_type, zero_centered_gamma, eps):
    """The textbook definitions in f64 numpy."""
    x = np.asarray(x, np.float64)
    g = np.asarray(gamma, np.float64) + (1.0 if zero_centered_gamma else 0.0)
    if norm_type == "layernorm":
        centred = x - x.mean(-1, keepdims=True)
        y = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + eps) * g
        return y + np.asarray(beta, np.float64)
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * g


CASES = [("layernorm", False), ("layernorm", True), ("rmsnorm", False), ("rmsnorm", True)]


@pytest.mark.parametrize(("norm_type", "zero_centered"), CASES)
def test_values_match_reference(norm_type, zero_centered):
    x = jax.random.normal(jax.random.key(0), (4, 8, 32)) * 3.0 + 1.0
    gamma = jax.random.normal(jax.random.key(1), (32,))
    beta = jax.random.normal(jax.random.key(2), (32,)) if norm_type == "layernorm" else None
    y = fp8jax.layernorm(x, gamma, beta, norm_type=norm_type, zero_centered_gamma=zero_centered)
    want = reference_norm(x, gamma, beta, norm_type, zero_centered, 1e-6)
    # f32 arithmetic throughout: a few ulps of 2**-24 per op on O(1) values.
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_bf16_output_dtype_and_precision():
    x = jax.random.normal(jax.random.key(0), (16, 64)).astype(jnp.bfloat16)
    y = fp8jax.layernorm(x, jnp.ones(64, jnp.bfloat16), jnp.zeros(64, jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    want = reference_norm(x, np.ones(64), np.zeros(64), "layernorm", False, 1e-6)
    # Computed in f32, rounded once to bf16: relative 2**-8.
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2.0**-8, atol=2.0**-8)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"norm_type": "batchnorm"},
            ValueError,
            r"norm_type must be one of \('layernorm', 'rmsnorm'\), got 'batchnorm'",
        ),
        ({"epsilon": 0.0}, ValueError, "epsilon must be a number > 0, got 0.0"),
        ({"epsilon": -1e-5}, ValueError, "epsilon must be a number > 0"),
        (
            {"gamma": jnp.ones(16)},
            ValueError,
            r"gamma must have shape \(32,\) to match x's hidden size, got \(16,\)",
        ),
        ({"beta": jnp.ones(8)}, ValueError, r"beta must have shape \(32,\)"),
        ({"norm_type": "rmsnorm", "beta": jnp.zeros(32)}, ValueError, "rmsnorm has no beta"),
        ({"x": jnp.ones((4, 32), jnp.int32)}, TypeError, "x must be a float32"),
    ],
)
def test_bad_input_is_explained(kwargs, error, message):
    args = {"x": jnp.ones((4, 32)), "gamma": jnp.ones(32), "beta": None}
    args.update({k: kwargs.pop(k) for k in list(kwargs) if k in args})
    with pytest.raises(error, match=message):
        fp8jax.layernorm(args["x"], args["gamma"], args["beta"], **kwargs)

"""fp8jax.flax.rotary.apply_rotary against the complex-number definition of RoPE."""

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.flax.rotary import apply_rotary


def test_matches_complex_rotation():
    x = jax.random.normal(jax.random.key(0), (2, 6, 3, 8))
    positions = jnp.array([[0, 1, 2, 3, 4, 5], [7, 3, 2, 9, 1, 0]])
    y = np.asarray(apply_rotary(x, positions, base=100.0), np.float64)
    xs = np.asarray(x, np.float64)
    half = 4
    freq = 100.0 ** (-np.arange(half) / half)
    angle = np.asarray(positions, np.float64)[:, :, None, None] * freq
    z = (xs[..., :half] + 1j * xs[..., half:]) * np.exp(1j * angle)
    want = np.concatenate([z.real, z.imag], axis=-1)
    # f32 sin/cos of angles up to 9 rad: a few f32 ulps.
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_scores_depend_on_relative_position_only():
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 16))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))

    def score(i, j):
        qi = apply_rotary(q, jnp.array([i]))
        kj = apply_rotary(k, jnp.array([j]))
        return float(jnp.sum(qi * kj))

    np.testing.assert_allclose(score(5, 2), score(13, 10), rtol=1e-5)
    assert abs(score(5, 2) - score(5, 4)) > 1e-3


def test_keeps_dtype():
    x = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    assert apply_rotary(x, jnp.arange(4)).dtype == jnp.bfloat16

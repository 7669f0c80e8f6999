"""fp8jax.flax.rotary.apply_rotary against the complex-number definition of RoPE."""

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.flax.rotary import apply_rotary


def _angles(positions, half, base):
    """Each (row, position, 1, pair)'s rotation angle, in f64."""
    freq = base ** (-np.arange(half) / half)
    return np.asarray(positions, np.float64)[:, :, None, None] * freq


def test_matches_complex_rotation():
    x = jax.random.normal(jax.random.key(0), (2, 6, 3, 8))
    positions = jnp.array([[0, 1, 2, 3, 4, 5], [7, 3, 2, 9, 1, 0]])
    y = np.asarray(apply_rotary(x, positions, base=100.0), np.float64)
    xs = np.asarray(x, np.float64)
    half = 4
    z = (xs[..., :half] + 1j * xs[..., half:]) * np.exp(1j * _angles(positions, half, 100.0))
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


def test_gradient_is_the_rotation_by_the_negative_angle():
    # The VJP of a rotation is the rotation back: the cotangent of x is g
    # rotated by -angle, computed here in f64 with complex numbers.
    x = jax.random.normal(jax.random.key(0), (2, 5, 3, 8))
    g = jax.random.normal(jax.random.key(1), x.shape)
    positions = jnp.array([[0, 1, 2, 3, 4], [9, 3, 2, 7, 1]])
    _, vjp = jax.vjp(lambda x: apply_rotary(x, positions, base=100.0), x)
    (dx,) = vjp(g)
    gs = np.asarray(g, np.float64)
    z = (gs[..., :4] + 1j * gs[..., 4:]) * np.exp(-1j * _angles(positions, 4, 100.0))
    want = np.concatenate([z.real, z.imag], axis=-1)
    # f32 sin/cos of angles up to 9 rad and two f32 products summed: a few ulps.
    np.testing.assert_allclose(np.asarray(dx, np.float64), want, rtol=1e-5, atol=1e-5)


def test_gradient_equals_autodiff_bitwise():
    # The custom backward does autodiff's arithmetic (the same products, added
    # in the same pairs), so the bf16 cotangent is bit for bit autodiff's.
    from fp8jax.flax.rotary import _rotate

    x = jax.random.normal(jax.random.key(2), (2, 16, 4, 64), jnp.bfloat16)
    g = jax.random.normal(jax.random.key(3), x.shape, jnp.bfloat16)
    positions = jnp.arange(16)
    angle = positions.astype(jnp.float32)[None, :, None, None] * (
        10000.0 ** (-jnp.arange(32, dtype=jnp.float32) / 32)[None, None, None, :]
    )
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    ours = jax.vjp(lambda x: apply_rotary(x, positions), x)[1](g)[0]
    autodiff = jax.vjp(lambda x: _rotate(x, sin, cos), x)[1](g)[0]
    assert ours.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(autodiff, np.float32))


def test_backward_has_no_padded_halves():
    # Autodiff transposes the halves' slices into pads added together; the
    # rotation back writes each half once (docs/design.md#the-rope-backward-as-a-rotation).
    from fp8jax.flax.rotary import _rotate

    x = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    sin = cos = jnp.ones((1, 4, 1, 4), jnp.float32)

    def vjp_text(f):
        return str(jax.make_jaxpr(lambda x, g: jax.vjp(f, x)[1](g))(x, x))

    assert " pad[" in vjp_text(lambda x: _rotate(x, sin, cos))
    assert " pad[" not in vjp_text(lambda x: apply_rotary(x, jnp.arange(4)))

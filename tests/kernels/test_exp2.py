"""exp2 as a cubic on the FP32 pipes (fp8jax.kernels.exp2) against float64's exp2."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8jax.kernels import exp2

cubic = jax.jit(exp2.exp2_cubic)


def _relative_error(x):
    x = np.asarray(x, np.float32)
    got = np.asarray(cubic(x), np.float64)
    return np.abs(got / np.exp2(x.astype(np.float64)) - 1)


def test_the_cubic_is_within_its_stated_error_over_its_whole_range():
    """CUBIC_ERROR is the fit's error plus f32 rounding, measured on every 2**-13 step of
    [-125, 127]: each step lands at a new point of the fit's interval [-0.5, 0.5]."""
    err = _relative_error(np.arange(-125 * 2**13, 127 * 2**13 + 1) / 2**13)
    assert err.max() <= exp2.CUBIC_ERROR, err.max()
    # The bound is tight, not loose: a looser fit (or one rounding lost) would show.
    assert err.max() > 0.95 * exp2.CUBIC_ERROR, err.max()


@settings(max_examples=300, deadline=None)
@given(st.floats(-125, 127, width=32))
def test_the_cubic_is_within_its_stated_error_anywhere(x):
    assert _relative_error([x]).max() <= exp2.CUBIC_ERROR


def test_integers_give_powers_of_two_exactly():
    """The constant term is 1: P's largest score, exp2(8) = P_SCALE, stays exact."""
    n = np.arange(-125, 128)
    np.testing.assert_array_equal(np.asarray(cubic(n.astype(np.float32))), 2.0**n)


def test_the_rounding_is_not_folded_away():
    """x + MAGIC rounds to an integer only if nothing simplifies (x + c) - c to x: at
    half-integers the fraction is +-0.5, not 0 (2**93.5 is not 2**94)."""
    x = np.array([93.5, -30.5, 7.25, -7.75], np.float32)
    np.testing.assert_allclose(cubic(x), np.exp2(x.astype(np.float64)), rtol=exp2.CUBIC_ERROR)


def test_far_below_the_floor_and_minus_infinity_give_a_tiny_value_that_e4m3_flushes():
    """Masked scores (-inf) and scores 125 below the row's max: about 2**-125, finite,
    not NaN, and 0 in E4M3 however P_SCALE scales it."""
    got = np.asarray(cubic(jnp.array([-jnp.inf, -1e30, -200.0, -125.0], jnp.float32)))
    assert np.all(np.isfinite(got)) and np.all(got > 0), got
    np.testing.assert_allclose(got, 2.0**-125, rtol=exp2.CUBIC_ERROR)
    assert np.all((got * 256.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) == 0)


def test_split_exp2_takes_the_cubic_for_the_last_columns_only():
    x = jax.random.uniform(jax.random.key(0), (4, 3, 128), jnp.float32, -20, 8)
    split_exp2 = jax.jit(exp2.split_exp2, static_argnums=1)
    for fma in (0, 8, 48, 128):
        got = np.asarray(split_exp2(x, fma))
        split = 128 - fma
        np.testing.assert_array_equal(got[..., :split], np.asarray(jnp.exp2(x[..., :split])))
        np.testing.assert_array_equal(got[..., split:], np.asarray(cubic(x[..., split:])))

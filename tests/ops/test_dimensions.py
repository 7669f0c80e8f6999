"""The dgrad/wgrad dimension numbers reproduce JAX's own transpose of dot_general."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from fp8jax.ops import dimensions

CASES = [
    # (lhs shape, rhs shape, dimension numbers)
    ((8, 16), (16, 4), (((1,), (0,)), ((), ()))),
    ((2, 8, 16), (16, 4), (((2,), (0,)), ((), ()))),
    ((8, 16), (4, 16), (((1,), (1,)), ((), ()))),
    ((16, 8), (16, 4), (((0,), (0,)), ((), ()))),
    ((3, 8, 16), (3, 16, 4), (((2,), (1,)), ((0,), (0,)))),
    ((8, 3, 16), (16, 4, 3), (((2,), (0,)), ((1,), (2,)))),
    ((2, 8, 4, 5), (5, 4, 6), (((2, 3), (1, 0)), ((), ()))),
    ((2, 8, 4, 5), (4, 6, 5), (((3, 2), (2, 0)), ((), ()))),
    ((4, 2, 8, 5), (5, 4, 7, 2), (((3,), (0,)), ((0, 1), (1, 3)))),
]


def _via(lhs_or_rhs, a, b, transposed):
    y = lax.dot_general(a, b, transposed.dimension_numbers)
    return y if transposed.permutation is None else jnp.transpose(y, transposed.permutation)


@pytest.mark.parametrize(("lhs_shape", "rhs_shape", "dims"), CASES)
def test_transposes_match_jax_vjp(lhs_shape, rhs_shape, dims):
    kl, kr, kg = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(kl, lhs_shape)
    rhs = jax.random.normal(kr, rhs_shape)
    y, vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, dims), lhs, rhs)
    g = jax.random.normal(kg, y.shape)
    want_lhs, want_rhs = vjp(g)
    norm = dimensions.normalize(dims, lhs_shape, rhs_shape)
    got_lhs = _via("lhs", g, rhs, dimensions.dgrad(norm, len(lhs_shape), len(rhs_shape)))
    got_rhs = _via("rhs", lhs, g, dimensions.wgrad(norm, len(lhs_shape), len(rhs_shape)))
    np.testing.assert_allclose(got_lhs, want_lhs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_rhs, want_rhs, rtol=1e-5, atol=1e-5)


def test_negative_axes_are_normalized():
    assert dimensions.normalize((((-1,), (0,)), ((), ())), (2, 3), (3, 4)) == (
        ((1,), (0,)),
        ((), ()),
    )


def test_numpy_integer_axes_are_taken_as_lax_takes_them():
    # Axes computed with NumPy were refused as "not a sequence of ints".
    dims = (((np.int64(-1),), (np.int32(0),)), ((), ()))
    normalized = dimensions.normalize(dims, (2, 3), (3, 4))
    assert normalized == (((1,), (0,)), ((), ()))
    assert all(type(a) is int for group in normalized for axes in group for a in axes)


@pytest.mark.parametrize(
    ("dims", "message"),
    [
        ("bad", r"dimension_numbers must be \(\(lhs_contracting, rhs_contracting\)"),
        (
            (((2,), (0,)), ((), ())),
            "lhs contracting dims has axis 2, out of range for an operand of rank 2",
        ),
        (
            (((1,), (1,)), ((), ())),
            "contracting dims must match in size: lhs axis 1 has 3 but rhs axis 1 has 4",
        ),
        ((((1, 1), (0, 1)), ((), ())), r"lhs contracting dims repeats an axis: \(1, 1\)"),
        ((((1,), (0, 1)), ((), ())), "same number of contracting dims"),
        ((((), ()), ((), ())), "contracts no axis"),
        ((((1.0,), (0,)), ((), ())), "must be a sequence of ints"),
        ((((True,), (0,)), ((), ())), "must be a sequence of ints"),
        ((((np.bool_(True),), (0,)), ((), ())), "must be a sequence of ints"),
    ],
)
def test_bad_dimension_numbers_are_explained(dims, message):
    with pytest.raises((TypeError, ValueError), match=message):
        dimensions.normalize(dims, (2, 3), (3, 4))

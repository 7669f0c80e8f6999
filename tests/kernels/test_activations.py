"""The activation registry: one entry per activation, used by every path and name check."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import activations
from fp8jax.flax import _common
from fp8jax.kernels import activation_cast


def test_every_path_reads_the_registry():
    assert set(activations.REGISTRY) == activation_cast.KERNEL_ACTIVATIONS
    pre = jnp.linspace(-2, 2, 2 * 8, dtype=jnp.float32).reshape(2, 8)
    for name, entry in activations.REGISTRY.items():
        want = entry.xla(pre[0]) * entry.xla(pre[1])
        np.testing.assert_array_equal(activations.gated(pre, (name, name)), want)


def test_the_kernel_formula_is_the_derivative_of_xlas():
    # Two formulas of one function: on |x| <= 3, where neither cancels, their
    # values and slopes agree to 2**-19 relative to max(|value|, 1): a few f32
    # roundings of each (gelu: erf against erfc, two polynomials ~1 ulp each).
    x = jnp.linspace(-3, 3, 2049, dtype=jnp.float32)
    for entry in activations.REGISTRY.values():
        value, vjp = jax.vjp(entry.xla, x)
        (slope,) = vjp(jnp.ones_like(x))
        kernel_value, kernel_slope = entry.value_and_slope(x, activations.XlaMath)
        for got, want in ((kernel_value, value), (kernel_slope, slope)):
            want = np.asarray(want, np.float64)
            bound = 2.0**-19 * np.maximum(np.abs(want), 1)
            np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - want), bound)


def test_the_kernels_serve_what_measured_faster_there():
    assert not activations.kernel_serves(("gelu", "linear"))
    assert activations.kernel_serves(("silu", "linear"))
    assert activations.kernel_serves(("gelu_tanh",))


@pytest.mark.parametrize("bad", [("gelu", "swish"), (), ("relu",) * 3, "tanh"])
def test_one_check_names_the_owner_and_the_given_value(bad):
    with pytest.raises(ValueError, match=r"LayerNormMLP: activations must be one or two names"):
        _common.activations("LayerNormMLP", bad)
    with pytest.raises(ValueError, match=r"^activations must be one or two names from \['gelu'"):
        activations.check(bad)
    assert activations.check("relu") == ("relu",)

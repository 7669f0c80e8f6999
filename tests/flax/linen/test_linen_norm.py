"""fp8jax.flax.linen.LayerNorm against flax.linen.LayerNorm / RMSNorm."""

import flax_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.flax import linen as fnn


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_matches_flax_norm(norm_type, zero_centered_gamma):
    x = jax.random.normal(jax.random.key(0), (2, 8, 32)) * 2.0 + 0.5
    layer = fnn.LayerNorm(norm_type=norm_type, zero_centered_gamma=zero_centered_gamma)
    params = ref.init_params(layer, x)
    y = ref.apply(layer, {"params": params}, x)
    want = ref.norm(x, params["scale"], params.get("bias"), norm_type, zero_centered_gamma)
    # No FP8 here: both are f32 normalizations; flax computes the variance as
    # E[x^2] - E[x]^2, so allow a few f32 ulps times the O(1) values.
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_params_and_dtype():
    x = jnp.ones((4, 16), jnp.float32)
    layer = fnn.LayerNorm(dtype=jnp.bfloat16, zero_centered_gamma=True)
    variables = ref.init(layer, x)
    params = variables["params"]
    assert set(params) == {"scale", "bias"}
    assert params["scale"].names == ("embed",)
    assert float(jnp.abs(params["scale"].value).max()) == 0.0  # zero-centred: starts at 0
    assert ref.apply(layer, variables, x).dtype == jnp.bfloat16
    assert set(ref.init(fnn.LayerNorm(norm_type="rmsnorm"), x)["params"]) == {"scale"}

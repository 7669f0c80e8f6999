"""fp8jax.flax.linen.LayerNormMLP against a Flax LayerNorm -> DenseGeneral -> act -> Dense."""

import flax.linen as nn
import flax_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.flax import linen as fnn


@pytest.mark.parametrize(
    ("activations", "norm_type"),
    [(("gelu", "linear"), "layernorm"), (("silu", "linear"), "rmsnorm"), (("relu",), "layernorm")],
)
def test_matches_flax_mlp(activations, norm_type):
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    layer = fnn.LayerNormMLP(64, activations=activations, norm_type=norm_type)
    params = ref.init_params(layer, x)
    y = ref.apply(layer, {"params": params}, x)
    want = ref.run(ref.mlp, params, x, activations=activations, norm_type=norm_type)
    # Two GEMMs, four E4M3-quantized operands (x, kernel_1, activation, kernel_2).
    assert ref.relative_error(y, want) < ref.fp8_budget(4)


def test_layernorm_output_and_state_group():
    recipe = fp8jax.DelayedScaling(amax_history_len=4)
    layer = fnn.LayerNormMLP(64, return_layernorm_output=True, recipe=recipe)
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    variables = ref.init(layer, x)
    assert isinstance(variables["fp8_state"]["scales"], fp8jax.MlpScaleState)
    y, normed = ref.apply(layer, variables, x)
    params = nn.unbox(variables)["params"]
    want = ref.norm(x, params["scale"], params["ln_bias"])
    np.testing.assert_allclose(normed, want, rtol=1e-5, atol=1e-5)
    assert y.shape == x.shape
    specs = nn.get_partition_spec(variables)["params"]
    assert specs["kernel_1"] == jax.sharding.PartitionSpec("embed", "act", "mlp")
    assert specs["kernel_2"] == jax.sharding.PartitionSpec("mlp", "embed")


def test_bf16_compute_keeps_f32_params():
    layer = fnn.LayerNormMLP(64, dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    variables = ref.init(layer, x)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(nn.unbox(variables)))
    y = ref.apply(layer, variables, x)
    assert y.dtype == jnp.bfloat16
    want = ref.run(ref.mlp, nn.unbox(variables)["params"], x)
    # Plus bf16 rounding (u = 2**-8) of the activations and output: negligible
    # next to E4M3's 2**-4, so the same four-operand budget applies.
    assert ref.relative_error(y, want) < ref.fp8_budget(4)

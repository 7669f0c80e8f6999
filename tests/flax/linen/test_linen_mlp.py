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


@pytest.mark.parametrize(
    "recipe",
    [fp8jax.CurrentScaling(), fp8jax.DelayedScaling(amax_history_len=4, margin=1)],
    ids=["current", "delayed"],
)
def test_values_gradients_and_state_match_fake_quant_reference(recipe):
    import references as fq  # tests/references.py: ml_dtypes casts, no fp8jax code

    activations = ("gelu", "linear")
    x = jax.random.normal(jax.random.key(0), (2, 64, 128))
    c = jax.random.normal(jax.random.key(1), (2, 64, 128))
    layer = fnn.LayerNormMLP(128, activations=activations, recipe=recipe)
    params = ref.init_params(layer, x)
    p = {k: params[k] for k in ("scale", "ln_bias", "kernel_1", "kernel_2", "bias_1", "bias_2")}
    args = (x, p["scale"], p["ln_bias"], p["kernel_1"], p["kernel_2"], p["bias_1"], p["bias_2"])
    state = None
    if isinstance(recipe, fp8jax.DelayedScaling):
        probe = fq.CurrentRef()
        fq.layernorm_mlp(*args, c, probe, activations=activations)
        init = nn.unbox(ref.init(layer, x))["fp8_state"]["scales"]
        state = fq.delayed_state(recipe, init, probe.amaxes)
    rec = fq.reference_recipe(recipe, state)
    want_y, want, _ = fq.layernorm_mlp(*args, c, rec, activations=activations)

    y, (d_params, new_state, dx) = ref.linen_vjp(layer, params, state, x, c)
    got = {"y": y, "x": dx, "gamma": d_params["scale"], "beta": d_params["ln_bias"]}
    got |= {k: d_params[k] for k in ("kernel_1", "kernel_2", "bias_1", "bias_2")}
    # As tests/ops/test_recipe_references.py derives it: f32 roundoff and the
    # rare FP8 rounding it moves, one step (2**-3 of an element) in one of
    # 128 x 128 elements, 2**-10 normwise each; 2**-8 allows a few. An E5M2
    # operand in an E4M3 role errs by about 2**-3.8.
    for name, value in {**want, "y": want_y}.items():
        assert fq.relative_error(got[name], value) < 2.0**-8, name
    if state is not None:
        # Amaxes: one element each, exact or within f32 roundoff of the
        # reference's (2**-20); 2**-16 relative.
        fq.assert_state(new_state, rec.next_state(), 2.0**-16, "LayerNormMLP")

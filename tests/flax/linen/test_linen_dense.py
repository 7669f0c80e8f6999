"""fp8jax.flax.linen.DenseGeneral / LayerNormDenseGeneral against Flax's layers."""

import flax.linen as nn
import flax_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.flax import linen as fnn
from numerics import assert_within, current_scale, gemm_error_bound


@pytest.mark.parametrize(
    ("axis", "features", "contract"),
    [(-1, 24, "abk,kn->abn"), ((1, 2), (3, 8), "ajk,jkmn->amn")],
)
def test_dense_general_matches_flax_within_fp8_bound(axis, features, contract):
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    layer = fnn.DenseGeneral(features, axis=axis)
    flax_layer = nn.DenseGeneral(features, axis=axis)
    params = ref.init_params(layer, x)
    y = ref.apply(layer, {"params": params}, x)
    want = flax_layer.apply({"params": params}, x)
    assert y.shape == want.shape
    xs, ks = np.asarray(x, np.float64), np.asarray(params["kernel"], np.float64)
    # Elementwise FP8 bound of the GEMM (tests/numerics.py), E4M3 x E4M3 at
    # current scales, plus one f32 rounding of the bias add.
    bound = gemm_error_bound(
        xs, ks, "e4m3", "e4m3", current_scale(xs, "e4m3"), current_scale(ks, "e4m3"),
        contract, jnp.float32,
    )  # fmt: skip
    bound = bound + 2.0**-23 * np.abs(np.asarray(want, np.float64))
    assert_within(y, want, bound, "DenseGeneral forward")


def test_dense_general_gradients_close_to_flax():
    x = jax.random.normal(jax.random.key(0), (4, 8, 32))
    layer, flax_layer = fnn.DenseGeneral(16), nn.DenseGeneral(16)
    params = ref.init_params(layer, x)
    r = jax.random.normal(jax.random.key(3), (4, 8, 16))

    def loss(module):
        return lambda p, x: jnp.sum(module.apply({"params": p}, x) * r)

    got = jax.jit(jax.grad(loss(layer), argnums=(0, 1)))(params, x)
    want = jax.jit(jax.grad(loss(flax_layer), argnums=(0, 1)))(params, x)
    # dgrad and wgrad each quantize two operands (E5M2 gradient, E4M3 other);
    # E5M2's u = 2**-3 gives its rounding four times E4M3's variance: budget for 5.
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert ref.relative_error(g, w) < ref.fp8_budget(5)


def test_dense_general_custom_dot_general_is_flax_exactly():
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    layer = fnn.DenseGeneral(16, dot_general=jax.lax.dot_general)
    variables = nn.unbox(ref.init(layer, x))
    want = nn.DenseGeneral(16).apply(variables, x)
    np.testing.assert_allclose(ref.apply(layer, variables, x), want, rtol=1e-6, atol=1e-6)


def test_dense_general_logical_axes_and_delayed_state():
    recipe = fp8jax.DelayedScaling(amax_history_len=8)
    layer = fnn.DenseGeneral((4, 8), kernel_axes=("embed", "heads", "kv"), recipe=recipe)
    variables = ref.init(layer, jnp.ones((2, 32)))
    assert nn.get_partition_spec(variables)["params"]["kernel"] == jax.sharding.PartitionSpec(
        "embed", "heads", "kv"
    )
    state = variables["fp8_state"]["scales"]
    assert isinstance(state, fp8jax.DotScaleState)
    assert state.x.amax_history.shape == (8,)
    assert "fp8_state" not in ref.init(fnn.DenseGeneral(4), jnp.ones((2, 32)))


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_layernorm_dense_matches_flax_within_fp8_bound(norm_type):
    x = jax.random.normal(jax.random.key(0), (2, 8, 32)) * 3.0
    layer = fnn.LayerNormDenseGeneral((2, 12), norm_type=norm_type, return_layernorm_output=True)
    params = ref.init_params(layer, x)
    y, normed = ref.apply(layer, {"params": params}, x)
    h = ref.norm(x, params["scale"], params.get("ln_bias"), norm_type)
    np.testing.assert_allclose(normed, h, rtol=1e-5, atol=1e-5)
    want = ref.dense(h, params["kernel"], params["bias"])
    hs, ks = np.asarray(h, np.float64), np.asarray(params["kernel"], np.float64)
    contract = "abk,kmn->abmn"
    bound = gemm_error_bound(
        hs, ks, "e4m3", "e4m3", current_scale(hs, "e4m3"), current_scale(ks, "e4m3"),
        contract, jnp.float32,
    )  # fmt: skip
    # The op normalizes in its own f32 order: 1e-5 relative slack on the input.
    bound = bound + 1e-5 * np.einsum(contract, np.abs(hs), np.abs(ks))
    bound = bound + 2.0**-23 * np.abs(np.asarray(want, np.float64))
    assert_within(y, want, bound, "LayerNormDenseGeneral forward")
    assert set(params) == {"scale", "kernel", "bias"} | (
        {"ln_bias"} if norm_type == "layernorm" else set()
    )


@pytest.mark.parametrize(
    "recipe",
    [fp8jax.CurrentScaling(margin=1), fp8jax.DelayedScaling(amax_history_len=4, margin=1)],
    ids=["current", "delayed"],
)
def test_dense_general_matches_fake_quant_reference_with_its_state(recipe):
    import references as fq  # tests/references.py: ml_dtypes casts, no fp8jax code

    x = jax.random.normal(jax.random.key(0), (4, 16, 64))
    c = jax.random.normal(jax.random.key(1), (4, 16, 24))
    layer = fnn.DenseGeneral(24, recipe=recipe)
    params = ref.init_params(layer, x)
    dims = (((2,), (0,)), ((), ()))
    state = None
    if isinstance(recipe, fp8jax.DelayedScaling):
        probe = fq.CurrentRef()
        fq.dot_general(x, params["kernel"], dims, c, probe)
        init = nn.unbox(ref.init(layer, x))["fp8_state"]["scales"]
        state = fq.delayed_state(recipe, init, probe.amaxes)
    rec = fq.reference_recipe(recipe, state)
    (want_y, want_dx, want_dk), mags = fq.dot_general(x, params["kernel"], dims, c, rec,
                                                       magnitudes=True)  # fmt: skip
    want_y = want_y + np.asarray(params["bias"], np.float64)

    y, (d_params, new_state, dx) = ref.linen_vjp(layer, params, state, x, c)
    # Elementwise, the GEMMs' f32 roundoff against the fake-quant reference
    # (tests/references.py: (2 K + 8) 2**-24 of the magnitude sums), plus
    # the bias add's one f32 rounding.
    y_slack = fq.gemm_slack(mags[0], 64) + 2.0**-24 * np.abs(want_y)
    fq.assert_close(y, want_y, y_slack, "forward")
    fq.assert_close(dx, want_dx, fq.gemm_slack(mags[1], 24), "dgrad")
    fq.assert_close(d_params["kernel"], want_dk, fq.gemm_slack(mags[2], 64), "wgrad")
    if state is not None:
        # Each amax is one element of an input or cotangent, exactly.
        fq.assert_state(new_state, rec.next_state(), 2.0**-20, "DenseGeneral")

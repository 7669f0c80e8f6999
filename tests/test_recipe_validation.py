"""Every recipe field is validated when the recipe is made (issue 32, item 6).

A margin of inf made every scale 0 and every output NaN; such settings now
fail at construction, naming the field, the expected and the given value.
"""

import math

import pytest

import fp8jax

RECIPES = [fp8jax.CurrentScaling, fp8jax.DelayedScaling]


@pytest.mark.parametrize("cls", RECIPES)
@pytest.mark.parametrize("margin", [math.inf, -math.inf, math.nan, 33, 1e6])
def test_non_finite_or_huge_margin_is_rejected(cls, margin):
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.margin must be"):
        cls(margin=margin)


@pytest.mark.parametrize("cls", RECIPES)
@pytest.mark.parametrize("margin", ["1", True, None, 1 + 0j])
def test_margin_of_wrong_type_is_a_type_error(cls, margin):
    with pytest.raises(TypeError, match=rf"{cls.__name__}\.margin must be a real number"):
        cls(margin=margin)


@pytest.mark.parametrize("cls", RECIPES)
@pytest.mark.parametrize("margin", [0, 0.5, 2, 32])
def test_margins_in_range_are_accepted_and_give_finite_output(cls, margin):
    import jax.numpy as jnp

    recipe = cls(margin=margin)
    x = jnp.linspace(-3.0, 3.0, 64, dtype=jnp.float32).reshape(4, 16)
    w = jnp.ones((16, 8), jnp.float32)
    state = fp8jax.init_state(recipe)
    y = fp8jax.dense(x, w, recipe=recipe, state=state)
    assert bool(jnp.all(jnp.isfinite(y)))


@pytest.mark.parametrize("cls", RECIPES)
@pytest.mark.parametrize(
    ("axes", "error"), [(("dp", "dp"), ValueError), (("",), TypeError), (["dp"], TypeError)]
)
def test_reduction_axes_are_checked(cls, axes, error):
    with pytest.raises(error, match="amax_reduction_axes"):
        cls(amax_reduction_axes=axes)


@pytest.mark.parametrize("algo", [["max"], None, 1])
def test_amax_compute_algo_of_wrong_type_is_rejected(algo):
    with pytest.raises(ValueError, match="amax_compute_algo must be one of"):
        fp8jax.DelayedScaling(amax_compute_algo=algo)


@pytest.mark.parametrize("length", [True, -3, 1.0, "4", None])
def test_history_length_must_be_a_positive_int(length):
    with pytest.raises(ValueError, match="amax_history_len must be an int >= 1"):
        fp8jax.DelayedScaling(amax_history_len=length)


@pytest.mark.parametrize("scale", [0.0, -1.0, math.inf, math.nan])
def test_quantize_rejects_a_concrete_scale_that_is_not_finite_and_positive(scale):
    import jax.numpy as jnp

    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        fp8jax.quantize(jnp.ones((4,)), fp8jax.E4M3, jnp.float32(scale))


# Finite and positive as Python floats, but not as the f32 the cast multiplies
# by, or with a reciprocal (scale_inv) that is not a normal f32: 1e39 is inf in
# f32, 1e38's reciprocal is subnormal (flushed to 0), 1e-40 is subnormal and
# its reciprocal inf. Each made the dequantized values NaN or 0.
@pytest.mark.parametrize("scale", [1e39, 1e38, 1e-40, 1e-50, True])
def test_quantize_rejects_a_scale_that_is_no_normal_f32_both_ways(scale):
    import jax.numpy as jnp

    with pytest.raises(ValueError, match="scale must be a finite number > 0, from 2.*-126"):
        fp8jax.quantize(jnp.ones((4,)), fp8jax.E4M3, scale)


@pytest.mark.parametrize("scale", [2.0**-126, 2.0**126])
def test_quantize_takes_the_extreme_normal_scales(scale):
    import jax.numpy as jnp

    q, _ = fp8jax.quantize(jnp.zeros((4,)), fp8jax.E4M3, scale)
    assert fp8jax.dequantize(q).tolist() == [0.0] * 4


@pytest.mark.parametrize("margin", [math.inf, -1, 40])
def test_quantize_rejects_a_margin_out_of_range(margin):
    import jax.numpy as jnp

    with pytest.raises(ValueError, match="quantize.margin must be"):
        fp8jax.quantize(jnp.ones((4,)), fp8jax.E4M3, margin=margin)


def test_quantize_takes_a_traced_scale():
    import jax
    import jax.numpy as jnp

    q = jax.jit(lambda s: fp8jax.quantize(jnp.ones((4,)), fp8jax.E4M3, s)[0].data)(2.0)
    assert q.astype(jnp.float32).tolist() == [2.0] * 4

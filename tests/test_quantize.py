"""quantize / dequantize: property tests of the round trip, saturation, zeros, denormals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fp8jax

FORMATS = {"e4m3": fp8jax.E4M3, "e5m2": fp8jax.E5M2}
# Relative error of round-to-nearest with m mantissa bits is <= 2**-(m+1);
# below the smallest normal (2**-6 for E4M3, 2**-14 for E5M2) the spacing is
# the smallest subnormal, so the absolute error is at most half of it.
UNIT_ROUNDOFF = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}
HALF_SUBNORMAL = {"e4m3": 2.0**-10, "e5m2": 2.0**-17}

scales = st.sampled_from([2.0**-8, 0.37, 1.0, 3.0, 2.0**10])
# f32 denormals are covered separately: XLA flushes them to zero (their amax
# reads 0), which the round-trip property below need not model.
finite32 = st.floats(
    -1e6, 1e6, allow_nan=False, allow_infinity=False, allow_subnormal=False, width=32
)


@settings(max_examples=60, deadline=None)
@given(
    fmt=st.sampled_from(["e4m3", "e5m2"]),
    values=st.lists(finite32, min_size=1, max_size=32),
    scale=scales,
)
def test_round_trip_error_within_format_bound(fmt, values, scale):
    fp8 = FORMATS[fmt]
    x = np.asarray(values, np.float32)
    x = x[np.abs(x) * scale <= fp8.max]  # in range: no saturation
    if x.size == 0:
        return
    q, amax = fp8jax.quantize(jnp.asarray(x), fp8, jnp.float32(scale))
    back = np.asarray(fp8jax.dequantize(q), np.float64)
    bound = UNIT_ROUNDOFF[fmt] * np.abs(x) + HALF_SUBNORMAL[fmt] / scale
    # dequantize multiplies by an f32 scale_inv: one more f32 rounding.
    bound = bound * (1 + 2.0**-23) + 2.0**-24 * np.abs(x)
    assert np.all(np.abs(back - x) <= bound)
    assert float(amax) == float(np.max(np.abs(x)))
    assert q.data.dtype == fp8.dtype


@settings(max_examples=40, deadline=None)
@given(
    fmt=st.sampled_from(["e4m3", "e5m2"]),
    magnitude=st.floats(1.0, 1e30),
    sign=st.sampled_from([-1, 1]),
)
def test_out_of_range_saturates_to_format_max(fmt, magnitude, sign):
    fp8 = FORMATS[fmt]
    x = jnp.asarray([sign * fp8.max * (1 + magnitude)], jnp.float32)
    q, _ = fp8jax.quantize(x, fp8, jnp.float32(1.0))
    assert float(q.data.astype(jnp.float32)[0]) == sign * fp8.max


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_infinities_stay_non_finite(fmt):
    # Finite overflow saturates (above), but an Inf must stay non-finite so
    # that a NaN/Inf guard downstream fires. It becomes NaN in both formats:
    # the GPU's FP8 conversion would saturate an Inf (fp8jax.quantize's docs).
    fp8 = FORMATS[fmt]
    q, _ = fp8jax.quantize(jnp.asarray([jnp.inf, -jnp.inf], jnp.float32), fp8, jnp.float32(1.0))
    assert bool(jnp.all(jnp.isnan(q.data.astype(jnp.float32))))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_zeros_stay_zero_and_get_scale_one(fmt):
    q, amax = fp8jax.quantize(jnp.zeros((5,), jnp.bfloat16), FORMATS[fmt])
    assert float(amax) == 0.0
    assert float(q.scale_inv) == 1.0
    assert not np.any(np.asarray(q.data.astype(jnp.float32)))


@settings(max_examples=40, deadline=None)
@given(
    fmt=st.sampled_from(["e4m3", "e5m2"]),
    tiny=st.floats(0, 2.0**-126, allow_subnormal=True, width=32),
)
def test_f32_denormals_flush_within_subnormal_bound(fmt, tiny):
    # f32 denormals are far below either FP8 format's smallest subnormal at
    # scale 1: they must round to zero, never to NaN or a large value.
    q, _ = fp8jax.quantize(jnp.asarray([tiny, -tiny], jnp.float32), FORMATS[fmt], jnp.float32(1.0))
    back = np.asarray(fp8jax.dequantize(q))
    assert np.all(np.abs(back) <= HALF_SUBNORMAL[fmt])


def test_fp8_subnormals_are_representable():
    # The smallest E4M3 subnormal, 2**-9, survives the round trip exactly.
    q, _ = fp8jax.quantize(
        jnp.asarray([2.0**-9, 3 * 2.0**-9], jnp.float32), fp8jax.E4M3, jnp.float32(1.0)
    )
    assert fp8jax.dequantize(q).tolist() == [2.0**-9, 3 * 2.0**-9]


def test_current_scaling_maps_amax_to_format_max():
    x = jnp.asarray([0.5, -7.0, 3.0], jnp.float32)
    q, amax = fp8jax.quantize(x, fp8jax.E4M3)
    assert float(amax) == 7.0
    assert float(jnp.max(jnp.abs(q.data.astype(jnp.float32)))) == 448.0


def test_nan_gives_scale_one_not_nan_scale():
    q, amax = fp8jax.quantize(jnp.asarray([jnp.nan, 2.0], jnp.float32), fp8jax.E4M3)
    assert np.isnan(float(amax))
    assert float(q.scale_inv) == 1.0
    assert float(q.data[1].astype(jnp.float32)) == 2.0


@pytest.mark.parametrize(
    ("x", "message"),
    [
        (
            jnp.ones((2,), jnp.int32),
            "x must be a float32, bfloat16 or float16 array, got dtype int32",
        ),
        (jnp.ones((2,), jnp.float8_e4m3fn), "got dtype float8_e4m3fn"),
        ([1.0, 2.0], "got a list"),
    ],
)
def test_quantize_rejects_non_high_precision(x, message):
    with pytest.raises(TypeError, match=message):
        fp8jax.quantize(x, fp8jax.E4M3)


def test_quantize_rejects_bad_format_and_scale():
    with pytest.raises(TypeError, match="fmt must be fp8jax.E4M3 or fp8jax.E5M2, got 'e4m3'"):
        fp8jax.quantize(jnp.ones((2,)), "e4m3")
    with pytest.raises(ValueError, match=r"scale must be a scalar, got shape \(2,\)"):
        fp8jax.quantize(jnp.ones((2,)), fp8jax.E4M3, jnp.ones((2,)))
    with pytest.raises(TypeError, match="q must be an fp8jax.Fp8Array"):
        fp8jax.dequantize(jnp.ones((2,)))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float8_e4m3fn, jnp.bool_])
def test_dequantize_refuses_a_dtype_that_rounds_again(dtype):
    # int32 truncated 0.9375 to 0; an FP8 dtype rounded the scaled values again.
    q, _ = fp8jax.quantize(jnp.array([1.0, -2.0, 3.0]), fp8jax.E4M3)
    with pytest.raises(TypeError, match="dtype must be a high-precision float dtype"):
        fp8jax.dequantize(q, dtype)


@pytest.mark.parametrize(
    ("shape", "row_maxima"),
    [
        ((8, 64, 2), (8,)),
        ((8, 64, 256), (8, 64)),
        ((64, 2), (64,)),
        ((2, 16, 8, 3, 128), (2, 16)),  # a GQA query gradient: one row a token
        ((2, 16, 8, 1, 64), (2, 16)),  # its key gradient at head_dim 64: rows of 512
        ((2, 16, 4, 2048), (2, 16, 4)),  # long rows stay as they are
    ],
)
def test_amax_takes_row_maxima_over_rows_of_useful_length(shape, row_maxima):
    # The row maxima are pinned (optimization barrier) so that XLA reduces
    # rows inside the producing fusion; over a short last axis (the
    # interleaved gated pre-activation's 2) they would be half the size of x
    # itself, so that axis joins the row, and rows under 1024 elements take in
    # the axes before them, never the first two (XLA reduced 128-element rows
    # at under half the speed, docs/design.md#the-amax-over-rows-of-a-token).
    x = jnp.ones(shape, jnp.bfloat16)
    from fp8jax.quantize import amax

    jaxpr = jax.make_jaxpr(amax)(x).jaxpr
    barriers = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
    assert [tuple(v.aval.shape) for e in barriers for v in e.invars] == [row_maxima]
    assert float(amax(x.at[1, 1].set(-5))) == 5.0

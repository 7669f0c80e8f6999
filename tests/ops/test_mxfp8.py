"""MXFP8Scaling: OCP MX blocks of 32 with E8M0 scales, planned for Blackwell.

Its numerics are checked here on the CPU (XLA's FP8 dots per 32-wide slice),
its GEMMs by deviceless compiles: cuDNN's block-scaled FP8 GEMM for a Blackwell
target, and, for Hopper, XLA's dequantize-then-multiply, which the verifier
reports as not FP8 and the ops refuse on a Hopper GPU.
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fine_references
import fp8jax
from fp8jax.ops import fine_grained
from fp8jax.ops.quantizing import quantize_operand
from numerics import assert_within, gemm_error_bound

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
MX = 32  # the OCP MX block
FUSED_RTOL = 2.0**-8  # test_fine_scaling.py's, derived there


def mx_scales(v, fmt, axis):
    """Each element's scale for 2-D ``v`` in blocks of 32 along ``axis``: a power of two.

    Off the grid the last block is padded with zeros, as the ops pad.
    """
    t = np.moveaxis(v, axis, -1)
    n = t.shape[-1]
    t = np.pad(t, ((0, 0), (0, -n % MX)))
    amax = np.max(np.abs(t.reshape(*t.shape[:-1], -1, MX)), axis=-1)
    scale = np.where(amax > 0, FP8_MAX[fmt] / np.where(amax > 0, amax, 1.0), 1.0)
    scales = np.repeat(np.exp2(np.floor(np.log2(scale))), MX, axis=-1)[..., :n]
    return np.moveaxis(scales, -1, axis)


def test_blocks_take_the_smallest_power_of_two_that_keeps_them_in_range():
    x = (
        jax.random.normal(jax.random.key(0), (1, 4, 128))
        * jnp.array([1e-30, 1.0, 3e4, 1e30])[None, :, None]
    )
    x = x.at[0, 0, :MX].set(0.0)  # an all-zero block
    blocks = quantize_operand(x, fp8jax.E4M3, None, fp8jax.MXFP8Scaling(), role="x").fp8
    q, scale_inv = blocks.data, blocks.scale_inv
    s = np.asarray(scale_inv, np.float64)
    assert s.shape == (1, 4, 128 // MX)
    assert np.all(np.log2(s) == np.round(np.log2(s))), "not powers of two"
    assert np.all((s >= 2.0**-127) & (s <= 2.0**127)), "outside E8M0"
    np.testing.assert_array_equal(np.asarray(s.astype(jnp.float8_e8m0fnu), np.float64), s)
    assert s[0, 0, 0] == 1.0  # the zero block
    amax = np.max(np.abs(np.asarray(x, np.float64)).reshape(1, 4, -1, MX), axis=-1)
    live = amax > 0
    # Nothing saturates, and half the scale would: the smallest such power of two.
    assert np.all(amax[live] / s[live] <= 448.0)
    assert np.all(amax[live] / (s[live] / 2) > 448.0)
    # So each live block's largest FP8 value is at least 224 (above it, rounded to it).
    q_amax = np.max(np.abs(np.asarray(q, np.float64)).reshape(1, 4, -1, MX), axis=-1)
    assert np.all((q_amax[live] >= 224.0) & (q_amax[live] <= 448.0)), q_amax


@functools.partial(jax.jit, static_argnames="recipe")
def dense_and_grads(x, w, g, recipe):
    y, vjp = jax.vjp(lambda x, w: fp8jax.dense(x, w, recipe=recipe), x, w)
    return y, *vjp(g)


@pytest.mark.parametrize("formats", [fp8jax.ALL_E4M3, fp8jax.HYBRID], ids=["e4m3", "hybrid"])
def test_mx_dense_within_fp8_bound(formats):
    # Off the 128 grid (padded), magnitudes over a few binades.
    kx, kw, kg = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (200, 96)) * jnp.exp2(
        jax.random.randint(kx, (200, 96), -3, 3).astype(jnp.float32)
    )
    w, g = jax.random.normal(kw, (96, 160)) * 0.05, jax.random.normal(kg, (200, 160))
    y, dx, dw = dense_and_grads(x, w, g, fp8jax.MXFP8Scaling(formats=formats))
    xs, ws, gs = (np.asarray(v, np.float64) for v in (x, w, g))
    e4 = "e4m3"
    eg = "e4m3" if formats == fp8jax.ALL_E4M3 else "e5m2"
    # Each operand in blocks of 32 along the axis its GEMM contracts.
    fwd = gemm_error_bound(xs, ws, e4, e4, mx_scales(xs, e4, 1), mx_scales(ws, e4, 0),
                           "mk,kn->mn", jnp.float32)  # fmt: skip
    assert_within(np.asarray(y, np.float64), xs @ ws, fwd, "forward")
    dgrad = gemm_error_bound(gs, ws, eg, e4, mx_scales(gs, eg, 1), mx_scales(ws, e4, 1),
                             "mn,kn->mk", jnp.float32)  # fmt: skip
    assert_within(np.asarray(dx, np.float64), gs @ ws.T, dgrad, "dgrad")
    wgrad = gemm_error_bound(xs, gs, e4, eg, mx_scales(xs, e4, 0), mx_scales(gs, eg, 0),
                             "mk,mn->kn", jnp.float32)  # fmt: skip
    assert_within(np.asarray(dw, np.float64), xs.T @ gs, wgrad, "wgrad")


def test_outlier_tokens_halve_per_tensor_error():
    kx, kw = jax.random.split(jax.random.key(3))
    x, w = jax.random.normal(kx, (256, 1024)), jax.random.normal(kw, (1024, 384)) * 0.03
    tokens = np.array([3, 50, 100, 200])
    x = x.at[tokens].multiply(3e4)
    others = np.setdiff1d(np.arange(256), tokens)
    ref = (np.asarray(x, np.float64) @ np.asarray(w, np.float64))[others]

    def error(recipe):
        y = np.asarray(jax.jit(fp8jax.dense, static_argnames="recipe")(x, w, recipe=recipe))
        return np.linalg.norm(y[others] - ref) / np.linalg.norm(ref)

    per_tensor = error(fp8jax.CurrentScaling())
    assert error(fp8jax.MXFP8Scaling()) <= per_tensor / 2, per_tensor


def _device(platform, capability):
    return types.SimpleNamespace(platform=platform, compute_capability=capability,
                                 device_kind=f"GPU {capability}")  # fmt: skip


def test_a_hopper_gpu_is_refused_by_name_and_capability():
    with pytest.raises(ValueError, match=r"compute capability 10\.0 or later .*GPU 9\.0 has 9\.0"):
        fine_grained.check_devices([_device("gpu", "9.0")])
    # Blackwell: no error
    fine_grained.check_devices([_device("gpu", "10.0"), _device("gpu", "12.0")])
    fine_grained.check_devices([types.SimpleNamespace(platform="cpu")])


def test_recipe_checks_its_formats():
    with pytest.raises(TypeError, match="MXFP8Scaling.formats must be a FormatPair"):
        fp8jax.MXFP8Scaling(formats="e4m3")
    assert fp8jax.init_state(fp8jax.MXFP8Scaling()) is None


def test_fused_ops_and_modules_take_the_recipe():
    from flax import linen as nn
    from flax import nnx

    from fp8jax.flax import linen as fnn
    from fp8jax.flax import nnx as fnnx

    # Every call is jitted, as a model runs: eagerly each step compiled on its own.
    recipe = fp8jax.MXFP8Scaling()
    dense = jax.jit(lambda x, kernel, bias: fp8jax.dense(x, kernel, bias, recipe=recipe))
    x = jax.random.normal(jax.random.key(9), (2, 16, 64))
    layer = fnn.DenseGeneral(features=48, recipe=recipe)
    variables = jax.jit(layer.init)(jax.random.key(0), x)
    params = nn.unbox(variables["params"])
    expected = dense(x, params["kernel"], params["bias"])
    np.testing.assert_allclose(jax.jit(layer.apply)(variables, x), expected, rtol=1e-6, atol=1e-6)
    module = fnnx.DenseGeneral(64, 48, recipe=recipe, rngs=nnx.Rngs(0))
    expected = dense(x, module.kernel[...], module.bias[...])
    got = nnx.jit(lambda module, x: module(x))(module, x)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    # The fused op: a norm, then MX GEMMs; values and gradients against the MX
    # fake-quant reference (tests/fine_references.py: E4M3 blocks of 32 along
    # each GEMM's K, power-of-two scales), normwise within
    # test_fine_scaling.FUSED_RTOL: the op's normalized input differs from the
    # reference's by f32 roundoff, which moves an FP8 rounding by one step now
    # and then. One scale per tensor, or blocks along the wrong axis, err by
    # about E4M3's own rounding, 2**-4 / sqrt(3) ~ 2**-5 normwise, far beyond.
    gamma = 1.0 + 0.1 * jax.random.normal(jax.random.key(2), (64,))
    beta = 0.1 * jax.random.normal(jax.random.key(3), (64,))
    kernel = jax.random.normal(jax.random.key(1), (64, 96)) * 0.1
    g = jax.random.normal(jax.random.key(4), (2, 16, 96))

    @jax.jit
    def forward_and_backward(x, gamma, beta, kernel, g):
        y, vjp = jax.vjp(lambda *a: fp8jax.layernorm_dense(*a, recipe=recipe), x, gamma, beta,
                         kernel)  # fmt: skip
        return y, vjp(g)

    y, grads = forward_and_backward(x, gamma, beta, kernel, g)
    rows = lambda v: np.asarray(v, np.float32).reshape(32, -1)  # noqa: E731
    want_y, want = fine_references.layernorm_dense(
        rows(x), np.asarray(gamma), np.asarray(beta), np.asarray(kernel), rows(g), kind="mx",
        forward="e4m3", backward="e4m3", power_of_two=True, block=MX,
    )  # fmt: skip
    got = dict(zip(("x", "gamma", "beta", "kernel"), grads, strict=True))
    for name, value in {"y": (y, want_y), **{n: (got[n], want[n]) for n in want}}.items():
        actual, expected = np.asarray(value[0], np.float64).reshape(value[1].shape), value[1]
        err = np.linalg.norm(actual - expected) / np.linalg.norm(expected)
        assert err <= FUSED_RTOL, (name, err)


def _dense_step(x, w, g):
    y, vjp = jax.vjp(lambda x, w: fp8jax.dense(x, w, recipe=fp8jax.MXFP8Scaling()), x, w)
    return y, vjp(g)


@functools.cache
def _deviceless(target):
    from fp8jax import verify

    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((512, 384), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((256, 384), jnp.bfloat16)
    return verify.gemm_report(verify.compile_for(_dense_step, x, w, g, target=target))


@pytest.mark.deviceless
def test_deviceless_blackwell_runs_three_block_scaled_fp8_gemms():
    """B200 target: forward, dgrad and wgrad are cuDNN's block-scaled GEMM on E4M3 operands."""
    report = _deviceless("b200")
    assert [(g.backend, g.target, g.lhs_dtype, g.rhs_dtype) for g in report.gemms] == [
        ("cudnn-fp8", "__cudnn$blockScaledDot", "f8e4m3fn", "f8e4m3fn")
    ] * 3, str(report)
    assert sorted((g.lhs_shape, g.rhs_shape) for g in report.gemms) == sorted([
        ((1, 256, 512), (1, 384, 512)),  # forward: K = 512
        ((1, 256, 384), (1, 512, 384)),  # dgrad: contracts N = 384
        ((1, 384, 256), (1, 512, 256)),  # wgrad: contracts M = 256
    ]), str(report)  # fmt: skip


@pytest.mark.deviceless
def test_deviceless_hopper_compile_is_not_fp8_and_the_verifier_says_so():
    """For the H200 XLA dequantizes MX operands; the report flags every GEMM."""
    report = _deviceless("h200")
    assert len(report.gemms) == 3 and not report.fp8_gemms, str(report)
    assert all(g.upcast_from_fp8 for g in report.gemms), str(report)


@pytest.mark.gpu
def test_on_a_hopper_gpu_the_ops_refuse_mxfp8():
    gpu = jax.devices()[0]
    if int(str(gpu.compute_capability).split(".")[0]) >= 10:
        pytest.skip("a Blackwell GPU runs MXFP8")
    x = jnp.ones((128, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="MXFP8Scaling needs a GPU of compute capability 10"):
        fp8jax.dense(x, x, recipe=fp8jax.MXFP8Scaling())

"""fp8jax.ops.activation_cast: its kernels (interpret mode, live) against f32 references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.ops import activation_cast as ac
from fp8jax.ops import cast_transpose as ct


def _gelu_tanh_f64(x):
    c, a = np.sqrt(2 / np.pi), 0.044715
    t = np.tanh(c * (x + a * x**3))
    return 0.5 * x * (1 + t), 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * a * x * x)


def _silu_f64(x):
    s = 1 / (1 + np.exp(-x))
    return x * s, s * (1 + x * (1 - s))


# The definitions in f64: (value, slope). In f32, 1 + tanh(u) cancels in the
# negative tail (see activation_cast._gelu_tanh), so JAX's own f32 gelu and
# its VJP are no exact reference there.
REFERENCE = {
    "gelu_tanh": _gelu_tanh_f64,
    "relu": lambda x: (np.maximum(x, 0), (x > 0).astype(np.float64)),
    "silu": _silu_f64,
}
ROWS, COLS = 2 * ct.BLOCK_ROWS, 3 * ct.BLOCK_COLS
H_SCALE, G_SCALE = 40.0, 2000.0


def _inputs(seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    pre = (jax.random.normal(k[0], (ROWS, COLS)) * 2).astype(jnp.bfloat16)
    dh = (jax.random.normal(k[1], (ROWS, COLS)) * 0.01).astype(jnp.bfloat16)
    bias = (jax.random.normal(k[2], (COLS,)) * 0.5).astype(jnp.bfloat16)
    return pre, dh, bias


def _reference(name, pre, dh, bias):
    """f64 values of h and of pre's gradient, from the bf16 inputs."""
    x = np.asarray(pre, np.float64)
    if bias is not None:
        x = x + np.asarray(bias, np.float64)[None, :]
    h, slope = REFERENCE[name](x)
    return h, slope * np.asarray(dh, np.float64)


def test_references_agree_with_jax_where_f32_does_not_cancel():
    # The f64 definitions are JAX's activations: on |x| <= 3, JAX's f32 values
    # and VJPs lie within 2**-20 (relative to max(|value|, 1)) of them.
    x = jnp.linspace(-3, 3, 4097, dtype=jnp.float32)
    jax_fns = {"gelu_tanh": lambda v: jax.nn.gelu(v, approximate=True), "relu": jax.nn.relu,
               "silu": jax.nn.silu}  # fmt: skip
    for name, fn in jax_fns.items():
        value, vjp = jax.vjp(fn, x)
        (slope,) = vjp(jnp.ones_like(x))
        want_value, want_slope = REFERENCE[name](np.asarray(x, np.float64))
        for got, want in ((value, want_value), (slope, want_slope)):
            got = np.asarray(got, np.float64)
            np.testing.assert_array_less(np.abs(got - want), 2.0**-20 * np.maximum(np.abs(want), 1))


def _fp8_bound(ref, fmt, scale):
    """How far a dequantized FP8 value may lie from the exact ``ref``.

    Rounding to the activations' bf16 first errs by half a bf16 spacing
    (2**-9 relative), then to ``fmt`` by half of its spacing, 2**-(m+1) for m
    mantissa bits, plus half its smallest subnormal, divided by ``scale``,
    near zero. The f32 math before them errs by a few f32 ulps (2**-24
    relative each); 2**-8 of the bound's own size covers them.
    """
    info = jnp.finfo(fmt.dtype)
    mantissa, smallest = info.nmant, float(info.smallest_subnormal)
    relative = 2.0 ** -(mantissa + 1) + 2.0**-9
    return np.abs(ref) * relative * (1 + 2.0**-8) + smallest / 2 / scale


def _f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def _check_against_reference(name, bias, forward, gradient, seed=0):
    pre, dh, _ = _inputs(seed)
    (q, h_amax), (out, h_t) = forward, gradient
    h_ref, g_ref = _reference(name, pre, dh, bias)
    np.testing.assert_array_less(
        np.abs(_f64(q) / H_SCALE - h_ref), _fp8_bound(h_ref, fp8jax.E4M3, H_SCALE)
    )
    # The backward recomputes h: its transposed copy holds the forward's bytes.
    np.testing.assert_array_equal(_f64(h_t), _f64(q).T)
    np.testing.assert_array_less(
        np.abs(_f64(out.q) / G_SCALE - g_ref),
        _fp8_bound(g_ref, fp8jax.E5M2, G_SCALE),
    )
    np.testing.assert_array_equal(_f64(out.q_t), _f64(out.q).T)
    # Sums and maxima are of the bf16-rounded values: within a bf16 spacing of
    # the exact ones (2**-8 relative, summed over |g|), plus the f32 order of
    # n additions (n * 2**-24 * sum |g|).
    slack = (2.0**-8 + ROWS * 2.0**-24) * np.abs(g_ref).sum(axis=0)
    np.testing.assert_array_less(np.abs(_f64(out.column_sums) - g_ref.sum(axis=0)), slack + 1e-12)
    rel = 2.0**-8
    assert abs(float(h_amax) - np.abs(h_ref).max()) <= rel * np.abs(h_ref).max()
    assert abs(float(out.amax) - np.abs(g_ref).max()) <= rel * np.abs(g_ref).max()


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("name", sorted(ac.KERNEL_ACTIVATIONS))
def test_kernels_match_the_f32_activation_and_its_vjp(name, with_bias):
    # Interpret mode runs the kernels' bodies on the CPU, tile by tile, with
    # exact tanh. Every FP8 value must be the f32 reference rounded twice
    # (bf16, then FP8) and the partials must reduce to the reference's sums
    # and maxima.
    pre, dh, bias = _inputs()
    biases = (bias,) if with_bias else ()
    scale, h_scale = jnp.float32(G_SCALE), jnp.float32(H_SCALE)
    q, maxima = ac._pallas_forward(pre, biases, h_scale, name=name, fmt=fp8jax.E4M3,
                                   interpret=True)  # fmt: skip
    g_q, g_t, sums, g_maxima, h_t = ac._pallas_gradient(
        dh, pre, biases, scale, h_scale, name=name, fmt=fp8jax.E5M2, h_fmt=fp8jax.E4M3,
        interpret=True,
    )  # fmt: skip
    out = ct.CastTransposed(g_q, g_t, jnp.sum(sums, axis=0), jnp.max(g_maxima))
    _check_against_reference(name, bias if with_bias else None, (q, jnp.max(maxima)), (out, h_t))


@pytest.mark.parametrize("name", sorted(ac.KERNEL_ACTIVATIONS))
def test_off_gpu_xla_computes_the_kernels_values(name):
    # On the CPU the public functions take XLA's path: the same two roundings.
    pre, dh, bias = _inputs(1)
    forward = jax.jit(ac.cast_activation, static_argnums=(2, 4))(
        pre, bias, name, jnp.float32(H_SCALE), fp8jax.E4M3
    )
    gradient = jax.jit(ac.cast_activation_gradient, static_argnums=(3, 5, 7))(
        dh, pre, bias, name, jnp.float32(G_SCALE), fp8jax.E5M2, jnp.float32(H_SCALE), fp8jax.E4M3
    )
    _check_against_reference(name, bias, forward, gradient, seed=1)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p, d, b: ac.cast_activation(p, b, "gelu", 1.0, fp8jax.E4M3), "name must be one"),
        (lambda p, d, b: ac.cast_activation(p[:10], b, "relu", 1.0, fp8jax.E4M3), "pre must be"),
        (
            lambda p, d, b: ac.cast_activation_gradient(
                d[:64], p, b, "relu", 1.0, fp8jax.E5M2, 1.0, fp8jax.E4M3
            ),
            "dh must have pre's shape",
        ),
    ],
    ids=["erf_gelu", "partial_tile", "dh_shape"],
)
def test_bad_input_is_explained(call, message):
    pre, dh, bias = _inputs()
    with pytest.raises(ValueError, match=message):
        call(pre, dh, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(ac.KERNEL_ACTIVATIONS))
def test_live_kernels_match_the_f32_activation_and_its_vjp(name):
    # The same bounds as in interpret mode: Triton's exp and division on the
    # GPU err by a few f32 ulps, as XLA's do. h_t is recomputed by the second
    # kernel from the same inputs and must still hold the first kernel's bytes.
    pre, dh, bias = _inputs()
    device = jax.devices()[0]
    assert device.platform == "gpu"
    pre, dh, bias = jax.device_put((pre, dh, bias), device)
    forward = jax.jit(ac.cast_activation, static_argnums=(2, 4))(
        pre, bias, name, jnp.float32(H_SCALE), fp8jax.E4M3
    )
    gradient = jax.jit(ac.cast_activation_gradient, static_argnums=(3, 5, 7))(
        dh, pre, bias, name, jnp.float32(G_SCALE), fp8jax.E5M2, jnp.float32(H_SCALE), fp8jax.E4M3
    )
    hlo = jax.jit(ac.cast_activation, static_argnums=(2, 4)).lower(
        pre, bias, name, jnp.float32(H_SCALE), fp8jax.E4M3
    ).as_text()  # fmt: skip
    assert "fp8jax_cast_activation" in hlo
    _check_against_reference(name, bias, forward, gradient)

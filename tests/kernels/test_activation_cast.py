"""fp8jax.kernels.activation_cast: its kernels (interpret mode, live) against f64 references."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.kernels import activation_cast as ac


def _gelu_tanh_f64(x):
    c, a = np.sqrt(2 / np.pi), 0.044715
    t = np.tanh(c * (x + a * x**3))
    return 0.5 * x * (1 + t), 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * a * x * x)


def _gelu_f64(x):
    phi = 0.5 * np.vectorize(math.erfc)(-x / np.sqrt(2))
    return x * phi, phi + x * np.exp(-0.5 * x * x) / np.sqrt(2 * np.pi)


def _silu_f64(x):
    s = 1 / (1 + np.exp(-x))
    return x * s, s * (1 + x * (1 - s))


# The definitions in f64: (value, slope). In f32, 1 + tanh(u) and 1 + erf(u)
# cancel in the negative tail (see activation_cast._gelu_tanh), so JAX's own
# f32 activations and their VJPs are no exact reference there.
REFERENCE = {
    "gelu": _gelu_f64,
    "gelu_tanh": _gelu_tanh_f64,
    "relu": lambda x: (np.maximum(x, 0), (x > 0).astype(np.float64)),
    "silu": _silu_f64,
    "linear": lambda x: (x, np.ones_like(x)),
}
CASES = [("gelu_tanh",), ("relu",), ("silu",), ("gelu",), ("gelu", "linear"), ("silu", "linear")]
ROWS, COLS = 2 * ac.ROWS_MULTIPLE, 3 * ac.COLUMNS_MULTIPLE
H_SCALE, G_SCALE = 40.0, 2000.0


def _inputs(n, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    pre = (jax.random.normal(k[0], (ROWS, n * COLS)) * 2).astype(jnp.bfloat16)
    dh = (jax.random.normal(k[1], (ROWS, COLS)) * 0.01).astype(jnp.bfloat16)
    bias = (jax.random.normal(k[2], (n * COLS,)) * 0.5).astype(jnp.bfloat16)
    return pre, dh, bias


def _reference(activations, pre, dh, bias):
    """f64 values of h and of pre's (interleaved) gradient, from the bf16 inputs."""
    n = len(activations)
    x = np.asarray(pre, np.float64)
    if bias is not None:
        x = x + np.asarray(bias, np.float64)[None, :]
    branches = [x[:, k::n] for k in range(n)]
    values, slopes = zip(*(REFERENCE[a](b) for a, b in zip(activations, branches, strict=True)),
                         strict=True)  # fmt: skip
    h = math.prod(values)
    factors = [slopes[k] * math.prod(v for j, v in enumerate(values) if j != k) for k in range(n)]
    d_pre = np.empty_like(x)
    for k, f in enumerate(factors):
        d_pre[:, k::n] = f * np.asarray(dh, np.float64)
    return h, d_pre


def test_references_agree_with_jax_where_f32_does_not_cancel():
    # The f64 definitions are JAX's activations (fp8jax.activations.REGISTRY's
    # XLA formulas): on |x| <= 3, JAX's f32 values and VJPs lie within 2**-19
    # (relative to max(|value|, 1)) of them. The widest is gelu_tanh's slope: an
    # error e in XLA's CPU tanh (a few f32 ulps near 1, up to about 2**-22) reaches
    # it multiplied by |0.5 - x t k (1 + 3a x^2)|, about 4.7 at x = 3; measured
    # 2**-19.9 with XLA's CPU loop emitters (tests/cpu_compile.py), 2**-20.3 with
    # its fusion emitters. A formula that differed would miss by 1e-3 or more.
    from fp8jax.activations import REGISTRY

    x = jnp.linspace(-3, 3, 4097, dtype=jnp.float32)
    for name, fn in ((name, entry.xla) for name, entry in REGISTRY.items()):
        value, vjp = jax.vjp(fn, x)
        (slope,) = vjp(jnp.ones_like(x))
        want_value, want_slope = REFERENCE[name](np.asarray(x, np.float64))
        for got, want in ((value, want_value), (slope, want_slope)):
            got = np.asarray(got, np.float64)
            np.testing.assert_array_less(np.abs(got - want), 2.0**-19 * np.maximum(np.abs(want), 1))


def _fp8_bound(ref, fmt, scale):
    """How far a dequantized FP8 value may lie from the exact ``ref``.

    Rounding to the activations' bf16 first errs by half a bf16 spacing
    (2**-9 relative), then to ``fmt`` by half of its spacing, 2**-(m+1) for m
    mantissa bits, plus half its smallest subnormal, divided by ``scale``,
    near zero. The f32 math before them errs by a few f32 ulps (2**-24
    relative each; the GPU's ex2/rcp.approx and the erfc approximation about
    2**-22) ; 2**-8 of the bound's own size covers them.
    """
    info = jnp.finfo(fmt.dtype)
    mantissa, smallest = info.nmant, float(info.smallest_subnormal)
    relative = 2.0 ** -(mantissa + 1) + 2.0**-9
    return np.abs(ref) * relative * (1 + 2.0**-8) + smallest / 2 / scale


def _f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def _check_against_reference(activations, bias, forward, gradient, seed=0):
    pre, dh, _ = _inputs(len(activations), seed)
    (q, h_maxima), (out, h_t) = forward, gradient
    h_ref, g_ref = _reference(activations, pre, dh, bias)
    # The cast saturates: a gated product may pass E4M3's 448 / H_SCALE.
    h_cast = np.clip(h_ref, -fp8jax.E4M3.max / H_SCALE, fp8jax.E4M3.max / H_SCALE)
    np.testing.assert_array_less(
        np.abs(_f64(q) / H_SCALE - h_cast), _fp8_bound(h_cast, fp8jax.E4M3, H_SCALE)
    )
    # The backward recomputes h: its transposed copy holds the forward's bytes.
    np.testing.assert_array_equal(_f64(h_t), _f64(q).T)
    np.testing.assert_array_less(
        np.abs(_f64(out.q) / G_SCALE - g_ref), _fp8_bound(g_ref, fp8jax.E5M2, G_SCALE)
    )
    # The transposed copy is branch-major: branch k's columns c become rows
    # k * COLS + c, so that kernel_1's wgrad writes the parameter's (hidden, n,
    # ffn) layout (cast_transpose.branch_major).
    n = len(activations)
    q = _f64(out.q)
    np.testing.assert_array_equal(_f64(out.q_t), np.concatenate([q[:, k::n].T for k in range(n)]))
    # Sums and maxima are of the bf16-rounded values: within a bf16 spacing of
    # the exact ones (2**-8 relative, summed over |g|), plus the f32 order of
    # n additions (n * 2**-24 * sum |g|).
    # Without a bias there is no bias gradient, and the kernel sums nothing.
    assert (out.column_sums is None) == (bias is None)
    if bias is not None:
        slack = (2.0**-8 + ROWS * 2.0**-24) * np.abs(g_ref).sum(axis=0)
        np.testing.assert_array_less(
            np.abs(_f64(out.column_sums) - g_ref.sum(axis=0)), slack + 1e-12
        )
    assert abs(float(jnp.max(h_maxima)) - np.abs(h_ref).max()) <= 2.0**-8 * np.abs(h_ref).max()
    assert abs(float(jnp.max(out.maxima)) - np.abs(g_ref).max()) <= 2.0**-8 * np.abs(g_ref).max()


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("activations", CASES, ids="-".join)
def test_kernels_match_the_activation_and_its_gradient(activations, with_bias):
    # Interpret mode runs the kernels' bodies on the CPU, tile by tile, with
    # XLA's exp, erfc and division. Every FP8 value must be the exact value
    # rounded twice (bf16, then FP8), the partials must reduce to its sums and
    # maxima, and a gated pair's gradient comes out interleaved as pre.
    pre, dh, bias = _inputs(len(activations))
    biases = (bias,) if with_bias else ()
    scale, h_scale = jnp.float32(G_SCALE), jnp.float32(H_SCALE)
    q, maxima = ac._pallas_forward(pre, biases, h_scale, activations=activations,
                                   fmt=fp8jax.E4M3, interpret=True)  # fmt: skip
    outputs = ac._pallas_gradient(
        dh, pre, biases, scale, h_scale, activations=activations, fmt=fp8jax.E5M2,
        h_fmt=fp8jax.E4M3, interpret=True,
    )  # fmt: skip
    if with_bias:
        g_q, g_t, sums, g_maxima, h_t = outputs
        sums = jnp.sum(sums, axis=0)
    else:
        (g_q, g_t, g_maxima, h_t), sums = outputs, None
    out = ac.cast_transpose.CastTransposed(g_q, g_t, sums, jnp.max(g_maxima))
    _check_against_reference(
        activations, bias if with_bias else None, (q, jnp.max(maxima)), (out, h_t)
    )


@pytest.mark.parametrize("path", ["interpret", "xla", pytest.param("live", marks=pytest.mark.gpu)])
def test_forward_without_maxima_writes_the_same_bytes(path):
    # Current scaling knows the amax before the kernel runs and asks for no
    # maxima: the FP8 bytes are those of the kernel with them.
    activations = ("silu", "linear")
    pre, _, bias = _inputs(len(activations))
    kwargs = {"activations": activations, "fmt": fp8jax.E4M3}
    call = {
        "interpret": functools.partial(ac._pallas_forward, interpret=True),
        "xla": ac._xla_forward,
        "live": jax.jit(ac._pallas_forward, static_argnames=("activations", "fmt", "maxima")),
    }[path]
    q, _ = call(pre, (bias,), jnp.float32(H_SCALE), **kwargs)
    only = call(pre, (bias,), jnp.float32(H_SCALE), maxima=False, **kwargs)
    assert len(only) == 1
    np.testing.assert_array_equal(only[0], q)


def _public_calls(activations, pre, dh, bias):
    forward = jax.jit(ac.cast_activation, static_argnums=(2, 4))(
        pre, bias, activations, jnp.float32(H_SCALE), fp8jax.E4M3
    )
    gradient = jax.jit(ac.cast_activation_gradient, static_argnums=(3, 5, 7))(
        dh, pre, bias, activations, jnp.float32(G_SCALE), fp8jax.E5M2, jnp.float32(H_SCALE),
        fp8jax.E4M3,
    )  # fmt: skip
    return forward, gradient


@pytest.mark.parametrize("activations", CASES, ids="-".join)
def test_off_gpu_xla_computes_the_kernels_values(activations):
    # On the CPU the public functions take XLA's path: the same two roundings.
    pre, dh, bias = _inputs(len(activations), 1)
    forward, gradient = _public_calls(activations, pre, dh, bias)
    _check_against_reference(activations, bias, forward, gradient, seed=1)


def test_gpu_erfc_approximation_is_within_its_published_bound():
    # Numerical Recipes' erfc, evaluated here with XLA's exp and division:
    # within 1.2e-7 relative (the published bound) plus f32 rounding, from
    # the positive tail (erfc(9) ~ 4e-37) to 2 at the negative end. The
    # rounding of exp's argument, about w**2 + 2 in size, moves the result by
    # (w**2 + 2) * 2**-24 relative per rounding; a few more f32 operations
    # add 2**-21.
    w = np.linspace(-9, 9, 20001).astype(np.float32)
    got = np.asarray(ac.erfc_approximation(jnp.asarray(w)), np.float64)
    w64 = w.astype(np.float64)
    want = np.vectorize(math.erfc)(w64)
    relative = 1.2e-7 + 2.0**-21 + (w64**2 + 2) * 2.0**-22
    np.testing.assert_array_less(np.abs(got - want), relative * want)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p, d, b: ac.cast_activation(p, b, ("tanh",), 1.0, fp8jax.E4M3), "one or two"),
        (lambda p, d, b: ac.cast_activation(p, b, ("relu",) * 3, 1.0, fp8jax.E4M3), "one or two"),
        (lambda p, d, b: ac.cast_activation(p[:10], b, ("relu",), 1.0, fp8jax.E4M3), "rows a"),
        (lambda p, d, b: ac.cast_activation(p[:, :96], b, ("relu",), 1.0, fp8jax.E4M3), "rows a"),
        (
            lambda p, d, b: ac.cast_activation_gradient(
                d[:64], p, b, ("relu",), 1.0, fp8jax.E5M2, 1.0, fp8jax.E4M3
            ),
            "dh must be",
        ),
    ],
    ids=["unknown", "three", "partial_rows", "partial_columns", "dh_shape"],
)
def test_bad_input_is_explained(call, message):
    pre, dh, bias = _inputs(1)
    with pytest.raises(ValueError, match=message):
        call(pre, dh, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("activations", CASES, ids="-".join)
def test_live_kernels_match_the_activation_and_its_gradient(activations, with_bias):
    # The same bounds as in interpret mode, with the GPU's ex2/rcp.approx and
    # the erfc approximation. h_t is recomputed by the second kernel from the
    # same inputs and must still hold the first kernel's bytes. Without a
    # bias the gradient kernel writes no column sums.
    device = jax.devices()[0]
    assert device.platform == "gpu"
    pre, dh, bias = jax.device_put(_inputs(len(activations)), device)
    bias = bias if with_bias else None
    hlo = jax.jit(ac.cast_activation, static_argnums=(2, 4)).lower(
        pre, bias, activations, jnp.float32(H_SCALE), fp8jax.E4M3
    ).as_text()  # fmt: skip
    assert "fp8jax_cast_activation" in hlo
    forward, gradient = _public_calls(activations, pre, dh, bias)
    _check_against_reference(activations, bias, forward, gradient)

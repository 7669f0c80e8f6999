"""Error budgets for FP8 GEMMs, derived from the formats, not tuned to results.

Round-to-nearest into a format with m explicit mantissa bits has relative
error at most u = 2**-(m + 1): E4M3 (m=3) u = 1/16, E5M2 (m=2) u = 1/8.
Below the normal range the spacing is fixed, so the absolute error is at most
half the smallest subnormal: 2**-10 for E4M3, 2**-17 for E5M2, in scaled units
(divide by the scale to get back to the tensor's units). So each quantized
element satisfies |q - v| <= u |v| + sub / scale =: e(v), and for a product of
two quantized operands

    |sum a_k b_k - sum qa_k qb_k| <= e(a) . |b| + |a| . e(b) + e(a) . e(b)

with "." a matrix product of elementwise magnitudes. High-precision outputs
add their own rounding: one rounding of the product and one of the scale
multiply, each at most u_out |y| (bfloat16 u = 2**-8, float32 2**-24), plus
the f32 accumulation, bounded by K * 2**-24 of the magnitude sum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

UNIT_ROUNDOFF = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}
HALF_MIN_SUBNORMAL = {"e4m3": 2.0**-10, "e5m2": 2.0**-17}
OUTPUT_UNIT_ROUNDOFF = {
    jnp.dtype(jnp.float32): 2.0**-24,
    jnp.dtype(jnp.bfloat16): 2.0**-8,
    jnp.dtype(jnp.float16): 2.0**-11,
}


def current_scale(v: np.ndarray, fmt: str) -> float:
    """The scale current scaling picks for ``v``."""
    fp8_max = {"e4m3": 448.0, "e5m2": 57344.0}[fmt]
    amax = float(np.max(np.abs(v)))
    return fp8_max / amax if amax > 0 else 1.0


def quantization_error(v: np.ndarray, fmt: str, scale: float) -> np.ndarray:
    """Elementwise bound on |quantize(v) - v|, in v's units."""
    v = np.asarray(v, np.float64)
    return UNIT_ROUNDOFF[fmt] * np.abs(v) + HALF_MIN_SUBNORMAL[fmt] / scale


def gemm_error_bound(a, b, a_fmt, b_fmt, a_scale, b_scale, contract, out_dtype, a_error=0.0):
    """Elementwise bound on |fp8 GEMM - exact GEMM| for ``np.einsum(contract, a, b)``.

    ``a_error`` bounds, elementwise, how far the operand the op actually
    quantizes is from ``a`` already (an upstream FP8 GEMM's error, say).
    """
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    abs_a = np.abs(a) + a_error
    ea = a_error + quantization_error(abs_a, a_fmt, a_scale)
    eb = quantization_error(b, b_fmt, b_scale)
    abs_ab = np.einsum(contract, abs_a, np.abs(b))
    bound = np.einsum(contract, ea, np.abs(b)) + np.einsum(contract, abs_a, eb)
    bound = bound + np.einsum(contract, ea, eb)
    inputs, out = contract.split("->")
    a_labels, b_labels = inputs.split(",")
    k = int(
        np.prod([a.shape[a_labels.index(c)] for c in a_labels if c in b_labels and c not in out])
    )
    u_out = OUTPUT_UNIT_ROUNDOFF[jnp.dtype(out_dtype)]
    accumulation = k * 2.0**-24 * (abs_ab + bound)
    # Three roundings to the output dtype: the GEMM result, the combined scale
    # (cast to the output dtype), and the product of the two.
    return bound + 3 * u_out * (abs_ab + bound) + accumulation


def assert_within(actual, expected, bound, what: str) -> None:
    """Elementwise |actual - expected| <= bound, with the worst offender in the message."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    excess = np.abs(actual - expected) - bound
    worst = np.unravel_index(np.argmax(excess), excess.shape) if excess.size else ()
    assert np.all(excess <= 0), (
        f"{what}: error exceeds the FP8 bound at {worst}: |{actual[worst]} - {expected[worst]}| "
        f"> {bound[worst]}"
    )


# --- Fake-quant emulation: the same arithmetic as fp8jax's ops, in f32 ------------
# Quantize-dequantize with current scaling reproduces each FP8 operand's value
# exactly (FP8 values and power-of-two-free scales are exact in f32 up to one
# rounding of the scale multiply), so an op and its emulation differ only by
# accumulation order and output rounding. Flips of one FP8 ulp on rare
# elements (an input that sits on a rounding boundary) are the only larger
# differences, which is why comparisons against emulation are norm-wise.

FP8 = {"e4m3": (jnp.float8_e4m3fn, 448.0), "e5m2": (jnp.float8_e5m2, 57344.0)}


def qdq(v, fmt: str):
    """Quantize-dequantize ``v`` with its own amax, in f32."""
    dtype, fp8_max = FP8[fmt]
    v = v.astype(jnp.float32)
    amax = jnp.max(jnp.abs(v))
    scale = jnp.where(amax > 0, fp8_max / amax, 1.0)
    return jnp.clip(v * scale, -fp8_max, fp8_max).astype(dtype).astype(jnp.float32) / scale


def _make_grad_qdq():
    @jax.custom_vjp
    def grad_qdq(y):
        return y

    grad_qdq.defvjp(lambda y: (y, None), lambda _, g: (qdq(g, "e5m2"),))
    return grad_qdq


def _make_ste_qdq():
    @jax.custom_vjp
    def ste_qdq(v):
        return qdq(v, "e4m3")

    ste_qdq.defvjp(lambda v: (qdq(v, "e4m3"), None), lambda _, g: (g,))
    return ste_qdq


grad_qdq = _make_grad_qdq()
ste_qdq = _make_ste_qdq()


def fake_quant_einsum(spec: str, a, b):
    """E4M3 operands forward, E5M2 incoming gradient backward, all in f32."""
    return grad_qdq(jnp.einsum(spec, ste_qdq(a), ste_qdq(b), precision="highest"))


def relative_error(actual, expected) -> float:
    """||actual - expected|| / ||expected|| in f64."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))

"""Independent fake-quant references for fp8jax's ops, for every scaling recipe.

Nothing here calls fp8jax's quantization or scaling code: an FP8 operand is
``ml_dtypes``' round-to-nearest cast of ``v * scale`` (in f32, clipped to the
format's largest finite value, as the recipes' docstrings specify), read back
as ``q / scale``; GEMMs run on those dequantized values in f32 at HIGHEST
precision, elementwise math (norms, activations and their derivatives) in
plain f32 ``jnp``. So a reference differs from the op it mirrors only by the
order of f32 arithmetic, and a test can bound that near f32 roundoff:

* A GEMM over K terms: both sides sum the same products (FP8 products are
  exact in f32; the reference's dequantized products carry 2 roundings of
  2**-24 each) in some f32 order, each within K * 2**-24 of the magnitude
  sum ``M = |a| . |b|``; the op's scale multiply adds 3 roundings (1/scale,
  their product, the multiply). Elementwise: ``(2 K + 8) 2**-24 M``
  (:func:`gemm_slack`), plus one rounding to a low-precision output dtype.
* An operand the op computes itself (the normalized input, the activation)
  differs from the reference's by a few f32 roundings, which moves an FP8
  rounding only for an element that lies within that distance of a rounding
  boundary: :func:`flip_slack` allows one FP8 step there and nothing elsewhere.

Every mistake the references are meant to catch is orders of magnitude
larger: an E5M2 operand where E4M3 belongs errs by up to 2**-3 relative per
element instead of 2**-4; another role's scale moves the rounding grid by a
factor that is not a power of two (and saturates or underflows); a wrong
amax changes the next scale by the ratio of the two tensors' amaxes.

Recipes plug in through one method, ``qdq(key, role, v)``, which returns the
dequantized operand and records what the recipe observes. Per-tensor recipes
(:class:`CurrentRef`, :class:`DelayedRef`) use one scale a tensor. The
row-wise, block and MX recipes and per-expert ``ragged_dot`` have their own
references, by quantization group, in ``fine_references.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

FORMATS = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}
F32_UNIT = 2.0**-24
OUTPUT_UNIT = {
    jnp.dtype(jnp.float32): 2.0**-24,
    jnp.dtype(jnp.bfloat16): 2.0**-8,
    jnp.dtype(jnp.float16): 2.0**-11,
}


def cast(v, fmt: str, scale) -> np.ndarray:
    """``v`` cast to ``fmt`` at ``scale``: f32 multiply, clip, round to nearest; as f32 values."""
    dtype, fp8_max = FORMATS[fmt]
    scaled = np.asarray(v, np.float32) * np.float32(scale)
    return np.clip(scaled, -fp8_max, fp8_max).astype(dtype).astype(np.float32)


def fake_quant(v, fmt: str, scale) -> np.ndarray:
    """``v`` cast to ``fmt`` at ``scale`` and read back, f32."""
    return (cast(v, fmt, scale).astype(np.float64) / np.float64(np.float32(scale))).astype(
        np.float32
    )


def flip_slack(v, fmt: str, scale, rel: float = 2.0**-16) -> np.ndarray:
    """Per element: the FP8 step ``v`` could round to instead if it moved by ``rel`` of itself.

    Zero except at elements within ``rel`` of an FP8 rounding boundary (in
    scaled units, below the normal range within ``rel`` of the tensor's amax).
    """
    v = np.asarray(v, np.float64)
    reach = rel * np.maximum(np.abs(v), np.max(np.abs(v)) * 2.0**-10)
    lo, hi = fake_quant(v - reach, fmt, scale), fake_quant(v + reach, fmt, scale)
    return np.abs(hi.astype(np.float64) - lo.astype(np.float64))


def amax(v) -> np.float32:
    """Largest magnitude, exactly (the max of f32 values is one of them)."""
    return np.float32(np.max(np.abs(np.asarray(v, np.float32))))


def scale_from_amax(value, fp8_max: float, margin: float):
    """``fp8_max / amax / 2**margin`` in f32, or None where amax gives no usable scale."""
    value = np.float32(value)
    if not (np.isfinite(value) and value > 0):
        return None
    with np.errstate(over="ignore"):
        scale = np.float32(fp8_max) / value / np.float32(2.0**margin)
    return scale if np.isfinite(scale) else None


class Fp8(NamedTuple):
    """An FP8 tensor as f32 values, and the factor that reads it back (``values * scale_inv``)."""

    values: np.ndarray
    scale_inv: np.float32


@dataclasses.dataclass
class CurrentRef:
    """CurrentScaling: each tensor scaled by its own amax (1 if that amax is 0 or not finite)."""

    margin: float = 0
    forward: str = "e4m3"
    backward: str = "e5m2"
    amaxes: dict = dataclasses.field(default_factory=dict)

    def fmt(self, role: str) -> str:
        return self.backward if role == "grad" else self.forward

    def scale(self, key: str, role: str, v):
        s = scale_from_amax(amax(v), FORMATS[self.fmt(role)][1], self.margin)
        return np.float32(1.0) if s is None else s

    def qdq(self, key: str, role: str, v) -> np.ndarray:
        """Records ``v``'s amax under ``key``; returns ``v`` quantized and read back, f32."""
        self.amaxes[key] = amax(v)
        return fake_quant(v, self.fmt(role), self.scale(key, role, v))

    def quantize(self, key: str, role: str, v) -> Fp8:
        """As :meth:`qdq`, but the FP8 values and the scale's f32 reciprocal apart."""
        self.amaxes[key] = amax(v)
        scale = np.float32(self.scale(key, role, v))
        return Fp8(cast(v, self.fmt(role), scale), np.float32(1) / scale)


@dataclasses.dataclass
class DelayedRef(CurrentRef):
    """DelayedScaling: each tensor at its stored scale; the step's amaxes make the next state.

    ``state`` maps a key (``"x"``, ``"fc2.grad"``) to ``(amax_history, scale)``.
    """

    state: dict = dataclasses.field(default_factory=dict)
    algo: str = "max"

    def scale(self, key: str, role: str, v):
        return np.float32(self.state[key][1])

    def next_state(self) -> dict:
        """The recipe's rule: amax into slot 0, the oldest dropped, scale from the window.

        A non-finite amax is recorded as 0; a window amax of 0 keeps the old scale.
        """
        new = {}
        for key, (history, old_scale) in self.state.items():
            observed = self.amaxes[key]
            observed = observed if np.isfinite(observed) else np.float32(0)
            history = np.concatenate([[observed], np.asarray(history, np.float32)[:-1]])
            history = history.astype(np.float32)
            window = history.max() if self.algo == "max" else history[0]
            fp8_max = FORMATS[self.fmt(key.rsplit(".", 1)[-1])][1]
            scale = scale_from_amax(window, fp8_max, self.margin)
            new[key] = (history, np.float32(old_scale) if scale is None else scale)
        return new


def state_dict(state) -> dict:
    """fp8jax's state NamedTuple (DotScaleState or MlpScaleState) as ``{key: (history, scale)}``."""
    out = {}
    for name, value in state._asdict().items():
        if hasattr(value, "amax_history"):
            out[name] = (np.asarray(value.amax_history), np.asarray(value.scale))
        else:
            out.update({f"{name}.{k}": v for k, v in state_dict(value).items()})
    return out


def assert_state(actual, expected: dict, rtol: float, what: str) -> None:
    """Each role's history and scale within ``rtol`` of the reference's."""
    actual = state_dict(actual)
    assert actual.keys() == expected.keys(), (what, actual.keys(), expected.keys())
    for key, (history, scale) in expected.items():
        got_history, got_scale = actual[key]
        np.testing.assert_allclose(got_history, history, rtol=rtol, atol=0,
                                   err_msg=f"{what}: {key}.amax_history")  # fmt: skip
        np.testing.assert_allclose(got_scale, scale, rtol=rtol, atol=0,
                                   err_msg=f"{what}: {key}.scale")  # fmt: skip


def reference_recipe(recipe, state=None):
    """The reference of an fp8jax recipe (and, for DelayedScaling, of the state it starts from)."""
    fmt = recipe.formats.forward.name, recipe.formats.backward.name
    if not hasattr(recipe, "amax_history_len"):  # CurrentScaling
        return CurrentRef(recipe.margin, *fmt)
    return DelayedRef(recipe.margin, *fmt, state=state_dict(state),
                          algo=recipe.amax_compute_algo)  # fmt: skip


# Stored scales a factor off each tensor's own amax, none a power of two
# from another (a power of two between two roles' scales would move only
# saturated and subnormal elements); 0.8 saturates the largest fifth of a
# tensor's range.
_SCALE_FACTORS = (0.8, 1.3, 1.7, 0.9, 1.15, 2.3)
# Full, distinct histories (multiples of the role's own amax under current
# scaling), in three patterns that each decide the next scale differently
# under "max": (a) the entry the step drops is the largest and the oldest
# one kept the largest of the rest, so that a window off by one at its old
# end, keeping the dropped entry or dropping the kept one, gives another
# scale; (b) the newest stored entry is the largest, so that the history
# counts and not only this step's amax; (c) every entry is below this
# step's amax, which decides. No two entries equal, so a slot read in place
# of another shows in the new history and, under "max", in the scale.
_HISTORY_PATTERNS = ((0.6, 0.45, 0.9, 0.7, 1.7, 2.5), (1.6, 0.4, 0.7, 0.2, 0.55, 0.3),
                     (0.5, 0.3, 0.8, 0.6, 0.35, 0.65))  # fmt: skip


def _history(length: int, pattern: int) -> np.ndarray:
    """Factors for a history of ``length`` slots, slot 0 newest (:data:`_HISTORY_PATTERNS`)."""
    factors = _HISTORY_PATTERNS[pattern]
    if pattern == 0:  # the dropped (last) slot largest, the oldest kept next
        return np.asarray(factors[:-2][: max(length - 2, 0)] + factors[-2:], np.float32)[-length:]
    return np.asarray(factors[:length], np.float32)


def delayed_state(recipe, state, amaxes: dict):
    """``state`` (from ``fp8jax.init_state``) with every role's own scale and full history.

    ``amaxes``: each role's amax under current scaling (``CurrentRef.amaxes``).
    Histories up to 6 slots long follow :data:`_HISTORY_PATTERNS`.
    """
    keys = list(state_dict(state))
    length = recipe.amax_history_len
    if length > 6:
        raise ValueError(f"delayed_state fills histories of at most 6 slots, got {length}.")
    values = {}
    for i, key in enumerate(keys):
        fmt = recipe.formats.backward if key.endswith("grad") else recipe.formats.forward
        a = float(amaxes[key])
        history = (np.float32(a) * _history(length, i % 3)).astype(np.float32)
        values[key] = (history, np.float32(fmt.max / (a * _SCALE_FACTORS[i % 6])))
    return _with_values(state, values)


def _with_values(state, values: dict, prefix=""):
    fields = {}
    for name, value in state._asdict().items():
        if hasattr(value, "amax_history"):
            history, scale = values[prefix + name]
            fields[name] = value._replace(amax_history=jnp.asarray(history),
                                          scale=jnp.asarray(scale))  # fmt: skip
        else:
            fields[name] = _with_values(value, values, f"{prefix}{name}.")
    return state._replace(**fields)


# --- GEMMs on dequantized operands --------------------------------------------------


def gemm(a, b, dims):
    """``lax.dot_general`` in f32 at HIGHEST precision."""
    return lax.dot_general(
        jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), dims,
        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
    )  # fmt: skip


def gemm_vjp(a, b, dims, g):
    """``(y, da, db)`` of ``dot_general(a, b, dims)`` with cotangent ``g``, each in f64.

    ``dims`` may also be a function of two arrays (an einsum), bilinear in them.
    """
    f = dims if callable(dims) else _gemm_of(dims)
    y, vjp = jitted_vjp(f, jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    da, db = vjp(jnp.asarray(g, jnp.float32))
    return tuple(np.asarray(t, np.float64) for t in (y, da, db))


@functools.cache
def _gemm_of(dims):
    """:func:`gemm` over ``dims``, one function per ``dims``: jitted_vjp compiles it once."""
    return lambda p, q: gemm(p, q, dims)


def jitted_vjp(f, *primals):
    """``jax.vjp(f, *primals)``, the value and the pullback each one jitted program.

    Eagerly every primitive of ``f`` and of its transpose compiles on its own.
    Only f32 math goes through here (a GEMM, a norm, an activation): XLA may
    fuse and reorder it, within the f32 roundoff the budgets allow, but has no
    low-precision rounding to drop. ``f`` is the jit cache's key: pass the same
    function for the same math (:func:`_gemm_of`, :func:`_norm_of`).
    """
    return _value(f, *primals), functools.partial(_pullback, f, primals)


@functools.partial(jax.jit, static_argnums=0)
def _value(f, *primals):
    return f(*primals)


@functools.partial(jax.jit, static_argnums=0)
def _pullback(f, primals, cotangent):
    return jax.vjp(f, *primals)[1](cotangent)


def epilogue(raw, scale_inv_a, scale_inv_b, dtype) -> np.ndarray:
    """A GEMM of FP8 values ``raw`` (f32) scaled back as the op does it, in ``dtype``, as f32.

    The op's GEMM writes ``dtype``, multiplies by the two reciprocal scales'
    f32 product cast to ``dtype``, and rounds that product to ``dtype``.
    """
    to = lambda v: jnp.asarray(v, jnp.float32).astype(dtype)  # noqa: E731
    out = to(raw) * to(np.float32(scale_inv_a) * np.float32(scale_inv_b))
    return np.asarray(out.astype(jnp.float32))


def fp8_gemm_vjp(a: Fp8, b: Fp8, dims, g: Fp8, dtypes) -> tuple[np.ndarray, ...]:
    """``(y, da, db)`` of the FP8 GEMM ``dot_general(a, b, dims)``, in ``dtypes``, as f32."""
    y, da, db = gemm_vjp(a.values, b.values, dims, g.values)
    return (epilogue(y, a.scale_inv, b.scale_inv, dtypes[0]),
            epilogue(da, g.scale_inv, b.scale_inv, dtypes[1]),
            epilogue(db, a.scale_inv, g.scale_inv, dtypes[2]))  # fmt: skip


def contraction_size(shape, dims, which: int) -> int:
    """Number of terms each output of the dot_general sums (``which``: 0 lhs, 1 rhs axes)."""
    return math.prod(shape[i] for i in dims[0][which])


def gemm_slack(magnitude, k: int, out_dtype=jnp.float32, value=None) -> np.ndarray:
    """Elementwise allowance between an FP8 GEMM and its fake-quant reference (module docstring).

    ``magnitude``: the products' magnitude sum ``|a| . |b|``; ``k``: terms
    per output; ``value``: the reference. In a low-precision ``out_dtype``
    (u = 2**-8 for bfloat16) the op rounds three times more: the GEMM's
    result, the scales' product cast to it, and their product.
    """
    slack = (2 * k + 8) * F32_UNIT * np.asarray(magnitude, np.float64)
    u_out = OUTPUT_UNIT[jnp.dtype(out_dtype)]
    if value is not None and u_out > F32_UNIT:
        slack = slack + 3 * u_out * (np.abs(np.asarray(value, np.float64)) + slack)
    return slack


def assert_close(actual, expected, bound, what: str) -> None:
    """Elementwise ``|actual - expected| <= bound``, naming the worst element."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    excess = np.abs(actual - expected) - np.asarray(bound, np.float64)
    worst = np.unravel_index(np.argmax(excess), excess.shape) if excess.size else ()
    allowed = np.broadcast_to(bound, excess.shape)[worst]
    assert np.all(excess <= 0), (
        f"{what}: |{actual[worst]} - {expected[worst]}| exceeds {allowed} at {worst}"
    )


def relative_error(actual, expected) -> float:
    """``||actual - expected|| / ||expected||`` in f64."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


# --- elementwise math: norms and activations, plain f32 jnp --------------------------


def norm(x, gamma, beta, norm_type="layernorm", zero_centered=False, epsilon=1e-6):
    """The textbook LayerNorm/RMSNorm in f32."""
    x = jnp.asarray(x, jnp.float32)
    per_feature = lambda v: jnp.asarray(v, jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))  # noqa: E731
    g = per_feature(gamma) + (1.0 if zero_centered else 0.0)
    if norm_type == "layernorm":
        x = x - jnp.mean(x, -1, keepdims=True)
    y = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + epsilon) * g
    return y if beta is None else y + per_feature(beta)


ACTIVATIONS = {
    "gelu": lambda v: jax.nn.gelu(v, approximate=False),
    "gelu_tanh": lambda v: jax.nn.gelu(v, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "linear": lambda v: v,
}


@functools.cache
def _norm_of(norm_type, zero_centered, epsilon):
    """:func:`norm` of ``(x, gamma, beta)`` with these options, one function per options."""
    return lambda x, g, b: norm(x, g, b, norm_type, zero_centered, epsilon)


@functools.cache
def _activation_of(activations):
    """:func:`activation` of ``pre`` for these activations, one function per activations."""
    return lambda p: activation(p, activations)


def activation(pre, activations):
    """``pre`` (..., n, ffn): the product of each branch's activation, in f32."""
    pre = jnp.asarray(pre, jnp.float32)
    h = ACTIVATIONS[activations[0]](pre[..., 0, :])
    for i, name in enumerate(activations[1:], start=1):
        h = h * ACTIVATIONS[name](pre[..., i, :])
    return h


def rounded(v, dtype) -> np.ndarray:
    """``v`` rounded to ``dtype`` and back to f32: where the op stores an intermediate."""
    return np.asarray(jnp.asarray(v, jnp.float32).astype(dtype).astype(jnp.float32))


# --- the ops ------------------------------------------------------------------------


def dot_general(lhs, rhs, dims, cotangent, rec, prefix="", magnitudes=False):
    """``(y, d_lhs, d_rhs)``: FP8 forward, dgrad and wgrad, in f64; ``rec`` records amaxes.

    ``dims``: dimension numbers, or a bilinear function of the two operands.
    ``magnitudes``: also return the three GEMMs' magnitude sums (``|a| . |b|``).
    """
    lq = rec.qdq(prefix + "x", "x", lhs)
    rq = rec.qdq(prefix + "kernel", "kernel", rhs)
    gq = rec.qdq(prefix + "grad", "grad", cotangent)
    out = gemm_vjp(lq, rq, dims, gq)
    if not magnitudes:
        return out
    return out, gemm_vjp(np.abs(lq), np.abs(rq), dims, np.abs(gq))


def layernorm_dense(x, gamma, beta, kernel, bias, cotangent, rec, *, norm_type="layernorm",
                    zero_centered=False, epsilon=1e-6):  # fmt: skip
    """Forward and gradients of norm -> FP8 dense: ``(y, {"x": dx, "gamma": ..., ...})``."""
    dtype = jnp.dtype(x.dtype)
    n, norm_vjp = jitted_vjp(_norm_of(norm_type, zero_centered, epsilon),
                             x.astype(jnp.float32), gamma.astype(jnp.float32),
                             None if beta is None else beta.astype(jnp.float32))  # fmt: skip
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    nq = rec.quantize("x", "x", n)
    kq = rec.quantize("kernel", "kernel", kernel)
    gq = rec.quantize("grad", "grad", cotangent)
    y, dn, dk = fp8_gemm_vjp(nq, kq, dims, gq, (dtype, dtype, kernel.dtype))
    if bias is not None:
        y = y + np.asarray(bias, np.float32)
    dx, dgamma, dbeta = norm_vjp(jnp.asarray(dn))
    grads = {"x": dx, "gamma": dgamma, "kernel": dk}
    if beta is not None:
        grads["beta"] = dbeta
    if bias is not None:
        grads["bias"] = np.asarray(cotangent, np.float64).reshape(-1, *bias.shape).sum(0)
    return y, {k: np.asarray(v, np.float64) for k, v in grads.items()}


def layernorm_mlp(x, gamma, beta, k1, k2, b1, b2, cotangent, rec, *, activations,
                  norm_type="layernorm", zero_centered=False, epsilon=1e-6):  # fmt: skip
    """Forward and gradients of norm -> FP8 GEMM -> activation -> FP8 GEMM, as the op rounds.

    The op stores the pre-activation, the activation and their gradients in
    ``x.dtype``, so the reference rounds them there too. Returns ``(y, grads,
    intermediates)``, ``intermediates`` the f32 pre-activation and activation.
    """
    dtype = jnp.dtype(x.dtype)
    n, norm_vjp = jitted_vjp(_norm_of(norm_type, zero_centered, epsilon),
                             x.astype(jnp.float32), gamma.astype(jnp.float32),
                             None if beta is None else beta.astype(jnp.float32))  # fmt: skip
    dims1 = (((x.ndim - 1,), (0,)), ((), ()))
    nq = rec.quantize("fc1.x", "x", n)
    k1q = rec.quantize("fc1.kernel", "kernel", k1)
    pre = epilogue(gemm(nq.values, k1q.values, dims1), nq.scale_inv, k1q.scale_inv, dtype)
    biased = pre if b1 is None else pre + np.asarray(b1, np.float32)[None]
    h32, act_vjp = jitted_vjp(_activation_of(tuple(activations)), jnp.asarray(biased))
    h = rounded(h32, dtype)
    hq = rec.quantize("fc2.x", "x", h)
    k2q = rec.quantize("fc2.kernel", "kernel", k2)
    gq = rec.quantize("fc2.grad", "grad", cotangent)
    dims2 = (((h.ndim - 1,), (0,)), ((), ()))
    y, dh, dk2 = fp8_gemm_vjp(hq, k2q, dims2, gq, (dtype, dtype, k2.dtype))
    if b2 is not None:
        y = y + np.asarray(b2, np.float32)
    dpre = rounded(act_vjp(jnp.asarray(dh))[0], dtype)
    dpreq = rec.quantize("fc1.grad", "grad", dpre)
    _, dn, dk1 = fp8_gemm_vjp(nq, k1q, dims1, dpreq, (dtype, dtype, k1.dtype))
    dx, dgamma, dbeta = norm_vjp(jnp.asarray(dn))
    rows = tuple(range(x.ndim - 1))
    grads = {"x": dx, "gamma": dgamma, "kernel_1": dk1, "kernel_2": dk2}
    if beta is not None:
        grads["beta"] = dbeta
    if b1 is not None:
        grads["bias_1"] = np.asarray(dpre, np.float64).sum(rows)
    if b2 is not None:
        grads["bias_2"] = np.asarray(cotangent, np.float64).sum(rows)
    return y, {k: np.asarray(v, np.float64) for k, v in grads.items()}, {"pre": pre, "h": h}

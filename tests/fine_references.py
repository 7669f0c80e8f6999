"""Independent fake-quant references for the fine-grained recipes and per-expert ``ragged_dot``.

As in ``references.py``, nothing here calls fp8jax's quantization or
scaling code: a group's scale is ``fp8_max / group_amax / 2**margin`` in
f32 (1 where the amax is 0 or not finite, or the scale overflows), rounded
down to a power of two through ``log2`` where the recipe asks for it (fp8jax
clears mantissa bits instead); the FP8 operand is ``ml_dtypes``' cast of
``v * scale`` clipped to the format's maximum, read back by dividing by
the scale in f64; every GEMM runs on those dequantized operands in f64. So
the only difference from the op is the op's f32 arithmetic: an FP8 GEMM's
products are exact in f32 and its sums, scale multiplies and epilogue
round a few times per term, within ``(2 K + 8) 2**-24`` of the magnitude
sum ``|a| . |b|`` (:func:`references.gemm_slack`).

A group is ``(rows, columns)`` of a 2-D operand, ``None`` for a whole
axis: ``(1, None)`` is one scale per row, ``(None, 1)`` per column,
``(1, 128)`` a 1x128 tile, ``(128, 128)`` a block. Each recipe's three
GEMMs name the group of each operand (the axis it contracts decides):

========= ===================== ===================== =====================
recipe    forward x . w         dgrad g . w^T         wgrad x^T . g
========= ===================== ===================== =====================
Rowwise   x rows, w columns     g rows, w rows        x columns, g columns
Block     x 1x128, w blocks     g 1x128, w blocks     x 128x1, g 128x1
MXFP8     x 1x32, w 32x1        g 1x32, w 1x32        x 32x1, g 32x1
========= ===================== ===================== =====================

A wrong group (a block's amax over half of it, a row scale taken per
tensor, another expert's scale) moves the rounding grid of a whole group
by a factor that is not a power of two: hundreds of FP8 steps, against a
slack near f32 roundoff.
"""

from __future__ import annotations

import numpy as np

from references import FORMATS, cast, gemm_slack


def group_scales(group_amax, fmt: str, margin: float = 0, power_of_two: bool = False):
    """Each group's f32 scale from its amax; 1 for an amax of 0, not finite, or too small."""
    amax = np.asarray(group_amax, np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        scale = (np.float32(FORMATS[fmt][1]) / amax) / np.float32(2.0**margin)
    usable = (amax > 0) & np.isfinite(amax) & np.isfinite(scale)
    scale = np.where(usable, scale, np.float32(1)).astype(np.float32)
    if power_of_two:  # the largest power of two at most the scale
        scale = np.exp2(np.floor(np.log2(scale.astype(np.float64)))).astype(np.float32)
    return scale


def _extent(size: int, group) -> int:
    return size if group is None else group


def group_amax(v, group) -> np.ndarray:
    """Amax per ``group`` (rows, columns) of 2-D ``v``: shape (R / rows, C / columns)."""
    v = np.abs(np.asarray(v, np.float32))
    r, c = (_extent(n, g) for n, g in zip(v.shape, group, strict=True))
    return v.reshape(v.shape[0] // r, r, v.shape[1] // c, c).max(axis=(1, 3))


def expand(per_group, shape, group) -> np.ndarray:
    """Per-group values (R / rows, C / columns) repeated over their groups: ``shape``."""
    r, c = (_extent(n, g) for n, g in zip(shape, group, strict=True))
    return np.repeat(np.repeat(per_group, r, axis=0), c, axis=1)


def qdq(v, fmt: str, group, margin: float = 0, power_of_two: bool = False):
    """``v`` quantized per ``group`` and read back (f64), and each element's scale (f32)."""
    v = np.asarray(v, np.float32)
    scale = expand(group_scales(group_amax(v, group), fmt, margin, power_of_two), v.shape, group)
    return _dequantized(v, fmt, scale), scale


def _dequantized(v, fmt: str, scale) -> np.ndarray:
    dtype, fp8_max = FORMATS[fmt]
    scaled = v * scale  # f32, as the op multiplies
    q = np.clip(scaled, -fp8_max, fp8_max).astype(dtype).astype(np.float64)
    return q / scale.astype(np.float64)


# Each recipe's groups, per GEMM: (lhs group, rhs group) of the 2-D operands as
# the GEMM reads them: forward x (M, K) . w (K, N); dgrad g (M, N) . w^T (N, K);
# wgrad x^T (K, M) . g (M, N). The groups are given on x, w and g themselves.
def _groups(kind: str, block: int):
    if kind == "rowwise":
        return {"forward": ((1, None), (None, 1)), "dgrad": ((1, None), (1, None)),
                "wgrad": ((None, 1), (None, 1))}  # fmt: skip
    if kind == "block":
        return {"forward": ((1, block), (block, block)), "dgrad": ((1, block), (block, block)),
                "wgrad": ((block, 1), (block, 1))}  # fmt: skip
    if kind == "mx":
        return {"forward": ((1, block), (block, 1)), "dgrad": ((1, block), (1, block)),
                "wgrad": ((block, 1), (block, 1))}  # fmt: skip
    raise ValueError(f"kind must be rowwise, block or mx, got {kind!r}.")


def dense(x, w, g, *, kind: str, forward: str, backward: str, margin: float = 0,
          power_of_two: bool = False, block: int = 128):  # fmt: skip
    """``{"y"|"dx"|"dw": (value, slack)}``: FP8 ``x @ w`` and its gradients under cotangent ``g``.

    ``kind``: ``"rowwise"``, ``"block"`` or ``"mx"``; ``x`` (M, K), ``w`` (K, N),
    ``g`` (M, N), f32 values. Each GEMM's slack is :func:`references.gemm_slack`'s
    at f32 output.
    """
    groups = _groups(kind, block)
    out = {}
    for name, (a, b, a_fmt, b_fmt, transpose_a, transpose_b) in {
        "y": (x, w, forward, forward, False, False),
        "dx": (g, w, backward, forward, False, True),
        "dw": (x, g, forward, backward, True, False),
    }.items():
        gemm = {"y": "forward", "dx": "dgrad", "dw": "wgrad"}[name]
        a_group, b_group = groups[gemm]
        aq, _ = qdq(a, a_fmt, a_group, margin, power_of_two)
        bq, _ = qdq(b, b_fmt, b_group, margin, power_of_two)
        aq = aq.T if transpose_a else aq
        bq = bq.T if transpose_b else bq
        k = aq.shape[1]
        out[name] = (aq @ bq, gemm_slack(np.abs(aq) @ np.abs(bq), k))
    return out


def ragged_dot(lhs, rhs, group_sizes, g, *, forward="e4m3", backward="e5m2", margin=0):
    """``{"y"|"d_lhs"|"d_rhs": (value, slack)}`` of fp8jax's per-expert FP8 ragged_dot.

    ``lhs`` (m, k) and the cotangent ``g`` (m, n) get one scale each (their
    amax), each expert's ``rhs[i]`` (k, n) its own (its amax, at the forward
    format's maximum). The forward multiplies E4M3 by E4M3; the dgrad the
    E5M2 gradient by ``rhs`` cast to E5M2 from the f32 values at the
    expert's scale; the wgrad the E4M3 ``lhs`` converted to E5M2 (a second
    rounding) by the gradient. Rows past ``sum(group_sizes)`` give zeros.
    """
    lhs, rhs, g = (np.asarray(v, np.float32) for v in (lhs, rhs, g))
    experts, k, n = rhs.shape
    whole = (None, None)
    lhs_q, lhs_scale = qdq(lhs, forward, whole, margin)
    g_q, _ = qdq(g, backward, whole, margin)
    expert_scale = group_scales(np.abs(rhs).reshape(experts, -1).max(1), forward, margin)
    s = expert_scale[:, None, None]
    rhs_fwd = _dequantized(rhs, forward, np.broadcast_to(s, rhs.shape).astype(np.float32))
    rhs_bwd = _dequantized(rhs, backward, np.broadcast_to(s, rhs.shape).astype(np.float32))
    # The wgrad's lhs: the E4M3 values (at lhs's scale) converted to E5M2.
    e4m3 = cast(lhs, forward, lhs_scale[0, 0]).astype(np.float32)
    lhs_as_bwd = e4m3.astype(FORMATS[backward][0]).astype(np.float64) / np.float64(lhs_scale[0, 0])
    y, d_lhs = np.zeros((lhs.shape[0], n)), np.zeros(lhs.shape)
    y_mag, d_lhs_mag = np.zeros_like(y), np.zeros_like(d_lhs)
    d_rhs, d_rhs_mag = np.zeros(rhs.shape), np.zeros(rhs.shape)
    start = 0
    for i, size in enumerate(np.asarray(group_sizes)):
        rows = slice(start, start + int(size))
        start += int(size)
        y[rows] = lhs_q[rows] @ rhs_fwd[i]
        y_mag[rows] = np.abs(lhs_q[rows]) @ np.abs(rhs_fwd[i])
        d_lhs[rows] = g_q[rows] @ rhs_bwd[i].T
        d_lhs_mag[rows] = np.abs(g_q[rows]) @ np.abs(rhs_bwd[i]).T
        d_rhs[i] = lhs_as_bwd[rows].T @ g_q[rows]
        d_rhs_mag[i] = np.abs(lhs_as_bwd[rows]).T @ np.abs(g_q[rows])
    rows = max(int(np.max(group_sizes, initial=0)), 1)
    return {"y": (y, gemm_slack(y_mag, k)), "d_lhs": (d_lhs, gemm_slack(d_lhs_mag, n)),
            "d_rhs": (d_rhs, gemm_slack(d_rhs_mag, rows))}  # fmt: skip


def block_ragged_dot(lhs, rhs, group_sizes, g, *, forward="e4m3", backward="e4m3", margin=0,
                     power_of_two=False, block=128):  # fmt: skip
    """``{"y"|"d_lhs"|"d_rhs": (value, slack)}`` of the block-scaled ragged_dot: :func:`dense`
    on each group's rows.

    Each group's rows ``lhs[rows]`` (size, k), its ``rhs[i]`` (k, n) and the
    cotangent's rows ``g[rows]`` (size, n) are zero-padded to multiples of
    ``block`` and run through the dense block reference: tokens per 1 x block
    tile, the weight per block, the wgrad's operands per ``block`` tokens
    from the group's first row (zeros change no amax). Rows past
    ``sum(group_sizes)`` give zeros and contribute nothing.
    """
    lhs, rhs, g = (np.asarray(v, np.float32) for v in (lhs, rhs, g))
    k, n = rhs.shape[1:]
    recipe = dict(kind="block", forward=forward, backward=backward, margin=margin,
                  power_of_two=power_of_two, block=block)  # fmt: skip
    out = {"y": np.zeros((lhs.shape[0], n)), "d_lhs": np.zeros(lhs.shape),
           "d_rhs": np.zeros(rhs.shape)}  # fmt: skip
    slack = {name: np.zeros_like(v) for name, v in out.items()}
    up = lambda v: -v % block  # noqa: E731
    start = 0
    for i, size in enumerate(np.asarray(group_sizes)):
        rows = slice(start, start + int(size))
        start += int(size)
        if not size:
            continue
        pad_rows = up(int(size))
        res = dense(np.pad(lhs[rows], ((0, pad_rows), (0, up(k)))),
                    np.pad(rhs[i], ((0, up(k)), (0, up(n)))),
                    np.pad(g[rows], ((0, pad_rows), (0, up(n)))), **recipe)  # fmt: skip
        for name, key, crop in (("y", "y", (int(size), n)), ("d_lhs", "dx", (int(size), k)),
                                ("d_rhs", "dw", (k, n))):  # fmt: skip
            value, s = res[key]
            target = rows if name != "d_rhs" else i
            out[name][target] = value[: crop[0], : crop[1]]
            slack[name][target] = s[: crop[0], : crop[1]]
    return {name: (out[name], slack[name]) for name in out}


def _norm_and_vjp(x, gamma, beta):
    """The textbook LayerNorm in f32 (``references.norm``) over rows of ``x``, and its VJP."""
    import jax
    import jax.numpy as jnp

    from references import norm

    return jax.vjp(lambda x, g, b: norm(x, g, b), *(jnp.asarray(v, jnp.float32)
                                                      for v in (x, gamma, beta)))  # fmt: skip


def layernorm_dense(x, gamma, beta, kernel, g, *, pad_to=1, **recipe):
    """``(y, {"x", "gamma", "beta", "kernel"})``: LayerNorm, then :func:`dense` (2-D ``x``)."""
    normed, norm_vjp = _norm_and_vjp(x, gamma, beta)
    out = _padded_dense(np.asarray(normed), kernel, g, pad_to, **recipe)
    dx, dgamma, dbeta = norm_vjp(np.asarray(out["dx"], np.float32))
    grads = {"x": dx, "gamma": dgamma, "beta": dbeta, "kernel": out["dw"]}
    return out["y"], {k: np.asarray(v, np.float64) for k, v in grads.items()}


def layernorm_mlp(x, gamma, beta, k1, k2, g, activation, *, pad_to=1, **recipe):
    """``(y, grads)``: LayerNorm, :func:`dense`, the gated ``activation`` of ``(m, 2, ffn)``
    pre-activations (f32 ``jnp``), :func:`dense`; ``k1`` (hidden, 2 * ffn) interleaved as the
    pre-activation's last two axes."""
    import jax
    import jax.numpy as jnp

    normed, norm_vjp = _norm_and_vjp(x, gamma, beta)
    normed = np.asarray(normed)
    zeros = np.zeros((x.shape[0], k1.shape[1]), np.float32)
    pre = _padded_dense(normed, k1, zeros, pad_to, **recipe)["y"].astype(np.float32)
    h, act_vjp = jax.vjp(activation, jnp.asarray(pre.reshape(x.shape[0], 2, -1)))
    second = _padded_dense(np.asarray(h), k2, g, pad_to, **recipe)
    (dpre,) = act_vjp(jnp.asarray(second["dx"], jnp.float32))
    first = _padded_dense(normed, k1, np.asarray(dpre).reshape(zeros.shape), pad_to, **recipe)
    dx, dgamma, dbeta = norm_vjp(np.asarray(first["dx"], np.float32))
    grads = {"x": dx, "gamma": dgamma, "beta": dbeta, "kernel_1": first["dw"],
             "kernel_2": second["dw"]}  # fmt: skip
    return second["y"], {k: np.asarray(v, np.float64) for k, v in grads.items()}


def _padded_dense(x, w, g, pad_to, **recipe):
    """:func:`dense`'s values (no slack) on operands zero-padded to multiples of ``pad_to``."""
    m, k = x.shape
    n = w.shape[1]
    up = lambda v: -v % pad_to  # noqa: E731
    out = dense(np.pad(x, ((0, up(m)), (0, up(k)))), np.pad(w, ((0, up(k)), (0, up(n)))),
                np.pad(g, ((0, up(m)), (0, up(n)))), **recipe)  # fmt: skip
    crop = {"y": (m, n), "dx": (m, k), "dw": (k, n)}
    return {name: v[: crop[name][0], : crop[name][1]] for name, (v, _) in out.items()}

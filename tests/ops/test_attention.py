"""fp8jax.dot_product_attention against an independent f32 fake-quant reference.

The reference (numpy, f32, nothing from fp8jax) quantizes Q, K and V as the
op specifies (one power-of-two scale per 128 rows and head, the smallest
that maps amax to at most 448, round to nearest even E4M3), then runs
exact softmax attention on the dequantized values. What the op does beyond
that is derived into per-element budgets:

* **Forward.** The op quantizes P = exp(s - m) in [0, 1] to E4M3 at scale
  2**8 before PV. A normal E4M3 value is within a relative 2**-4 of its
  input (3 mantissa bits, half a step); below 2**-6 (p < 2**-14) the
  absolute error is at most half the subnormal step, 2**-10 / 2**8 / 2 =
  2**-19. The sum l uses unrounded P. So each output element errs by at most
  ``2**-4 (P|V|)[i, d] / l_i + 2**-19 Σ_j |v_jd| / l_i`` (``forward_budget``),
  plus one BF16 rounding of the output (2**-8 relative, a whole step) and f32
  order slack (scores are the same FP8 products, summed in another order:
  ``2**-16`` relative to the magnitudes covers D * 2**-24 and exp's
  amplification of a few units in the last place of s).
* **Backward.** P is recomputed from the saved logsumexp in f32 (the
  softmax the reference uses), and dV = Pᵀ dO, dP = dO Vᵀ, dQ = dS K,
  dK = dSᵀ Q take BF16 operands with f32 sums: each operand rounding is a
  relative u = 2**-8 (a whole step, to be safe). delta = rowsum(dO * O)
  inherits the forward's output error. :func:`backward_budget` propagates
  these bounds through each product with absolute values.

A missing or doubled scale, an unscaled P (everything below 2**-9 lost), the
wrong key block, a wrong mask or a wrong GQA head mapping all break these
bounds by far (the mutants at the bottom check that the budget can fail).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8jax
from fp8jax.kernels import attention as kernel
from fp8jax.ops import attention as op

E4M3_MAX = 448.0
BLOCK = 128
P_UNIT, P_SUBNORMAL = 2.0**-4, 2.0**-19
U16 = 2.0**-8
SLACK = 2.0**-16


def fake_quant(x):
    """Per (128 rows, head) block: a power-of-two scale, round to nearest E4M3; as f32."""
    x = np.asarray(x, np.float32)
    b, t, h, d = x.shape
    blocks = x.reshape(b, t // BLOCK, BLOCK, h, d)
    amax = np.abs(blocks).max(axis=(2, 4), keepdims=True)
    # The smallest power of two with amax / scale <= 448 (E4M3's largest).
    exponent = np.ceil(np.log2(np.maximum(amax, 2.0**-100) / E4M3_MAX))
    scale = np.exp2(exponent).astype(np.float32)
    q = (blocks / scale).astype(ml_dtypes.float8_e4m3fn)
    return (q.astype(np.float32) * scale).reshape(x.shape)


def expand_heads(x, heads):
    """(B, T, Hkv, D) -> (B, T, H, D): query head h reads kv head h // group."""
    return np.repeat(x, heads // x.shape[2], axis=2)


def reference(q, k, v, g, causal, scale=None):
    """f32 attention on fake-quantized q, k, v with its gradients and the budgets' magnitudes."""
    qd, kd, vd = (fake_quant(x).astype(np.float64) for x in (q, k, v))
    heads = q.shape[2]
    kd, vd = expand_heads(kd, heads), expand_heads(vd, heads)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = np.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    l = p.sum(-1, keepdims=True)
    p = p / l  # normalized; the budgets' P|V| / l is this P times |V|
    out = np.einsum("bhqk,bkhd->bqhd", p, vd)
    mag = np.einsum("bhqk,bkhd->bqhd", p, np.abs(vd))
    tail = np.einsum("bhqk,bkhd->bqhd", 1 / np.broadcast_to(l, p.shape) * (p > 0), np.abs(vd))
    fwd = P_UNIT * mag + P_SUBNORMAL * tail + U16 * np.abs(out) + SLACK * mag
    g = np.asarray(g, np.float64)
    dv = np.einsum("bhqk,bqhd->bkhd", p, g)
    dp = np.einsum("bqhd,bkhd->bhqk", g, vd)
    delta = np.einsum("bqhd,bqhd->bhq", g, out)[..., None]
    ds = p * (dp - delta) * scale
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kd)
    dk = np.einsum("bhqk,bqhd->bkhd", ds, qd)
    # The backward's budgets, term by term (module docstring).
    e_delta = np.einsum("bqhd,bqhd->bhq", np.abs(g), fwd)[..., None] + U16 * np.abs(delta)
    e_dp = 2 * U16 * np.einsum("bqhd,bkhd->bhqk", np.abs(g), np.abs(vd))
    e_ds = abs(scale) * p * (e_dp + e_delta) + U16 * np.abs(ds)
    abs_ds = np.abs(ds)
    budgets = {
        "dq": np.einsum("bhqk,bkhd->bqhd", e_ds + U16 * abs_ds, np.abs(kd)),
        "dk": np.einsum("bhqk,bqhd->bkhd", e_ds + U16 * abs_ds, np.abs(qd)),
        "dv": 2 * U16 * np.einsum("bhqk,bqhd->bkhd", p, np.abs(g)),
    }
    magnitudes = {
        "dq": np.einsum("bhqk,bkhd->bqhd", abs_ds, np.abs(kd)),
        "dk": np.einsum("bhqk,bqhd->bkhd", abs_ds, np.abs(qd)),
        "dv": np.einsum("bhqk,bqhd->bkhd", p, np.abs(g)),
    }
    kv_heads = k.shape[2]

    def per_kv_head(x):  # the group's query heads add into their kv head
        b, t, h, d = x.shape
        return x.reshape(b, t, kv_heads, h // kv_heads, d).sum(3)

    grads = {"dq": dq, "dk": per_kv_head(dk), "dv": per_kv_head(dv)}
    for name in ("dk", "dv"):
        budgets[name], magnitudes[name] = per_kv_head(budgets[name]), per_kv_head(magnitudes[name])
    for name in grads:  # the gradient's own BF16 rounding, and f32 order
        budgets[name] = budgets[name] + U16 * np.abs(grads[name]) + SLACK * magnitudes[name]
    return out, fwd, grads, budgets


def inputs(shape_q, kv_heads, *, seed=0, case="normal"):
    """BF16 q, k, v and an output gradient; ``case`` plants outliers or an attention sink."""
    b, t, h, d = shape_q
    kq, kk, kv, kg = jax.random.split(jax.random.key(seed), 4)
    q = np.array(jax.random.normal(kq, (b, t, h, d)), np.float32)
    k = np.array(jax.random.normal(kk, (b, t, kv_heads, d)), np.float32)
    v = np.array(jax.random.normal(kv, (b, t, kv_heads, d)), np.float32)
    g = np.array(jax.random.normal(kg, (b, t, h, d)), np.float32)
    if case == "outliers":  # a few rows 100x the rest: their blocks' scales grow
        q[:, 3] *= 100.0
        k[:, 130] *= 100.0
    elif case == "sink":  # key 0 aligned with every query: it takes most of the weight
        k[:, 0] = 4.0 * np.mean(q.reshape(b, t, kv_heads, h // kv_heads, d), axis=(1, 3))
        q += 0.5 * np.abs(q)
    cast = functools.partial(jnp.asarray, dtype=jnp.bfloat16)
    return cast(q), cast(k), cast(v), cast(g)


def _value_and_vjp(f, primals, cotangent):
    """``f(*primals)`` and its VJP of ``cotangent``; jitted, one program, not one per op."""
    out, vjp = jax.vjp(f, *primals)
    return out, vjp(cotangent)


def run(q, k, v, g, causal, implementation=None):
    def f(q, k, v):
        return fp8jax.dot_product_attention(q, k, v, causal=causal, implementation=implementation)

    out, vjp = jax.vjp(f, q, k, v)
    return out, dict(zip(("dq", "dk", "dv"), vjp(g), strict=True))


def assert_within(name, got, want, budget):
    err = np.abs(np.asarray(got, np.float64) - want)
    worst = np.unravel_index(np.argmax(err - budget), err.shape)
    assert np.all(err <= budget), (
        f"{name}: |error| {err[worst]:.3g} > budget {budget[worst]:.3g} at {worst} "
        f"(value {want[worst]:.3g})"
    )


CASES = [
    # (q shape, kv heads, causal, case)
    ((1, 256, 2, 64), 2, False, "normal"),
    ((1, 256, 4, 64), 1, True, "normal"),  # GQA 4:1
    ((2, 256, 4, 128), 2, True, "normal"),  # GQA 2:1, head_dim 128
    ((1, 384, 2, 64), 1, False, "outliers"),
    ((1, 256, 4, 64), 2, True, "outliers"),
    ((1, 256, 2, 128), 1, False, "sink"),
    ((1, 256, 2, 64), 2, True, "sink"),
]


@pytest.mark.parametrize("shape, kv_heads, causal, case", CASES)
def test_forward_and_backward_within_derived_budgets(shape, kv_heads, causal, case):
    q, k, v, g = inputs(shape, kv_heads, case=case)
    out, grads = jax.jit(run, static_argnums=(4,))(q, k, v, g, causal)
    ref, budget, ref_grads, budgets = reference(q, k, v, g, causal)
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    assert_within("out", out, ref, budget)
    for name in ("dq", "dk", "dv"):
        assert_within(name, grads[name], ref_grads[name], budgets[name])


@pytest.mark.parametrize("causal", [False, True])
def test_a_negative_scale_is_within_the_derived_budgets(causal):
    """A negative scale reverses which keys a query prefers; the kernels' exp2 folds the
    scale in after the raw scores' row max, so the op negates Q instead (exact)."""
    q, k, v, g = inputs((1, 256, 2, 64), 1, case="normal")

    def f(q, k, v):
        return fp8jax.dot_product_attention(q, k, v, causal=causal, scale=-0.125)

    out, grads = jax.jit(_value_and_vjp, static_argnums=0)(f, (q, k, v), g)
    ref, budget, ref_grads, budgets = reference(q, k, v, g, causal, scale=-0.125)
    assert_within("out", out, ref, budget)
    for name, grad in zip(("dq", "dk", "dv"), grads, strict=True):
        assert_within(name, grad, ref_grads[name], budgets[name])


def test_logits_up_to_half_a_million_are_within_the_derived_budgets():
    """The docstring's range: exp2's argument is one f32 FMA against the row max, which
    keeps P's 2**8 while the max's f32 unit is small beside it (past about 10**7 not)."""
    q, k, v, g = inputs((1, 256, 2, 64), 2)
    q = (np.asarray(q, np.float32) * 1e5).astype(jnp.bfloat16)  # |logits| up to 4.9e5
    out = jax.jit(fp8jax.dot_product_attention)(q, k, v)
    ref, budget, _, _ = reference(q, k, v, g, False)
    assert_within("out", out, ref, budget)


def test_first_rows_under_causality_see_only_the_past():
    """Row 0 attends to key 0 alone: its output is v[0] up to V's E4M3 rounding and P's."""
    q, k, v, _ = inputs((1, 256, 2, 64), 1)
    # One jitted program for both calls (eagerly every op compiled on its own).
    attention = jax.jit(lambda q, k, v: fp8jax.dot_product_attention(q, k, v, causal=True))
    out = attention(q, k, v)
    v0 = fake_quant(v)[0, 0, 0]
    # p = 1 exactly: 256 is a power of two in E4M3, so only the BF16 output rounds.
    np.testing.assert_allclose(np.asarray(out[0, 0], np.float32), np.stack([v0, v0]),
                               rtol=U16, atol=0)  # fmt: skip
    # Changing a later key moves no earlier row.
    k2 = k.at[0, 200].multiply(-3.0)
    out2 = attention(q, k2, v)
    np.testing.assert_array_equal(out[:, :128], out2[:, :128])


def test_the_budget_catches_an_unscaled_p(monkeypatch):
    """P quantized without its 2**8 scale breaks the forward budget.

    One key (value 0) takes the max score; the 255 others sit 11 octaves
    below it (p = 2**-11, together ~11% of the weight, values 1). Scaled,
    their p is a normal E4M3 number; unscaled, it is below half E4M3's
    smallest subnormal (2**-10) and flushes to 0.
    """
    d, t = 64, 256
    q = np.zeros((1, t, 1, d), np.float32)
    q[..., 0] = 8.0
    k = np.zeros((1, t, 1, d), np.float32)
    k[0, 0, 0, 0] = 8.0
    k[0, 1:, 0, 0] = 8.0 - 11 * np.log(2.0)  # scores 11 ln 2 below key 0's (scale 1/8)
    v = np.ones((1, t, 1, d), np.float32)
    v[0, 0] = 0.0
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    ref, budget, _, _ = reference(q, k, v, jnp.zeros_like(q), False)
    # Jitted, each call a function of its own, so that the second traces the patched P_SCALE.
    out = jax.jit(lambda q, k, v: fp8jax.dot_product_attention(q, k, v))(q, k, v)
    assert_within("out", out, ref, budget)
    monkeypatch.setattr(kernel, "P_SCALE", 1.0)
    out = jax.jit(lambda q, k, v: fp8jax.dot_product_attention(q, k, v))(q, k, v)
    assert np.any(np.abs(np.asarray(out, np.float64) - ref) > budget)


def test_the_budget_catches_a_wrong_gqa_mapping():
    """Query head h reading kv head h % kv_heads instead of h // group breaks the budget."""
    q, k, v, g = inputs((1, 256, 4, 64), 2)
    ref, budget, _, _ = reference(q, k, v, g, False)
    swapped = jax.jit(fp8jax.dot_product_attention)(q[:, :, jnp.array([0, 2, 1, 3])], k, v)
    assert np.any(np.abs(np.asarray(swapped, np.float64)[:, :, [0, 2, 1, 3]] - ref) > budget)


def channel_outliers(shape_q, kv_heads, *, seed=0):
    """BF16 q, k, v, g with 4 of head_dim's channels of Q and K 10x the rest, at unit RMS.

    Trained models' queries and keys carry such channels; a block's E4M3
    scale then leaves the other channels few steps.
    """
    q, k, v, g = (np.asarray(x, np.float32) for x in inputs(shape_q, kv_heads, seed=seed))
    channels = np.ones(q.shape[-1], np.float32)
    channels[[3, 17, 40, 61]] = 10.0
    channels /= np.sqrt(np.mean(channels**2))
    cast = functools.partial(jnp.asarray, dtype=jnp.bfloat16)
    return cast(q * channels), cast(k * channels), cast(v), cast(g)


@pytest.mark.parametrize("d", [64, 128])
def test_hadamard_rotation_keeps_the_logits_exactly(d):
    """(Q R_q)(K R_k)ᵀ = Q Kᵀ: ±1 entries and power-of-two factors, all exact in BF16."""
    signed, q_factor, k_factor = op.hadamard_rotation(d)
    assert set(np.unique(signed)) == {-1.0, 1.0}
    np.testing.assert_array_equal(signed @ signed.T * (q_factor * k_factor), np.eye(d))
    for factor in (q_factor, k_factor):
        assert factor == 2.0 ** round(np.log2(factor))
    assert not np.array_equal(signed, op.hadamard_rotation(d, seed=1)[0])  # the signs are drawn


@pytest.mark.parametrize("causal", [True, False])
def test_hadamard_forward_and_backward_within_the_rotated_inputs_budgets(causal):
    """With ``hadamard=True`` the op is the FP8 attention of Q R_q and K R_k.

    The derived budgets (``reference``) apply to the rotated inputs, which the
    op's own rotation makes (its exactness is the test above). dq and dk go
    back through the rotation: dq = dq' R_qᵀ in f32, then one BF16 rounding,
    so their budgets are the rotated ones carried through |R_q|ᵀ.
    """
    shape, kv_heads = (1, 256, 4, 128), 2
    q, k, v, g = channel_outliers(shape, kv_heads)
    qr, kr = op._rotated(q, k)
    ref, budget, ref_grads, budgets = reference(qr, kr, v, g, causal)

    def f(q, k, v):
        return fp8jax.dot_product_attention(q, k, v, causal=causal, hadamard=True)

    out, grads = jax.jit(_value_and_vjp, static_argnums=0)(f, (q, k, v), g)
    grads = dict(zip(("dq", "dk", "dv"), grads, strict=True))
    assert_within("out", out, ref, budget)
    assert_within("dv", grads["dv"], ref_grads["dv"], budgets["dv"])
    signed, q_factor, k_factor = op.hadamard_rotation(shape[-1])
    for name, factor in (("dq", q_factor), ("dk", k_factor)):
        back = factor * ref_grads[name] @ signed.T
        carried = factor * budgets[name] @ np.abs(signed).T
        assert_within(name, grads[name], back, carried + U16 * np.abs(back))


def test_hadamard_rotation_cuts_the_fp8_error_where_channels_carry_outliers(monkeypatch):
    """Against unquantized attention, the rotation at least halves every relative error.

    Outlier channels (``channel_outliers``) leave the others about 2**-1 of
    E4M3's range in a block; the rotation spreads them over all 128 channels.
    On Gaussian inputs, which have no outliers to spread, it changes little.
    """
    shape, kv_heads = (1, 256, 4, 128), 2
    monkeypatch.setitem(globals(), "fake_quant", lambda x: np.asarray(x, np.float32))
    for case, most in (("outliers", 0.5), ("gaussian", 1.25)):
        q, k, v, g = channel_outliers(shape, kv_heads) if case == "outliers" else inputs(
            shape, kv_heads)  # fmt: skip
        want, _, want_grads, _ = reference(q, k, v, g, True)  # exact: fake_quant is patched out
        errors = {}
        for hadamard in (False, True):

            def f(q, k, v, hadamard=hadamard):
                return fp8jax.dot_product_attention(q, k, v, causal=True, hadamard=hadamard)

            out, grads = jax.jit(_value_and_vjp, static_argnums=0)(f, (q, k, v), g)
            got = dict(zip(("out", "dq", "dk", "dv"), (out, *grads), strict=True))
            errors[hadamard] = {
                name: np.linalg.norm(np.asarray(x, np.float64) - w) / np.linalg.norm(w)
                for name, x, w in zip(got, got.values(),
                                      (want, *want_grads.values()), strict=True)
            }  # fmt: skip
        for name in errors[False]:
            assert errors[True][name] <= most * errors[False][name], (case, name, errors)


REFUSALS = {
    "head-dim-96": ((1, 128, 2, 96), (1, 128, 2, 96), {}, ValueError,
                    r"head_dim must be one of \(64, 128\).*got 96"),
    "seq-200": ((1, 200, 2, 64), (1, 256, 2, 64), {}, ValueError,
                "q_seq must be a multiple of 128.*got 200"),
    "kv-heads-2-of-3": ((1, 128, 3, 64), (1, 128, 2, 64), {}, ValueError,
                        r"kv_heads \(2\) must divide heads \(3\)"),
    "causal-cross": ((1, 128, 2, 64), (1, 256, 2, 64), {"causal": True}, ValueError,
                     "causal needs q_seq == kv_seq"),
    "3-d": ((128, 2, 64), (1, 128, 2, 64), {}, ValueError, "q must be 4-D"),
    "recipe": ((1, 128, 2, 64), (1, 128, 2, 64), {"recipe": fp8jax.BlockScaling()}, TypeError,
               "recipe must be None"),
    "cudnn": ((1, 128, 2, 64), (1, 128, 2, 64), {"implementation": "cudnn"}, ValueError,
              "implementation must be one of"),
    "hadamard-str": ((1, 128, 2, 64), (1, 128, 2, 64), {"hadamard": "yes"}, TypeError,
                     "hadamard must be a bool, got 'yes'"),
    "causal-str": ((1, 128, 2, 64), (1, 128, 2, 64), {"causal": "False"}, TypeError,
                   "causal must be a bool, got 'False'"),
    "scale-nan": ((1, 128, 2, 64), (1, 128, 2, 64), {"scale": float("nan")}, ValueError,
                  "scale must be None or a finite, nonzero number.*got nan"),
    # Masked scores are -inf before the kernels scale them: at 0, NaN.
    "scale-zero": ((1, 128, 2, 64), (1, 128, 2, 64), {"scale": 0.0}, ValueError,
                   "scale must be None or a finite, nonzero number.*got 0.0"),
    # float() took these: a str from a config file, and True as 1.0.
    "scale-str": ((1, 128, 2, 64), (1, 128, 2, 64), {"scale": "0.125"}, TypeError,
                  "scale must be None or a Python number, got '0.125'."),
    "scale-bool": ((1, 128, 2, 64), (1, 128, 2, 64), {"scale": True}, TypeError,
                   "scale must be None or a Python number, got True."),
}  # fmt: skip


@pytest.mark.parametrize(
    "q_shape, k_shape, kwargs, error, match", REFUSALS.values(), ids=REFUSALS.keys()
)
def test_unsupported_arguments_are_refused_by_name(q_shape, k_shape, kwargs, error, match):
    q, k = jnp.zeros(q_shape, jnp.bfloat16), jnp.zeros(k_shape, jnp.bfloat16)
    with pytest.raises(error, match=match):
        fp8jax.dot_product_attention(q, k, k, **kwargs)


def test_a_traced_scale_is_refused_by_name():
    # The scale is static (the kernels' config); under jit as an argument it is a tracer.
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    match = r"scale must be None or a Python number \(static.*got a traced array of shape \(\)"
    with pytest.raises(TypeError, match=match):
        jax.jit(lambda s: fp8jax.dot_product_attention(q, q, q, scale=s))(0.125)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape, kv_heads, causal",
    [((2, 512, 8, 128), 2, True), ((1, 512, 4, 64), 4, False), ((1, 1024, 4, 64), 1, True)],
)
def test_kernels_on_the_gpu_within_derived_budgets(shape, kv_heads, causal):
    """The Mosaic GPU kernels (forward, dK/dV, dQ) on an H100/H200, same budgets as the twin.

    The kernels' exp2 is the GPU's approximate one (2 ulp), far inside SLACK.
    """
    q, k, v, g = inputs(shape, kv_heads, case="outliers")
    out, grads = jax.jit(run, static_argnums=(4,))(q, k, v, g, causal)
    ref, budget, ref_grads, budgets = reference(q, k, v, g, causal)
    assert_within("out", out, ref, budget)
    for name in ("dq", "dk", "dv"):
        assert_within(name, grads[name], ref_grads[name], budgets[name])
    # The kernels against their XLA twin, norm-wise: the GPU's approximate exp2 can
    # move a P across an E4M3 rounding boundary (2**-4 of that one weight), rarely.
    xla_out, xla_grads = jax.jit(run, static_argnums=(4, 5))(q, k, v, g, causal, "xla")
    pairs = [("out", out, xla_out)] + [(n, grads[n], xla_grads[n]) for n in ("dq", "dk", "dv")]
    for name, got, want in pairs:
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.linalg.norm(got - want) <= 2.0**-6 * np.linalg.norm(want), name


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape, kv_heads, causal", [((2, 512, 8, 128), 2, True), ((1, 512, 4, 64), 4, False)]
)
def test_fused_backward_on_the_gpu_within_budget_and_near_the_default(shape, kv_heads, causal):
    """``BackwardConfig(fused=True)`` on an H100/H200: the derived budgets; dK and dV the
    default's bitwise (the same products, issued alike); dQ the default's but for the
    order of its f32 sum over keys, which the CTAs' reduce-adds set.

    An f32 sum in another order moves dQ by far less than a BF16 step, so each
    element is the default's or about one BF16 step (2**-7 relative at most)
    away: norm-wise, which a sum cancelling to near zero does not upset.
    """
    from fp8jax.kernels.attention_backward import BackwardConfig

    q, k, v, g = inputs(shape, kv_heads, case="outliers")

    def grads(config):
        def f(q, k, v):
            return fp8jax.dot_product_attention(q, k, v, causal=causal, backward_config=config)

        _, vjp = jax.vjp(f, q, k, v)
        return dict(zip(("dq", "dk", "dv"), vjp(g), strict=True))

    fused = jax.jit(functools.partial(grads, BackwardConfig(fused=True)))()
    default = jax.jit(functools.partial(grads, None))()
    _, _, ref_grads, budgets = reference(q, k, v, g, causal)
    for name in ("dq", "dk", "dv"):
        assert_within(name, fused[name], ref_grads[name], budgets[name])
    for name in ("dk", "dv"):
        np.testing.assert_array_equal(fused[name], default[name], err_msg=name)
    dq, want = (np.asarray(x, np.float64) for x in (fused["dq"], default["dq"]))
    assert np.linalg.norm(dq - want) <= 2.0**-7 * np.linalg.norm(want), "dq"


# The forward kernel's builds (bench/attention.py --builds times them): the
# pipelines of issue 60, each with ping-pong, and FlashAttention-3's whole set.
GPU_BUILDS = {
    "p-registers": kernel.ForwardConfig(p_registers=True, row_scales=True),
    "in-place": kernel.ForwardConfig(pv_in_place=True, stages=3),
    "overlap": kernel.ForwardConfig(overlap=True, row_scales=True, registers=240),
    "fa3": kernel.ForwardConfig(overlap=True, pv_in_place=True, p_registers=True),
    "fa3-no-pingpong": kernel.ForwardConfig(
        overlap=True, pv_in_place=True, p_registers=True, pingpong=False
    ),
}


@pytest.mark.gpu
@pytest.mark.parametrize("build", GPU_BUILDS.values(), ids=GPU_BUILDS.keys())
@pytest.mark.parametrize(
    "shape, kv_heads, causal", [((2, 512, 8, 128), 2, True), ((1, 512, 4, 64), 4, False)]
)
def test_forward_builds_on_the_gpu_within_budget_and_near_the_default(build, shape, kv_heads,
                                                                      causal):  # fmt: skip
    """Each build's forward on an H100/H200: the derived budget, and the default's values.

    The same FP8 products and f32 softmax steps as the default; only the
    tensor cores' sums may differ: P in registers reorders keys within a
    32-key step, PV in place carries the sum across blocks in their
    accumulator (FlashAttention-3's). Against the default, elementwise: one
    BF16 rounding step (2**-8 relative) plus 2**-13 of a step's magnitudes
    per 32 keys (FP8 wgmma's accumulation, docs/design.md#grouped-expert-gemms),
    a step's magnitudes being at most max|V| (1 + 2**-4 for E4M3) as P / l
    sums to 1.
    """
    q, k, v, _ = inputs(shape, kv_heads, case="outliers")

    def forward(config):
        fn = functools.partial(fp8jax.dot_product_attention, causal=causal, forward_config=config)
        return np.asarray(jax.jit(fn)(q, k, v), np.float64)

    out, default = forward(build), forward(None)
    ref, budget, _, _ = reference(q, k, v, q, causal)
    assert_within("out", out, ref, budget)
    steps = shape[1] / 32
    v_max = np.max(np.abs(np.asarray(v, np.float64))) * (1 + 2.0**-4)
    assert_within("out vs default", out, default,
                  2.0**-8 * np.abs(default) + steps * 2.0**-13 * v_max)  # fmt: skip


@pytest.mark.parametrize(
    "fma_exp2",
    [32, pytest.param(32, marks=pytest.mark.gpu), pytest.param(128, marks=pytest.mark.gpu)],
    ids=["32", "32-gpu", "128-gpu"],
)
def test_fma_exp2_builds_within_the_derived_budgets(fma_exp2):
    """The cubic's exponentials (:mod:`fp8jax.kernels.exp2`) keep the forward in budget.

    Each P and the sum l carry at most CUBIC_ERROR relatively more: the output,
    a ratio of the two, at most twice that of its magnitude ``mag``, and the
    budget ``fwd`` holds at least ``P_UNIT * mag``. On the CPU the XLA twin
    takes the same split; on an H100/H200 (``gpu``) the kernel.
    """
    from fp8jax.kernels import exp2

    shape, kv_heads, causal = (1, 512, 4, 128), 2, True
    q, k, v, _ = inputs(shape, kv_heads, case="outliers")
    config = kernel.ForwardConfig(fma_exp2=fma_exp2)
    fn = functools.partial(fp8jax.dot_product_attention, causal=causal, forward_config=config)
    out = np.asarray(jax.jit(fn)(q, k, v), np.float64)
    ref, budget, _, _ = reference(q, k, v, q, causal)
    assert_within("out", out, ref, budget * (1 + 2 * exp2.CUBIC_ERROR / P_UNIT))

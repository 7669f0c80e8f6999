"""Every op under every recipe against an independent fake-quant reference (tests/references.py).

Values, gradients and, under DelayedScaling, the new state each op returns
(every role's amax history and next scale). The references mirror the exact
quantization, so the budgets sit near f32 roundoff (derived in
references.py): far below what an E5M2 operand in place of an E4M3 one, one
role's scale used for another, a wrong amax or a dropped margin cause.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
import references as ref

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)

RECIPES = {
    "current": fp8jax.CurrentScaling(),
    # margin 2: the scale is 4 times smaller, which moves only elements below
    # E4M3's normal range (the tiny rows of _dense_inputs) and the new states.
    "current-margin2": fp8jax.CurrentScaling(margin=2),
    "delayed-max-margin1": fp8jax.DelayedScaling(amax_history_len=4, margin=1),
    "delayed-most-recent": fp8jax.DelayedScaling(
        amax_history_len=3, amax_compute_algo="most_recent"
    ),
}


def run(fn, args: tuple, state, cotangent):
    """``(y, args' gradients, state's gradient)`` of ``fn(*args, state=state)``, under jit."""

    @jax.jit
    def step(args, state, cotangent):
        y, vjp = jax.vjp(lambda a, s: fn(*a, state=s), args, state)
        return y, *vjp(cotangent.astype(y.dtype))

    return step(args, state, cotangent)


def _setup(recipe, group, probe):
    """The state the op runs with (None for current scaling) and the reference recipe."""
    if isinstance(recipe, fp8jax.CurrentScaling):
        return None, ref.reference_recipe(recipe)
    amaxes = ref.CurrentRef()
    probe(amaxes)
    state = ref.delayed_state(recipe, fp8jax.init_state(recipe, group), amaxes.amaxes)
    return state, ref.reference_recipe(recipe, state)


# State budget: a role's amax is one element of its tensor, exact for inputs
# and cotangents, within a few f32 roundings (2**-20 relative) for a tensor
# the op computes in f32; the scale is one f32 division of it. 2**-16 relative
# is 16 times that and 2**12 times below any other tensor's amax (or a scale
# off by a margin's power of two).
STATE_RTOL = 2.0**-16


def _check_state(recipe, rec, new_state, what):
    if isinstance(recipe, fp8jax.DelayedScaling):
        ref.assert_state(new_state, rec.next_state(), STATE_RTOL, what)
    else:
        assert new_state is None


# --- dot_general, dense, einsum -------------------------------------------------------


def _dense_inputs(x_shape, n_out, dtype, seed=0):
    kx, kw, kc = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, x_shape, jnp.float32)
    # A few token rows 2**12 times smaller: scaled, they sit around E4M3's
    # smallest normal (2**-6), where the scale, not only the mantissa, decides
    # the rounding; a margin dropped or added changes their values.
    tiny = jnp.arange(math.prod(x_shape[:-1])).reshape(x_shape[:-1]) % 8 == 3
    x = jnp.where(tiny[..., None], x * 2.0**-12, x)
    w = jax.random.normal(kw, (x_shape[-1], n_out), jnp.float32) * 0.05
    c = jax.random.normal(kc, (*x_shape[:-1], n_out), jnp.float32)
    return x.astype(dtype), w.astype(dtype), c.astype(dtype)


def _check_gemms(ref_out, magnitudes, got, ks, dtypes, names):
    for r, m, g, k, dtype, name in zip(ref_out, magnitudes, got, ks, dtypes, names, strict=True):
        assert jnp.dtype(g.dtype) == jnp.dtype(dtype), (name, g.dtype)
        ref.assert_close(g, r, ref.gemm_slack(m, k, dtype, r), name)


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
@pytest.mark.parametrize(("x_shape", "dtype"), [((64, 128), F32), ((4, 16, 64), BF16)])
def test_dense_matches_fake_quant_reference(recipe, x_shape, dtype):
    x, w, c = _dense_inputs(x_shape, 48, dtype)
    dims = (((len(x_shape) - 1,), (0,)), ((), ()))
    state, rec = _setup(recipe, fp8jax.DotScaleState,
                        lambda r: ref.dot_general(x, w, dims, c, r))  # fmt: skip
    y, (dx, dw), new_state = run(lambda x, w, state: fp8jax.dense(x, w, recipe=recipe, state=state),
                                 (x, w), state, c)  # fmt: skip
    out, mags = ref.dot_general(x, w, dims, c, rec, magnitudes=True)
    k_fwd, k_bwd, k_w = x_shape[-1], 48, math.prod(x_shape[:-1])
    _check_gemms(out, mags, (y, dx, dw), (k_fwd, k_bwd, k_w), (dtype,) * 3,
                 ("forward", "dgrad", "wgrad"))  # fmt: skip
    _check_state(recipe, rec, new_state, "dense")


def test_dense_with_bias_under_delayed_scaling():
    recipe = RECIPES["delayed-max-margin1"]
    x, w, c = _dense_inputs((64, 128), 48, F32, seed=2)
    bias = jax.random.normal(jax.random.key(5), (48,))
    dims = (((1,), (0,)), ((), ()))
    state, rec = _setup(recipe, fp8jax.DotScaleState,
                        lambda r: ref.dot_general(x, w, dims, c, r))  # fmt: skip
    y, (dx, dw, db), new_state = run(
        lambda x, w, b, state: fp8jax.dense(x, w, b, recipe=recipe, state=state),
        (x, w, bias), state, c,
    )  # fmt: skip
    (ry, rdx, rdw), mags = ref.dot_general(x, w, dims, c, rec, magnitudes=True)
    _check_gemms((rdx, rdw), mags[1:], (dx, dw), (48, 64), (F32,) * 2, ("dgrad", "wgrad"))
    # The bias add rounds once more in f32.
    ry = ry + np.asarray(bias, np.float64)
    ref.assert_close(y, ry, ref.gemm_slack(mags[0], 128) + ref.F32_UNIT * np.abs(ry), "forward")
    # The bias gradient sums the cotangent in f32: 64 terms, 64 * 2**-24 of their magnitudes.
    want_db = np.asarray(c, np.float64).sum(0)
    ref.assert_close(db, want_db, 64 * 2.0**-24 * np.abs(np.asarray(c)).sum(0), "bias")
    _check_state(recipe, rec, new_state, "dense with bias")


BATCHED = (((2,), (0,)), ((0,), (1,)))  # x (b, s, k) . w (k, b, n) -> (b, s, n)


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
def test_batched_dot_general_matches_fake_quant_reference(recipe):
    kx, kw, kc = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(kx, (3, 16, 32))
    w = jax.random.normal(kw, (32, 3, 8)) * 0.1
    c = jax.random.normal(kc, (3, 16, 8))
    state, rec = _setup(recipe, fp8jax.DotScaleState,
                        lambda r: ref.dot_general(x, w, BATCHED, c, r))  # fmt: skip
    y, (dx, dw), new_state = run(
        lambda x, w, state: fp8jax.dot_general(x, w, BATCHED, recipe=recipe, state=state),
        (x, w), state, c,
    )  # fmt: skip
    out, mags = ref.dot_general(x, w, BATCHED, c, rec, magnitudes=True)
    _check_gemms(out, mags, (y, dx, dw), (32, 8, 16), (F32,) * 3, ("forward", "dgrad", "wgrad"))
    _check_state(recipe, rec, new_state, "dot_general")


EINSUMS = [
    ("...d,dhk->...hk", "bsd,dhk->bshk", (2, 8, 32), (32, 4, 8)),
    ("...hk,hkd->...d", "bshk,hkd->bsd", (2, 8, 4, 8), (4, 8, 32)),
    ("ebd,edf->ebf", "ebd,edf->ebf", (3, 8, 32), (3, 32, 16)),
    ("bd,hdk->bhk", "bd,hdk->bhk", (8, 32), (4, 32, 8)),
]


def _terms(np_spec, x_shape, w_shape):
    """Terms per output of each GEMM: forward, dgrad (x's gradient), wgrad."""
    (xl, wl), out = np_spec.split("->")[0].split(","), np_spec.split("->")[1]
    size = dict(zip(xl, x_shape, strict=True)) | dict(zip(wl, w_shape, strict=True))
    prod = lambda labels: math.prod(size[c] for c in labels)  # noqa: E731
    return (prod(c for c in xl if c in wl and c not in out),
            prod(c for c in wl if c in out and c not in xl),
            prod(c for c in xl if c in out and c not in wl))  # fmt: skip


@pytest.mark.parametrize("recipe", [RECIPES["current"], RECIPES["delayed-max-margin1"]],
                         ids=["current", "delayed"])  # fmt: skip
@pytest.mark.parametrize(("spec", "np_spec", "x_shape", "w_shape"), EINSUMS)
def test_einsum_matches_fake_quant_reference(recipe, spec, np_spec, x_shape, w_shape):
    kx, kw, kc = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, x_shape)
    w = jax.random.normal(kw, w_shape) * 0.1
    f = lambda a, b: jnp.einsum(np_spec, a, b, precision="highest")  # noqa: E731
    c = jax.random.normal(kc, jax.eval_shape(f, x, w).shape)
    state, rec = _setup(recipe, fp8jax.DotScaleState, lambda r: ref.dot_general(x, w, f, c, r))
    y, (dx, dw), new_state = run(
        lambda x, w, state: fp8jax.einsum(spec, x, w, recipe=recipe, state=state), (x, w), state, c
    )
    out, mags = ref.dot_general(x, w, f, c, rec, magnitudes=True)
    _check_gemms(out, mags, (y, dx, dw), _terms(np_spec, x_shape, w_shape), (F32,) * 3,
                 ("forward", "dgrad", "wgrad"))  # fmt: skip
    _check_state(recipe, rec, new_state, spec)


# --- layernorm_dense: the norms ---------------------------------------------------------

NORMS = [("layernorm", False), ("rmsnorm", False), ("layernorm", True), ("rmsnorm", True)]
FUSED_RECIPES = {"current": RECIPES["current"], "delayed": RECIPES["delayed-max-margin1"]}

# Budgets of the fused ops, normwise relative to the reference.
# The normalized input, the activation and the gradients the op computes
# itself differ from the reference's by f32 roundoff (2**-24 per operation,
# a few dozen operations and sums over at most 128 terms: about 2**-16). Now
# and then that moves an element across an FP8 rounding boundary, a change
# of one FP8 step (2**-3 of it, E4M3) in one of T x F elements: normwise
# 2**-3 / sqrt(T F) <= 2**-10 for the 128 x 128 tensors here. 2**-8 allows
# a few such flips; an E5M2 operand in an E4M3 role alone errs by about
# 2**-3 / sqrt(3) ~ 2**-3.8 normwise, 2**4.2 times the budget, a wrong scale
# or saturation by far more.
FUSED_RTOL = 2.0**-8


def _norm_inputs(norm_type, hidden, rows, seed=0):
    kg, kb, kx = jax.random.split(jax.random.key(seed), 3)
    gamma = 1.0 + 0.3 * jax.random.normal(kg, (hidden,))
    beta = 0.2 * jax.random.normal(kb, (hidden,)) if norm_type == "layernorm" else None
    x = 2.0 * jax.random.normal(kx, (rows, hidden)) + 0.5
    return x, gamma, beta


def _check_relative(got: dict, want: dict, rtol, what):
    assert got.keys() == want.keys(), (what, got.keys(), want.keys())
    for name, value in want.items():
        err = ref.relative_error(got[name], value)
        assert err <= rtol, f"{what}: {name} is {err:.3g} from the reference, over {rtol:.3g}"


@pytest.mark.parametrize("recipe", FUSED_RECIPES.values(), ids=FUSED_RECIPES.keys())
@pytest.mark.parametrize(("norm_type", "zero_centered"), NORMS)
def test_layernorm_dense_matches_fake_quant_reference(recipe, norm_type, zero_centered):
    # 128 x 128: the shapes the norm kernel takes (on the CPU, its XLA twin).
    x, gamma, beta = _norm_inputs(norm_type, 128, 128)
    kernel = 0.1 * jax.random.normal(jax.random.key(9), (128, 40))
    bias = 0.1 * jax.random.normal(jax.random.key(8), (40,))
    c = jax.random.normal(jax.random.key(10), (128, 40))
    kw = dict(norm_type=norm_type, zero_centered_gamma=zero_centered)
    rkw = dict(norm_type=norm_type, zero_centered=zero_centered)

    def probe(r):
        return ref.layernorm_dense(x, gamma, beta, kernel, bias, c, r, **rkw)

    state, rec = _setup(recipe, fp8jax.DotScaleState, probe)

    def op(x, gamma, beta, kernel, bias, state):
        return fp8jax.layernorm_dense(x, gamma, beta, kernel, bias, recipe=recipe, state=state,
                                      **kw)  # fmt: skip

    y, grads, new_state = run(op, (x, gamma, beta, kernel, bias), state, c)
    want_y, want = probe(rec)
    names = ("x", "gamma", "beta", "kernel", "bias")
    got = {n: g for n, g in zip(names, grads, strict=True) if g is not None}
    _check_relative({"y": y, **got}, {"y": want_y, **want}, FUSED_RTOL, norm_type)
    _check_state(recipe, rec, new_state, "layernorm_dense")


# --- layernorm_mlp: every activation ------------------------------------------------------

ACTIVATIONS = [("gelu", "linear"), ("silu", "linear"), ("relu", "linear"), ("gelu",),
               ("gelu_tanh",), ("relu",), ("silu",), ("linear",)]  # fmt: skip
# 128 tokens x 128 hidden x 128 ffn: whole tiles of the activation and cast
# kernels (their XLA twins on the CPU); 48 x 64 x 80: XLA's own path.
SHAPES = {"kernel-tiles": (128, 128, 128), "xla-path": (48, 64, 80)}


def _mlp_inputs(activations, shape, dtype, seed=0):
    tokens, hidden, ffn = shape
    keys = jax.random.split(jax.random.key(seed), 5)
    x, gamma, beta = _norm_inputs("layernorm", hidden, tokens, seed)
    n = len(activations)
    k1 = jax.random.normal(keys[0], (hidden, n, ffn)) / math.sqrt(hidden)
    k2 = jax.random.normal(keys[1], (ffn, hidden)) / math.sqrt(ffn)
    b1 = 0.2 * jax.random.normal(keys[2], (n, ffn))
    b2 = 0.1 * jax.random.normal(keys[3], (hidden,))
    c = jax.random.normal(keys[4], (tokens, hidden))
    cast = lambda *a: tuple(v.astype(dtype) for v in a)  # noqa: E731
    return (*cast(x), gamma, beta, *cast(k1, k2), b1, b2, *cast(c))


def _mlp_case(activations, recipe, shape, dtype, rtol, state_rtol, seed=0):
    x, gamma, beta, k1, k2, b1, b2, c = _mlp_inputs(activations, shape, dtype, seed)

    def probe(r):
        return ref.layernorm_mlp(x, gamma, beta, k1, k2, b1, b2, c, r, activations=activations)

    state, rec = _setup(recipe, fp8jax.MlpScaleState, probe)

    def op(x, gamma, beta, k1, k2, b1, b2, state):
        return fp8jax.layernorm_mlp(x, gamma, beta, k1, k2, b1, b2, activations=activations,
                                    recipe=recipe, state=state)  # fmt: skip

    y, grads, new_state = run(op, (x, gamma, beta, k1, k2, b1, b2), state, c)
    want_y, want, _ = probe(rec)
    names = ("x", "gamma", "beta", "kernel_1", "kernel_2", "bias_1", "bias_2")
    got = dict(zip(names, grads, strict=True))
    assert y.dtype == grads[0].dtype == dtype
    _check_relative({"y": y, **got}, {"y": want_y, **want}, rtol, "/".join(activations))
    if isinstance(recipe, fp8jax.DelayedScaling):
        ref.assert_state(new_state, rec.next_state(), state_rtol, "layernorm_mlp")


# Under delayed scaling every activation on the kernels' path (their XLA
# twins on the CPU); the other paths (XLA's recompute with a stored scale,
# current scaling's stored activation) with a few.
MLP_CASES = [*((a, "delayed", "kernel-tiles") for a in ACTIVATIONS),
             (("gelu", "linear"), "delayed", "xla-path"), (("gelu_tanh",), "delayed", "xla-path"),
             (("linear",), "delayed", "xla-path"), (("gelu", "linear"), "current", "kernel-tiles"),
             (("silu",), "current", "kernel-tiles"), (("gelu",), "current", "xla-path"),
             (("relu", "linear"), "current", "xla-path")]  # fmt: skip


@pytest.mark.parametrize(("activations", "recipe", "shape"), MLP_CASES,
                         ids=["/".join(a) + f"-{r}-{s}" for a, r, s in MLP_CASES])  # fmt: skip
def test_layernorm_mlp_matches_fake_quant_reference(activations, recipe, shape):
    _mlp_case(activations, FUSED_RECIPES[recipe], SHAPES[shape], F32, FUSED_RTOL, STATE_RTOL)


@pytest.mark.parametrize("recipe", FUSED_RECIPES.values(), ids=FUSED_RECIPES.keys())
def test_bf16_layernorm_mlp_matches_fake_quant_reference(recipe):
    # In bf16 the op stores the pre-activation and the activation rounded to
    # bf16, as the reference does, but XLA may drop a bf16 round trip and
    # feed the activation the f32 product: pre is then known only to 2**-8
    # of itself, which moves the FP8 rounding of about 2**-8 / 2**-4 = 1/16
    # of h's elements by one step (2**-3 of an element), normwise about
    # 2**-3 sqrt(1/16) / sqrt(3) ~ 2**-5.8; under current scaling h's amax,
    # and with it every element's scale, may move by a bf16 step too. So
    # 2**-5 here, and 2**-7 (one bf16 step and a half) for the amaxes. An
    # E5M2 activation still errs by 2**-3 / sqrt(3) ~ 2**-3.8 normwise.
    _mlp_case(("gelu", "linear"), recipe, SHAPES["kernel-tiles"], BF16, 2.0**-5, 2.0**-7)

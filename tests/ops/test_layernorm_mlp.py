"""fp8jax.layernorm_mlp: f32 and fake-quant references with derived budgets, its kernels, errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.verify.jaxpr_dots import jaxpr_dots
from fused_cases import (
    RECIPES,
    _params,
    ref_norm,
)
from numerics import (
    assert_within,
    current_scale,
    fake_quant_einsum,
    gemm_error_bound,
    relative_error,
)

TOKENS, HIDDEN, FFN = 1024, 256, 1024


def test_gelu_stays_within_f32_rounding_of_the_exact_definition():
    # fused.gelu writes Phi through erf where jax.nn.gelu uses erfc. Bound:
    # 4 f32 ulps of max(|x|, 1): a couple for x * (1 + erf) * 0.5's own
    # roundings, a couple for XLA's erf polynomial (about 1 ulp of 1), which
    # 1 + erf turns into an absolute error on the negative side.

    from fp8jax.activations import gelu

    x = np.linspace(-12, 12, 48001, dtype=np.float32)
    exact = np.array([v * 0.5 * math.erfc(-v / math.sqrt(2)) for v in x.astype(np.float64)])
    slope = np.array(
        [0.5 * math.erfc(-v / math.sqrt(2)) + v * math.exp(-v * v / 2) / math.sqrt(2 * math.pi)
         for v in x.astype(np.float64)]
    )  # fmt: skip
    ulps = 4 * 2.0**-23 * np.maximum(np.abs(x), 1)
    value = np.asarray(jax.jit(gelu)(x), np.float64)
    grad = np.asarray(jax.jit(jax.vmap(jax.grad(gelu)))(x), np.float64)
    assert np.all(np.abs(value - exact) <= ulps)
    assert np.all(np.abs(grad - slope) <= ulps)


ACTIVATIONS = [
    ("gelu", "linear"),
    ("silu", "linear"),
    ("relu", "linear"),
    ("gelu_tanh", "linear"),
    ("gelu",),
    ("relu",),
    ("silu",),
    ("linear",),
]
# Largest |derivative| of each activation (gelu: 1.129 at x ~ 2.4; silu:
# 1.0998 at x ~ 2.4); they carry the first GEMM's error into the second.
LIPSCHITZ = {"gelu": 1.13, "gelu_tanh": 1.13, "silu": 1.1, "relu": 1.0, "linear": 1.0}
NP_ACT = {
    "gelu": lambda v: jax.nn.gelu(v, approximate=False),
    "gelu_tanh": lambda v: jax.nn.gelu(v, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "linear": lambda v: v,
}


def _mlp_inputs(n_act, hidden=32, ffn=64, dtype=jnp.float32):
    x, gamma, beta = _params("layernorm", hidden, dtype, seed=4)
    k1 = (jax.random.normal(jax.random.key(5), (hidden, n_act, ffn)) / hidden**0.5).astype(dtype)
    k2 = (jax.random.normal(jax.random.key(6), (ffn, hidden)) / ffn**0.5).astype(dtype)
    return x, gamma, beta, k1, k2


def _ref_mlp(x, gamma, beta, k1, k2, activations, einsum=jnp.einsum):
    n = ref_norm(x, gamma, beta, "layernorm", False)
    pre = einsum("th,haf->taf", n, k1.astype(jnp.float32))
    h = NP_ACT[activations[0]](pre[:, 0])
    for i, name in enumerate(activations[1:], start=1):
        h = h * NP_ACT[name](pre[:, i])
    return einsum("tf,fo->to", h, k2.astype(jnp.float32))


@pytest.mark.parametrize("activations", ACTIVATIONS, ids="-".join)
def test_layernorm_mlp_forward_within_propagated_fp8_bound(activations):
    x, gamma, beta, k1, k2 = _mlp_inputs(len(activations))
    mlp = jax.jit(fp8jax.layernorm_mlp, static_argnames="activations")  # one program, not per op
    y = mlp(x, gamma, beta, k1, k2, activations=activations)
    n = np.asarray(ref_norm(x, gamma, beta, "layernorm", False), np.float64)
    k1s, k2s = np.asarray(k1, np.float64), np.asarray(k2, np.float64)
    pre = np.einsum("th,haf->taf", n, k1s)
    pre_bound = gemm_error_bound(
        n,
        k1s,
        "e4m3",
        "e4m3",
        current_scale(n, "e4m3"),
        current_scale(k1s, "e4m3"),
        "th,haf->taf",
        jnp.float32,
    ) + 2.0**-18 * np.einsum("th,haf->taf", np.abs(n), np.abs(k1s))
    acts = [
        np.asarray(NP_ACT[a](jnp.asarray(pre[:, i], jnp.float32)), np.float64)
        for i, a in enumerate(activations)
    ]
    errs = [LIPSCHITZ[a] * pre_bound[:, i] for i, a in enumerate(activations)]
    h, h_bound = acts[0], errs[0]
    if len(activations) == 2:
        # |ab - a'b'| <= |a||db| + |b||da| + |da||db|
        h, h_bound = (
            h * acts[1],
            (np.abs(acts[0]) * errs[1] + np.abs(acts[1]) * errs[0] + errs[0] * errs[1]),
        )
    h_bound = h_bound + 2.0**-20 * np.abs(h)  # f32 activation arithmetic
    h_scale = 448.0 / (np.abs(h).max() + h_bound.max())
    y_bound = gemm_error_bound(
        h,
        k2s,
        "e4m3",
        "e4m3",
        h_scale,
        current_scale(k2s, "e4m3"),
        "tf,fo->to",
        jnp.float32,
        a_error=h_bound,
    )
    assert_within(y, h @ k2s, y_bound, "mlp forward")


@pytest.mark.parametrize(
    "activations", [("gelu", "linear"), ("silu", "linear"), ("relu",)], ids="-".join
)
def test_layernorm_mlp_gradients_match_fake_quant_and_f32(activations):
    x, gamma, beta, k1, k2 = _mlp_inputs(len(activations))
    r = jax.random.normal(jax.random.key(8), (48, 32))

    def loss(x, gamma, beta, k1, k2):
        return jnp.sum(fp8jax.layernorm_mlp(x, gamma, beta, k1, k2, activations=activations) * r)

    def emulated(x, gamma, beta, k1, k2):
        return jnp.sum(_ref_mlp(x, gamma, beta, k1, k2, activations, fake_quant_einsum) * r)

    def exact(x, gamma, beta, k1, k2):
        return jnp.sum(
            _ref_mlp(
                x,
                gamma,
                beta,
                k1,
                k2,
                activations,
                lambda s, a, b: jnp.einsum(s, a, b, precision="highest"),
            )
            * r
        )

    # Each gradient one jitted program: eagerly every step compiled on its own (156 CPU
    # compiles for the first case), and the bounds below hold for either.
    args = (x, gamma, beta, k1, k2)
    got, fake, ref = (jax.jit(jax.grad(f, argnums=range(5)))(*args)
                      for f in (loss, emulated, exact))  # fmt: skip
    for name, g, f, e in zip(["dx", "dgamma", "dbeta", "dk1", "dk2"], got, fake, ref, strict=True):
        # Same arithmetic as the emulation: only f32 roundoff (about 2**-16
        # after a few dozen operations and 64-term sums) and the rare FP8
        # flip it causes, one step (2**-3 of an element) in one of 48 x 64
        # elements, normwise 2**-3 / sqrt(48 * 64) ~ 2**-8.8 each. 2**-8
        # allows one such flip; an E5M2 operand where E4M3 belongs errs by
        # about 2**-3 / sqrt(3) ~ 2**-3.8 normwise.
        assert relative_error(g, f) < 2.0**-8, name
        # Against exact f32: the gradient passes through at most three FP8
        # GEMMs with an E5M2 operand. Independent rounding errors give each a
        # relative error near sqrt(u5**2 + u4**2) / sqrt(3) = 0.08; allow the
        # three to add up.
        assert relative_error(g, e) < 3 * 0.081, name


def test_llama_shape_swiglu_traces_six_fp8_gemms():
    # hidden 4096, ffn 11008, SwiGLU: traced abstractly, nothing is allocated.
    x = jax.ShapeDtypeStruct((2, 128, 4096), jnp.bfloat16)
    gamma = jax.ShapeDtypeStruct((4096,), jnp.float32)
    k1 = jax.ShapeDtypeStruct((4096, 2, 11008), jnp.float32)
    k2 = jax.ShapeDtypeStruct((11008, 4096), jnp.float32)

    def loss(x, gamma, k1, k2):
        y = fp8jax.layernorm_mlp(
            x, gamma, None, k1, k2, activations=("silu", "linear"), norm_type="rmsnorm"
        )
        return jnp.sum(y.astype(jnp.float32))

    dots = jaxpr_dots(jax.grad(loss, argnums=(0, 1, 2, 3)), x, gamma, k1, k2)
    assert len(dots) == 6 and all(d.is_fp8 for d in dots)
    assert sorted(d.operand_formats for d in dots).count(("float8_e5m2", "float8_e5m2")) == 0


@pytest.mark.parametrize(
    "recipe", [fp8jax.CurrentScaling(), fp8jax.DelayedScaling(amax_history_len=4)], ids=repr
)
def test_jaxpr_dot_counts(recipe):
    x, gamma, beta, k1, k2 = _mlp_inputs(2)
    mlp_state = fp8jax.init_state(recipe, fp8jax.MlpScaleState)
    dense_state = fp8jax.init_state(recipe)

    def mlp_loss(x, k1, k2, state):
        return jnp.sum(fp8jax.layernorm_mlp(x, gamma, beta, k1, k2, recipe=recipe, state=state))

    def ln_dense_loss(x, k1, state):
        return jnp.sum(fp8jax.layernorm_dense(x, gamma, beta, k1, recipe=recipe, state=state))

    mlp = jaxpr_dots(jax.grad(mlp_loss, argnums=(0, 1, 2, 3)), x, k1, k2, mlp_state)
    ln_dense = jaxpr_dots(jax.grad(ln_dense_loss, argnums=(0, 1, 2)), x, k1, dense_state)
    assert len(mlp) == 6 and all(d.is_fp8 for d in mlp)
    assert [d.operand_formats for d in ln_dense] == [
        ("float8_e4m3fn", "float8_e4m3fn"),
        ("float8_e5m2", "float8_e4m3fn"),
        ("float8_e4m3fn", "float8_e5m2"),
    ]


def test_delayed_state_of_mlp_updates_every_tensor():
    recipe = fp8jax.DelayedScaling(amax_history_len=4)
    state = fp8jax.init_state(recipe, fp8jax.MlpScaleState)
    x, gamma, beta, k1, k2 = _mlp_inputs(2)
    grads = jax.jit(jax.grad(  # one program, as the tests above
        lambda s: jnp.sum(fp8jax.layernorm_mlp(x, gamma, beta, k1, k2, recipe=recipe, state=s))
    ))(state)  # fmt: skip
    new = jax.jit(fp8jax.take_new_state)(state, grads)
    for leaf in jax.tree.leaves(new, is_leaf=lambda n: isinstance(n, fp8jax.ScaleState)):
        assert float(leaf.amax_history[0]) > 0 and float(leaf.scale) != 1.0


_X = jnp.ones((4, 32))
_G = jnp.ones((32,))
_K1 = jnp.ones((32, 2, 64))
_K2 = jnp.ones((64, 32))


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda: fp8jax.layernorm_mlp(_X, _G, None, _K1, _K2, activations=("gelu", "swish")),
            ValueError,
            r"activations must be one or two names from \['gelu', 'gelu_tanh', 'linear', "
            r"'relu', 'silu'\].*got \('gelu', 'swish'\)",
        ),
        (
            lambda: fp8jax.layernorm_mlp(_X, _G, None, _K1, _K2, activations=("gelu",)),
            ValueError,
            r"kernel_1 must have shape \(hidden=32, len\(activations\)=1, ffn\), "
            r"got \(32, 2, 64\)",
        ),
        (
            lambda: fp8jax.layernorm_mlp(jnp.ones((4, 16)), jnp.ones(16), None, _K1, _K2),
            ValueError,
            r"kernel_1 must have shape \(hidden=16",
        ),
        (
            lambda: fp8jax.layernorm_mlp(_X, _G, None, _K1, jnp.ones((63, 32))),
            ValueError,
            r"kernel_2 must have shape \(ffn=64, hidden_out\), got \(63, 32\)",
        ),
        (
            lambda: fp8jax.layernorm_mlp(_X, _G, None, _K1, _K2, epsilon=0.0),
            ValueError,
            "epsilon must be a number > 0, got 0.0",
        ),
        (
            lambda: fp8jax.layernorm_dense(_X, _G, None, jnp.ones((16, 8))),
            ValueError,
            r"kernel must have shape \(hidden=32, \*features\), got \(16, 8\)",
        ),
        (
            lambda: fp8jax.layernorm_dense(_X, _G, None, jnp.ones((32, 4, 8)), split=(2, 1)),
            ValueError,
            r"split must be positive integers summing to the output's axis -2 \(4\), got \(2, 1\)",
        ),
        (
            lambda: fp8jax.dense(_X, jnp.ones((32, 4, 8)), split=(3, 2)),
            ValueError,
            r"split must be positive integers summing to the output's axis -2 \(4\), got \(3, 2\)",
        ),
        (  # True is an int to Python, not a size
            lambda: fp8jax.dense(_X, jnp.ones((32, 4, 8)), split=(True, 3)),
            ValueError,
            r"split must be positive integers summing to .* got \(True, 3\)",
        ),
        (
            lambda: fp8jax.layernorm_dense(_X, _G, None, jnp.ones((32, 8)), split=(4, 4)),
            ValueError,
            r"split_axis must name one of the output's 1 feature axes, counted from the end "
            r"\(-1 to -1\), got -2",
        ),
        (
            lambda: fp8jax.layernorm_mlp(
                _X,
                _G,
                None,
                _K1,
                _K2,
                recipe=fp8jax.DelayedScaling(amax_history_len=2),
                state=fp8jax.init_state(fp8jax.DelayedScaling(amax_history_len=2)),
            ),
            TypeError,
            r"state must be a MlpScaleState from fp8jax.init_state\(recipe, MlpScaleState\)",
        ),
    ],
)
def test_bad_input_is_explained(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_live_mlp_step_transposes_fp8_only_with_tiled_kernels(recipe):
    # Before the forward kernel became an explicit matrix transpose
    # (ops.gemm.as_kernel_matrices), XLA relayouted both GeGLU kernels with untiled kLoop
    # transposes at ~0.3 TB/s on the H200 (jaxlib 0.11.2; docs/design.md).
    # Shapes are the benchmark's, scaled down 4x in each dimension.
    from fp8jax import verify

    tokens, hidden, ffn = 4096, 1024, 4096
    x = jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16)
    gamma = jax.ShapeDtypeStruct((hidden,), jnp.float32)
    k1 = jax.ShapeDtypeStruct((hidden, 2, ffn), jnp.bfloat16)
    k2 = jax.ShapeDtypeStruct((ffn, hidden), jnp.bfloat16)
    state = fp8jax.init_state(recipe, fp8jax.MlpScaleState)

    def loss(x, gamma, k1, k2, state):
        y = fp8jax.layernorm_mlp(x, gamma, gamma, k1, k2, recipe=recipe, state=state)
        return jnp.sum(y.astype(jnp.float32))

    step = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
    hlo = verify.compile_for(step, x, gamma, k1, k2, state, target="live")
    relayouts = verify.fp8_relayouts(hlo)
    assert relayouts, "expected the wgrad transposes of the activations at least"
    assert [r for r in relayouts if r.untiled_transpose] == []

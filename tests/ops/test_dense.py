"""fp8jax.dot_general / dense: numerics against f32, jaxpr structure, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
import references as ref
from fp8jax.verify.jaxpr_dots import jaxpr_dots
from numerics import assert_within, current_scale, gemm_error_bound

E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


def _inputs(x_shape, dtype, seed=0):
    kx, kw, kr = jax.random.split(jax.random.key(seed), 3)
    # Spread magnitudes over a few binades so the subnormal and saturation
    # paths of the bound both matter.
    x = jax.random.normal(kx, x_shape, jnp.float32) * jnp.exp2(
        jax.random.randint(kx, x_shape, -3, 3).astype(jnp.float32)
    )
    w = jax.random.normal(kw, (x_shape[-1], 48), jnp.float32) * 0.05
    r = jax.random.normal(kr, (*x_shape[:-1], 48), jnp.float32)
    return x.astype(dtype), w.astype(dtype), r.astype(dtype)


def _letters(ndim):
    return "abcdefg"[: ndim - 1]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("x_shape", [(32, 64), (4, 16, 64)])
def test_dense_forward_and_gradients_within_fp8_bound(dtype, x_shape):
    x, w, r = _inputs(x_shape, dtype)

    def loss(x, w):
        return jnp.sum((fp8jax.dense(x, w) * r).astype(jnp.float32))

    # One jitted program each: eagerly every step of the op compiled on its own.
    y = jax.jit(fp8jax.dense)(x, w)
    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    assert y.dtype == dx.dtype == dw.dtype == dtype

    xs, ws, gs = (np.asarray(v, np.float64) for v in (x, w, r))
    b = _letters(len(x_shape))
    sx, sw, sg = current_scale(xs, "e4m3"), current_scale(ws, "e4m3"), current_scale(gs, "e5m2")
    fwd, dgrad, wgrad = f"{b}k,kn->{b}n", f"{b}n,kn->{b}k", f"{b}k,{b}n->kn"
    assert_within(
        y,
        np.einsum(fwd, xs, ws),
        gemm_error_bound(xs, ws, "e4m3", "e4m3", sx, sw, fwd, dtype),
        "forward",
    )
    assert_within(
        dx,
        np.einsum(dgrad, gs, ws),
        gemm_error_bound(gs, ws, "e5m2", "e4m3", sg, sw, dgrad, dtype),
        "dgrad",
    )
    assert_within(
        dw,
        np.einsum(wgrad, xs, gs),
        gemm_error_bound(xs, gs, "e4m3", "e5m2", sx, sg, wgrad, dtype),
        "wgrad",
    )


# The elementwise bounds above are worst-case, loose enough to pass an E5M2
# operand too. Normwise the error is statistical: rounding to a format with
# unit roundoff u errs uniformly within half a spacing, so for mantissas m
# spread log-uniformly over [1, 2) its relative RMS is
# u sqrt(E[1/m**2] / 3) = u sqrt(0.541 / 3) = 0.425 u, and a dot product of
# two independently rounded operands errs by sqrt(2) of that normwise:
# 0.0375 for E4M3 x E4M3 (u = 2**-4), but sqrt(0.053**2 + 0.0265**2) = 0.059
# with one E5M2 operand (u = 2**-3). Over hundreds of outputs the measured
# error sits within a few percent of its mean; 0.045 allows 20%.
TYPICAL_E4M3_DOT_ERROR = 0.045


def test_dense_is_not_merely_bounded_but_close():
    x, w, _ = _inputs((256, 64), jnp.float32)
    y = np.asarray(jax.jit(fp8jax.dense)(x, w), np.float64)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < TYPICAL_E4M3_DOT_ERROR


def test_delayed_scaling_uses_state_scales_within_bound():
    """The second step quantizes at the scales the first step stored, not at its own amaxes.

    Step two's x and w are 0.6 and 0.7 times step one's, so their own amaxes
    would give scales off the stored ones by factors that are not powers of
    two: most elements would round to another FP8 value, against a slack near
    f32 roundoff around the fake-quant reference at the stored scales
    (references.gemm_slack). Step one's x and w alone would give the stored
    scales again, which could not tell the two apart.
    """
    recipe = fp8jax.DelayedScaling(amax_history_len=4)
    state = fp8jax.init_state(recipe)
    x, w, r = _inputs((64, 64), jnp.float32, seed=3)

    def loss(x, w, state):
        return jnp.sum(fp8jax.dense(x, w, recipe=recipe, state=state) * r)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, state)  # one program, not per op
    state = jax.jit(fp8jax.take_new_state)(state, grads[2])
    xs, ws = np.asarray(x, np.float64), np.asarray(w, np.float64)
    assert float(state.x.scale) == pytest.approx(448.0 / np.abs(xs).max(), rel=1e-6)
    assert float(state.kernel.scale) == pytest.approx(448.0 / np.abs(ws).max(), rel=1e-6)
    # Second step: quantizes with the scales learned from step one.
    x2, w2 = 0.6 * x, 0.7 * w
    y = jax.jit(lambda x, w, s: fp8jax.dense(x, w, recipe=recipe, state=s))(x2, w2, state)
    xq = ref.fake_quant(x2, "e4m3", np.float32(state.x.scale)).astype(np.float64)
    wq = ref.fake_quant(w2, "e4m3", np.float32(state.kernel.scale)).astype(np.float64)
    slack = ref.gemm_slack(np.abs(xq) @ np.abs(wq), 64)
    ref.assert_close(y, xq @ wq, slack, "delayed forward at the stored scales")


@pytest.mark.parametrize(
    "recipe", [fp8jax.CurrentScaling(), fp8jax.DelayedScaling(amax_history_len=8)], ids=repr
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_jaxpr_has_exactly_three_fp8_dots_per_dense(recipe, dtype):
    x, w, _ = _inputs((4, 16, 64), dtype)
    state = fp8jax.init_state(recipe)

    def loss(x, w, state):
        return jnp.sum(fp8jax.dense(x, w, recipe=recipe, state=state).astype(jnp.float32))

    dots = jaxpr_dots(jax.grad(loss, argnums=(0, 1, 2)), x, w, state)
    assert [d.operand_formats for d in dots] == [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]
    assert [d.out_dtype for d in dots] == [jnp.dtype(dtype).name] * 3


# cuBLASLt's FP8 GEMM needs the kernel's contracting axis minor. fp8jax transposes the kernel
# in the program, as a (free, contracting) matrix, because XLA's own transpose of it is an
# untiled kernel at ~0.3 TB/s on the H200 (docs/design.md). Only where the kernel is
# whole on each device: under a sharding mesh the view costs collectives.
def _forward_kernel_operand(fn, *args):
    """The forward GEMM's kernel operand as the jaxpr hands it to XLA: (shape, contracting)."""
    forward = jaxpr_dots(fn, *args)[0]
    return forward.rhs_shape, forward.rhs_contracting


def test_forward_kernel_is_a_transposed_matrix_without_a_mesh():
    x = jnp.ones((4, 8, 64), jnp.bfloat16)
    assert _forward_kernel_operand(fp8jax.dense, x, jnp.ones((64, 2, 24), jnp.bfloat16)) == (
        (48, 64),
        (1,),
    )
    # Several contracted axes merge too (an attention output projection: heads, head_dim).
    out = lambda h, k: fp8jax.dense(h, k, contracting_dims=((2, 3), (0, 1)))  # noqa: E731
    h = jnp.ones((8, 16, 4, 32), jnp.bfloat16)
    assert _forward_kernel_operand(out, h, jnp.ones((4, 32, 64), jnp.bfloat16)) == (
        (64, 128),
        (1,),
    )


def test_forward_kernel_is_left_to_xla_under_a_sharding_mesh():
    import fp8jax.sharding as fs

    x = jnp.ones((8, 8, 64), jnp.bfloat16)
    with fs.use_mesh(fs.make_mesh(tp=8)):
        # (2, 24) split by tensor parallelism on 24 would not be a block sharding once merged.
        three_d = _forward_kernel_operand(fp8jax.dense, x, jnp.ones((64, 2, 24), jnp.bfloat16))
    with fs.use_mesh(fs.make_mesh(fsdp=8)):
        # Under FSDP the transposed copy would be all-gathered apart from the backward's.
        matrix = _forward_kernel_operand(fp8jax.dense, x, jnp.ones((64, 48), jnp.bfloat16))
    assert three_d == ((64, 2, 24), (0,))
    assert matrix == ((64, 48), (0,))


def test_forward_kernel_axes_are_merged_inside_shard_map():
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    per_device = jax.shard_map(
        fp8jax.dense,
        mesh=mesh,
        in_specs=(P(), P(None, None, "tp")),
        out_specs=P(None, None, None, "tp"),
    )
    x = jnp.ones((4, 8, 64), jnp.bfloat16)
    # Each device holds (64, 2, 3): its local kernel, merged and transposed.
    assert _forward_kernel_operand(per_device, x, jnp.ones((64, 2, 24), jnp.bfloat16)) == (
        (6, 64),
        (1,),
    )


def test_precision_follows_recipe():
    recipe = fp8jax.CurrentScaling(dgrad_precision=jax.lax.Precision.DEFAULT)
    x, w, _ = _inputs((8, 64), jnp.float32)
    dots = jaxpr_dots(
        jax.grad(lambda x, w: fp8jax.dense(x, w, recipe=recipe).sum(), argnums=(0, 1)), x, w
    )
    assert [d.precision.count("HIGHEST") for d in dots] == [0, 0, 2]


def test_bias_and_its_gradient():
    x, w, _ = _inputs((8, 64), jnp.float32)
    bias = jnp.arange(48, dtype=jnp.float32)
    # Both sides in one jitted program, so that they round alike.
    both = jax.jit(lambda x, w, b: (fp8jax.dense(x, w, b), fp8jax.dense(x, w) + b[None, :]))
    biased, unbiased_plus_bias = both(x, w, bias)
    np.testing.assert_array_equal(biased, unbiased_plus_bias)
    db = jax.jit(jax.grad(lambda b: fp8jax.dense(x, w, b).sum()))(bias)
    np.testing.assert_array_equal(db, jnp.full((48,), 8.0))


def _biased_op(op, x, bias, recipe, state):
    """``op`` on ``x`` with its output bias (layernorm_mlp: bias_2) set to ``bias``."""
    hidden, features = x.shape[-1], bias.shape[0]
    kernel = jnp.full((hidden, features), 0.01, x.dtype)
    ones = jnp.ones((hidden,), jnp.float32)
    if op == "dense":
        return fp8jax.dense(x, kernel, bias, recipe=recipe, state=state)
    if op == "layernorm_dense":
        return fp8jax.layernorm_dense(x, ones, ones, kernel, bias, recipe=recipe, state=state)
    k1, k2 = jnp.full((hidden, 1, 64), 0.01, x.dtype), jnp.full((64, features), 0.01, x.dtype)
    return fp8jax.layernorm_mlp(
        x, ones, ones, k1, k2, None, bias, activations=("relu",), recipe=recipe, state=state
    )


@pytest.mark.parametrize("op", ["dense", "layernorm_dense", "layernorm_mlp"])
@pytest.mark.parametrize("delayed", [False, True])
def test_bias_gradient_is_summed_in_f32(op, delayed):
    # The output gradient is bf16 (the cotangent c below, exactly), but its
    # sum over the 4096 tokens is accumulated and returned in f32
    # (quantize_operand, column_sums). Bound: any order of f32 additions of n
    # non-negative terms errs by at most n * 2**-24 * sum(c). A bf16 result
    # (as JAX's own gradient of a bf16 bias add gives) is off by up to half
    # a bf16 spacing of ~6000, 16, far outside it.
    tokens, hidden, features = 4096, 64, 32
    recipe = fp8jax.DelayedScaling() if delayed else fp8jax.CurrentScaling()
    group = fp8jax.MlpScaleState if op == "layernorm_mlp" else fp8jax.DotScaleState
    state = fp8jax.init_state(recipe, group) if delayed else None
    kx, kc = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (tokens, hidden), jnp.float32).astype(jnp.bfloat16)
    c = jax.random.uniform(kc, (tokens, features), jnp.float32, 1, 2).astype(jnp.bfloat16)
    bias = jnp.zeros((features,), jnp.float32)

    def loss(bias):
        y = _biased_op(op, x, bias, recipe, state)
        return jnp.vdot(y.astype(jnp.float32), c.astype(jnp.float32))

    db = np.asarray(jax.jit(jax.grad(loss))(bias), np.float64)  # one program, not per op
    exact = np.asarray(c, np.float64).sum(axis=0)
    np.testing.assert_array_less(np.abs(db - exact), tokens * 2.0**-24 * exact)


def test_mixed_dtypes_give_cotangents_in_primal_dtypes():
    x, w, _ = _inputs((8, 64), jnp.bfloat16)
    w32 = w.astype(jnp.float32)
    grad = jax.grad(lambda x, w: fp8jax.dense(x, w).astype(jnp.float32).sum(), argnums=(0, 1))
    dx, dw = jax.jit(grad)(x, w32)
    assert (dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.float32)


def test_batched_dot_general_values_match_reference_and_gradients_keep_the_shapes():
    # The gradients' values against a derived bound: tests/ops/test_dot_general_batched.py.
    kx, kw = jax.random.split(jax.random.key(7))
    x = jax.random.normal(kx, (3, 16, 32))
    w = jax.random.normal(kw, (32, 3, 8))
    dims = (((2,), (0,)), ((0,), (1,)))
    y = jax.jit(fp8jax.dot_general, static_argnums=2)(x, w, dims)
    ref = jnp.einsum("bsk,kbn->bsn", x, w, precision="highest")
    assert y.shape == ref.shape
    assert float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)) < TYPICAL_E4M3_DOT_ERROR
    grad = jax.grad(lambda x, w: fp8jax.dot_general(x, w, dims).sum(), argnums=(0, 1))
    dx, dw = jax.jit(grad)(x, w)
    assert dx.shape == x.shape and dw.shape == w.shape


@pytest.mark.parametrize("delayed", [False, True])
def test_stored_quantizes_like_the_plain_pass(delayed):
    # The barrier of quantize_operand(stored=True) moves where XLA writes the
    # value, never what is computed: the same FP8 bytes, scale and amax as the
    # plain pass, under jit, and column sums of the value as it was stored.
    from fp8jax.ops.quantizing import quantize_operand

    recipe = fp8jax.DelayedScaling() if delayed else fp8jax.CurrentScaling()
    state = fp8jax.init_state(recipe, fp8jax.DotScaleState).x if delayed else None
    if delayed:  # a scale that is not 1, so that a wrong scale would show
        state = state._replace(scale=jnp.float32(4.0))
    value = (jax.random.normal(jax.random.key(0), (64, 96)) * 3).astype(jnp.bfloat16)

    @jax.jit
    def both(v):
        stored = quantize_operand(v, fp8jax.E4M3, state, recipe, rows_ndim=1, column_sums=True,
                                  stored=True)  # fmt: skip
        return stored, quantize_operand(v, fp8jax.E4M3, state, recipe)

    stored, plain = both(value)
    assert not stored.has_transposed and plain.column_sums is None
    np.testing.assert_array_equal(stored.fp8.data.astype(jnp.float32),
                                  plain.fp8.data.astype(jnp.float32))  # fmt: skip
    np.testing.assert_array_equal(stored.fp8.scale_inv, plain.fp8.scale_inv)
    np.testing.assert_array_equal(stored.amax, plain.amax)
    # Both sum the same f32 values over the rows; only the order may differ:
    # 64 additions, each rounding by at most 2**-24 relative.
    want = jnp.sum(value.astype(jnp.float32), axis=0)
    bound = 64 * 2.0**-24 * jnp.sum(jnp.abs(value.astype(jnp.float32)), axis=0)
    assert bool(jnp.all(jnp.abs(stored.column_sums - want) <= bound))


def test_overflowing_input_saturates_instead_of_nan():
    recipe = fp8jax.DelayedScaling(amax_history_len=2)
    state = fp8jax.init_state(recipe)  # scale 1: 1e4 is far past E4M3's 448
    x = jnp.full((4, 16), 1e4, jnp.float32)
    w = jnp.full((16, 4), 1.0, jnp.float32)
    y = jax.jit(lambda x, w, s: fp8jax.dense(x, w, recipe=recipe, state=s))(x, w, state)
    np.testing.assert_array_equal(y, jnp.full((4, 4), 448.0 * 16))


def test_inf_in_input_does_not_poison_current_scale():
    x = jnp.ones((4, 16), jnp.float32).at[0, 0].set(jnp.inf)
    w = jnp.ones((16, 4), jnp.float32)
    y = jax.jit(fp8jax.dense)(x, w)
    # The other rows quantize under the fallback scale 1. w's scale_inv,
    # 1/448, is inexact in f32: allow its rounding (2**-24) and no more. The
    # Inf's own row stays non-finite (docs of fp8jax.quantize), so NaN/Inf
    # guards see it.
    np.testing.assert_allclose(y[1:], jnp.full((3, 4), 16.0), rtol=2.0**-22)
    assert not bool(jnp.any(jnp.isfinite(y[0])))


_X, _W = jnp.ones((4, 16)), jnp.ones((16, 8))
_DELAYED = fp8jax.DelayedScaling(amax_history_len=4)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda: fp8jax.dense(_X.astype(jnp.int32), _W),
            TypeError,
            "x must be a float32, bfloat16 or float16 array, got dtype int32",
        ),
        (
            lambda: fp8jax.dense(_X, _W.astype(jnp.float8_e4m3fn)),
            TypeError,
            "kernel must be .* got dtype float8_e4m3fn. fp8jax quantizes high-precision inputs",
        ),
        (
            lambda: fp8jax.dot_general(_X, _W.astype(jnp.uint8), (((1,), (0,)), ((), ()))),
            TypeError,
            "rhs must be",
        ),
        (
            lambda: fp8jax.dense(_X, jnp.ones((15, 8))),
            ValueError,
            "contracting dims must match in size: lhs axis 1 has 16 but rhs axis 0 has 15",
        ),
        (
            lambda: fp8jax.dense(_X, _W, contracting_dims=((2,), (0,))),
            ValueError,
            "lhs contracting dims has axis 2, out of range for an operand of rank 2",
        ),
        (
            lambda: fp8jax.dense(_X, _W, jnp.ones((4,))),
            ValueError,
            r"bias must have the kernel's output shape \(8,\), got \(4,\)",
        ),
        (
            lambda: fp8jax.dense(_X, _W, recipe="delayed"),
            TypeError,
            "recipe must be fp8jax.CurrentScaling",
        ),
        (
            lambda: fp8jax.dense(_X, _W, recipe=_DELAYED),
            ValueError,
            r"DelayedScaling needs state: create it once with fp8jax.init_state\(recipe\)",
        ),
        (
            lambda: fp8jax.dense(_X, _W, state=fp8jax.init_state(_DELAYED)),
            ValueError,
            "state must be None with CurrentScaling",
        ),
        (
            lambda: fp8jax.dense(_X, _W, recipe=_DELAYED, state={"x": 1}),
            TypeError,
            "state must be a DotScaleState",
        ),
        (
            lambda: fp8jax.dense(
                _X,
                _W,
                recipe=_DELAYED,
                state=fp8jax.init_state(fp8jax.DelayedScaling(amax_history_len=8)),
            ),
            ValueError,
            r"state.x.amax_history has shape \(8,\), but .* needs \(4,\)",
        ),
        (
            lambda: fp8jax.dense(
                _X,
                _W,
                recipe=_DELAYED,
                state=jax.tree.map(lambda a: a.astype(jnp.bfloat16), fp8jax.init_state(_DELAYED)),
            ),
            TypeError,
            r"state.x must hold float32 \(amax_history, scale\), got \('bfloat16', 'bfloat16'\)",
        ),
        (
            lambda: fp8jax.dot_general(
                _X, _W, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float8_e5m2
            ),
            TypeError,
            "preferred_element_type must be a high-precision float dtype",
        ),
    ],
)
def test_bad_input_is_explained(call, error, message):
    with pytest.raises(error, match=message):
        call()

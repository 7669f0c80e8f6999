"""Rank-1, zero-size and non-finite inputs to every public op (issue 32, items 3-5).

Rank-1 operands: the backward's dot_generals contract nothing (an outer
product), which the kernel-matrix view of ``scaled_dot`` took for a
contraction and crashed on. Zero-size axes: empty MoE groups and batches
must give what ``jnp`` gives, empty arrays and zeros (a zero-size
contracting axis sums nothing). Non-finite inputs: finite overflow
saturates, but an Inf or NaN must reach the output so that a user's
NaN/Inf guard fires.

Values are compared with the f32 reference under the FP8 bounds of
``tests/numerics.py`` (E4M3 relative rounding 2**-4, E5M2 2**-3, plus the
subnormal floor and output rounding), computed from the operands.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.kernels import cast_transpose as ct
from fp8jax.quantize import quantize_with_scale
from numerics import assert_within, current_scale, gemm_error_bound

DELAYED = fp8jax.DelayedScaling(amax_history_len=4)
RECIPES = [fp8jax.CurrentScaling(), DELAYED]
RECIPE_IDS = ["current", "delayed"]


def _normal(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _check_gemm(actual, a, b, contract, a_fmt, b_fmt, what):
    """``actual`` against ``np.einsum(contract, a, b)`` within the current-scaling FP8 bound."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    bound = gemm_error_bound(a, b, a_fmt, b_fmt, current_scale(a, a_fmt),
                             current_scale(b, b_fmt), contract, jnp.float32)  # fmt: skip
    assert_within(actual, np.einsum(contract, a, b), bound, what)


# --- rank-1 operands (item 3) -------------------------------------------------------------


# (spec of the forward as an einsum, lhs shape, rhs shape, how fp8jax computes it)
RANK1_CASES = {
    "einsum_lhs_matrix_rhs_vector": (
        "bd,d->b", (4, 8), (8,), lambda x, w, **kw: fp8jax.einsum("bd,d->b", x, w, **kw)),
    "einsum_lhs_vector": (
        "d,df->f", (8,), (8, 3), lambda x, w, **kw: fp8jax.einsum("d,df->f", x, w, **kw)),
    "dense_vector_input": (
        "d,df->f", (8,), (8, 3), lambda x, w, **kw: fp8jax.dense(x, w, **kw)),
    "dense_vector_kernel": (
        "bd,d->b", (4, 8), (8,), lambda x, w, **kw: fp8jax.dense(x, w, **kw)),
    "dot_general_both_vectors": (
        "d,d->", (8,), (8,),
        lambda x, w, **kw: fp8jax.dot_general(x, w, (((0,), (0,)), ((), ())), **kw)),
    "dot_general_batched_vectors": (
        "bd,bd->b", (4, 8), (4, 8),
        lambda x, w, **kw: fp8jax.dot_general(x, w, (((1,), (1,)), ((0,), (0,))), **kw)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(RANK1_CASES))
def test_rank1_operands_have_fp8_gradients_within_the_bound(case):
    spec, lhs_shape, rhs_shape, op = RANK1_CASES[case]
    x, w = _normal(0, lhs_shape), _normal(1, rhs_shape)
    out_labels = spec.split("->")[1]
    lhs_labels, rhs_labels = spec.split("->")[0].split(",")
    cot = _normal(2, jax.eval_shape(op, x, w).shape)

    def value_and_vjp(x, w, cot):
        y, vjp = jax.vjp(op, x, w)
        return y, *vjp(cot)

    # One jitted program: eagerly every step of the op and its VJP compiled on its own.
    y, d_x, d_w = jax.jit(value_and_vjp)(x, w, cot)
    # Forward: E4M3 x E4M3. dgrad: g (E5M2) with the kernel (E4M3);
    # wgrad: the input (E4M3) with g (E5M2), each an einsum of the spec's labels.
    _check_gemm(y, x, w, spec, "e4m3", "e4m3", "forward")
    _check_gemm(d_x, cot, w, f"{out_labels},{rhs_labels}->{lhs_labels}", "e5m2", "e4m3", "dgrad")
    _check_gemm(d_w, x, cot, f"{lhs_labels},{out_labels}->{rhs_labels}", "e4m3", "e5m2", "wgrad")


@pytest.mark.parametrize("case", ["einsum_lhs_matrix_rhs_vector", "dense_vector_input"])
def test_rank1_operands_update_the_delayed_state(case):
    _, lhs_shape, rhs_shape, op = RANK1_CASES[case]
    x, w = _normal(0, lhs_shape), _normal(1, rhs_shape)
    state = fp8jax.init_state(DELAYED)

    def loss(x, w, state):
        return jnp.sum(op(x, w, recipe=DELAYED, state=state))

    # Jitted, one program each: eagerly every step of the op compiled on its own.
    grad = jax.jit(jax.grad(loss, argnums=2))(x, w, state)
    new = jax.jit(fp8jax.take_new_state)(state, grad)
    assert float(new.x.amax_history[0]) == float(jnp.max(jnp.abs(x)))
    assert float(new.kernel.amax_history[0]) == float(jnp.max(jnp.abs(w)))
    assert float(new.grad.amax_history[0]) == 1.0  # d sum / d y


def test_layernorm_ops_take_a_single_token_vector():
    # A norm over the last axis of a rank-1 x is one token: the same values
    # as the (1, hidden) batch, with gradients shaped like x.
    hidden = 16
    x, gamma = _normal(0, (hidden,)), 1.0 + 0.1 * _normal(1, (hidden,))
    kernel = _normal(2, (hidden, 8))
    k1, k2 = 0.2 * _normal(3, (hidden, 2, 32)), 0.2 * _normal(4, (32, hidden))

    def ops(x):
        return (
            fp8jax.layernorm(x, gamma),
            fp8jax.layernorm_dense(x, gamma, None, kernel),
            fp8jax.layernorm_mlp(x, gamma, None, k1, k2, activations=("silu", "linear")),
        )

    def loss(x):
        return sum(jnp.sum(y * y) for y in ops(x))

    # Jitted: run eagerly, the three ops' primitives were compiled one by one (3.5 s).
    ops_jit, grad = jax.jit(ops), jax.jit(jax.grad(loss))
    for vector, batch in zip(ops_jit(x), ops_jit(x[None]), strict=True):
        np.testing.assert_array_equal(vector, batch[0])
    np.testing.assert_array_equal(grad(x), grad(x[None])[0])


# --- zero-size axes (item 4) -------------------------------------------------------------


ZERO_CASES = {
    # name: (op on (x, w), x shape, w shape)
    "dense_empty_batch": (lambda x, w, **kw: fp8jax.dense(x, w, **kw), (0, 8), (8, 3)),
    "dense_empty_tokens_3d": (lambda x, w, **kw: fp8jax.dense(x, w, **kw), (2, 0, 8), (8, 3)),
    "dense_empty_contraction": (lambda x, w, **kw: fp8jax.dense(x, w, **kw), (4, 0), (0, 3)),
    "dense_empty_features": (lambda x, w, **kw: fp8jax.dense(x, w, **kw), (4, 8), (8, 0)),
    "einsum_empty_moe_group": (
        lambda x, w, **kw: fp8jax.einsum("gtd,gdf->gtf", x, w, **kw), (3, 0, 8), (3, 8, 5)),
    "einsum_no_groups": (
        lambda x, w, **kw: fp8jax.einsum("gtd,gdf->gtf", x, w, **kw), (0, 4, 8), (0, 8, 5)),
}  # fmt: skip


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("case", list(ZERO_CASES))
def test_zero_size_axes_give_what_jnp_gives(case, recipe):
    op, x_shape, w_shape = ZERO_CASES[case]
    x, w = _normal(0, x_shape), _normal(1, w_shape)
    state = fp8jax.init_state(recipe)

    def loss(x, w, state, fp8):
        y = op(x, w, recipe=recipe, state=state) if fp8 else op(x, w)
        return jnp.sum(y * y), y

    # The reference runs the same contraction with jnp, in f32.
    ref_op = {"dense": lambda x, w: jnp.tensordot(x, w, 1)}.get(case.split("_")[0])
    if ref_op is None:
        ref_op = lambda x, w: jnp.einsum("gtd,gdf->gtf", x, w)  # noqa: E731
    # Both jitted, one program each: eagerly every step compiled on its own.
    (_, want), want_grads = jax.jit(jax.value_and_grad(
        lambda x, w: (jnp.sum(ref_op(x, w) ** 2), ref_op(x, w)), argnums=(0, 1), has_aux=True
    ))(x, w)  # fmt: skip
    step = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (_, y), grads = jax.jit(step, static_argnums=3)(x, w, state, True)
    # Every value is either empty or exactly zero (a sum of no terms).
    assert y.shape == want.shape and y.dtype == want.dtype
    np.testing.assert_array_equal(y, want)
    for got, ref in zip(grads[:2], want_grads, strict=True):
        assert got.shape == ref.shape
        np.testing.assert_array_equal(got, ref)
    if state is not None:
        # An empty tensor observed nothing: its amax is recorded as 0 and the
        # scale kept; a non-empty one records its amax.
        new = jax.jit(fp8jax.take_new_state)(state, grads[2])
        for role, tensor in zip(new, (x, w, y), strict=True):
            want_amax = float(jnp.max(jnp.abs(tensor))) if tensor.size else 0.0
            if role is new.grad and tensor.size:
                want_amax = float(jnp.max(jnp.abs(2 * y)))  # d sum(y**2) / dy
            assert float(role.amax_history[0]) == want_amax
            if not tensor.size:
                assert float(role.scale) == 1.0


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_zero_size_dense_with_bias(recipe):
    state = fp8jax.init_state(recipe)
    x, w, b = _normal(0, (0, 8)), _normal(1, (8, 3)), _normal(2, (3,))

    def loss(x, w, b):
        return jnp.sum(fp8jax.dense(x, w, b, recipe=recipe, state=state))

    d_x, d_w, d_b = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, b)  # one program, not per op
    assert d_x.shape == (0, 8)
    np.testing.assert_array_equal(d_w, jnp.zeros((8, 3)))
    np.testing.assert_array_equal(d_b, jnp.zeros((3,)))


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize(
    ("x_shape", "k1_shape", "k2_shape"),
    [
        ((0, 16), (16, 2, 8), (8, 16)),  # no tokens
        ((3, 16), (16, 2, 0), (0, 16)),  # no ffn units
        ((3, 16), (16, 2, 8), (8, 0)),  # no outputs
        ((3, 0), (0, 2, 8), (8, 4)),  # no hidden features
    ],
    ids=["tokens", "ffn", "outputs", "hidden"],
)
def test_zero_size_fused_ops_give_what_jnp_gives(recipe, x_shape, k1_shape, k2_shape):
    hidden = x_shape[-1]
    x, gamma = _normal(0, x_shape), jnp.ones((hidden,))
    k1, k2 = _normal(1, k1_shape), _normal(2, k2_shape)
    kd = _normal(3, (hidden, k2_shape[1]))
    dot_state = fp8jax.init_state(recipe)
    mlp_state = fp8jax.init_state(recipe, fp8jax.MlpScaleState)

    def loss(x, gamma, k1, k2):
        y1 = fp8jax.layernorm_dense(x, gamma, None, kd, recipe=recipe, state=dot_state)
        y2 = fp8jax.layernorm_mlp(x, gamma, None, k1, k2, activations=("gelu", "linear"),
                                  recipe=recipe, state=mlp_state)  # fmt: skip
        return jnp.sum(y1) + jnp.sum(y2), (y1, y2)

    # Jitted: run eagerly, each op's primitives were compiled one by one for their
    # shapes (1.2 to 2.2 s a case); traced, the ops see the same zero-size shapes.
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    grads, (y1, y2) = step(x, gamma, k1, k2)
    assert y1.shape == (*x_shape[:-1], k2_shape[1])
    assert y2.shape == (*x_shape[:-1], k2_shape[1])
    if hidden == 0:
        # A norm over no features normalizes nothing; the GEMMs then contract
        # an empty axis, which sums no terms: zeros, as jnp gives.
        np.testing.assert_array_equal(y1, jnp.zeros(y1.shape))
    if hidden == 0 or k1_shape[-1] == 0:
        # The MLP's first GEMM (hidden) or its second (ffn) sums no terms: zeros.
        np.testing.assert_array_equal(y2, jnp.zeros(y2.shape))
    for g, primal in zip(grads, (x, gamma, k1, k2), strict=True):
        assert g.shape == primal.shape
        assert bool(jnp.all(jnp.isfinite(g)))
    if hidden == 0 or (y1.size == 0 and y2.size == 0):
        # Every output is empty or a constant 0: no gradient anywhere, as jnp gives.
        for g in grads:
            np.testing.assert_array_equal(g, jnp.zeros(g.shape))


def test_zero_size_quantize_and_layernorm():
    q, amax = jax.jit(lambda x: fp8jax.quantize(x, fp8jax.E4M3))(jnp.zeros((0, 4)))
    assert q.shape == (0, 4) and float(amax) == 0.0 and float(q.scale_inv) == 1.0
    y = jax.jit(fp8jax.layernorm)(jnp.zeros((0, 4)), jnp.ones((4,)))
    assert y.shape == (0, 4)


# --- non-finite inputs (item 5) ----------------------------------------------------------


@pytest.mark.parametrize("fmt", [fp8jax.E4M3, fp8jax.E5M2], ids=lambda f: f.name)
def test_quantize_saturates_finite_overflow_and_propagates_non_finite(fmt):
    x = jnp.array([1.0, 1e6, -1e6, jnp.inf, -jnp.inf, jnp.nan], jnp.float32)
    quantize = jax.jit(fp8jax.quantize, static_argnums=1)  # one program, not per op
    q, _ = quantize(x, fmt, jnp.float32(1.0))
    v = q.data.astype(jnp.float32)
    assert v[:3].tolist() == [1.0, fmt.max, -fmt.max]
    # Inf and NaN both come out NaN: the GPU's FP8 conversion saturates an
    # Inf, so only a NaN survives it on every backend.
    assert bool(jnp.all(jnp.isnan(v[3:])))
    # Current scaling: a non-finite amax gives scale 1 and the Inf still passes.
    q, _ = quantize(x, fmt)
    assert float(q.scale_inv) == 1.0
    assert not bool(jnp.any(jnp.isfinite(q.data[3:].astype(jnp.float32))))


@pytest.mark.parametrize("fmt", [fp8jax.E4M3, fp8jax.E5M2], ids=lambda f: f.name)
def test_cast_transpose_kernel_propagates_non_finite_like_xla(fmt):
    # Interpret mode runs the Pallas kernel's own body: its bytes must be
    # quantize_with_scale's, Inf and NaN included.
    rows, cols = ct.BLOCK_ROWS, ct.BLOCK_COLS
    g = _normal(0, (rows, cols)).astype(jnp.bfloat16)
    g = g.at[0, 0].set(jnp.inf).at[1, 1].set(-jnp.inf).at[2, 2].set(jnp.nan)
    g = g.at[3, 3].set(1e30)  # finite overflow: saturates
    scale = jnp.float32(1.0)
    q, q_t, _, _ = jax.jit(ct._pallas, static_argnames=("fmt", "interpret"))(
        g, scale, fmt=fmt, interpret=True
    )
    want = quantize_with_scale(g, fmt, scale).data.astype(jnp.float32)
    np.testing.assert_array_equal(q.astype(jnp.float32), want)
    np.testing.assert_array_equal(q_t.astype(jnp.float32), want.T)
    assert not any(bool(jnp.isfinite(want[i, i])) for i in range(3))
    assert float(want[3, 3]) == fmt.max


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan], ids=["inf", "-inf", "nan"])
def test_non_finite_input_reaches_the_rows_it_touches(recipe, bad):
    x, w = _normal(0, (4, 8)), _normal(1, (8, 3))
    x = x.at[1, 2].set(bad)
    state = fp8jax.init_state(recipe)
    # Jitted, one program each: eagerly every step of the op compiled on its own.
    y = jax.jit(lambda x, w, s: fp8jax.dense(x, w, recipe=recipe, state=s))(x, w, state)
    assert not bool(jnp.any(jnp.isfinite(y[1])))
    assert bool(jnp.all(jnp.isfinite(y[jnp.array([0, 2, 3])])))
    layernorm_dense = lambda x, w, s: fp8jax.layernorm_dense(  # noqa: E731
        x, jnp.ones((8,)), None, w, recipe=recipe, state=s
    )
    y = jax.jit(layernorm_dense)(x, w, state)
    assert not bool(jnp.any(jnp.isfinite(y[1])))


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_non_finite_gradient_reaches_the_gradients(recipe):
    x, w = _normal(0, (4, 8)), _normal(1, (8, 3))
    state = fp8jax.init_state(recipe)
    cot = jnp.ones((4, 3)).at[2, 1].set(jnp.inf)

    def cotangents(x, w, cot):
        _, vjp = jax.vjp(lambda x, w: fp8jax.dense(x, w, recipe=recipe, state=state), x, w)
        return vjp(cot)

    d_x, d_w = jax.jit(cotangents)(x, w, cot)  # one program, not per op
    assert not bool(jnp.any(jnp.isfinite(d_x[2])))  # the row the Inf's token reaches
    assert not bool(jnp.any(jnp.isfinite(d_w[:, 1])))  # the column of its feature


def test_finite_overflow_still_saturates_in_an_op():
    # Delayed scaling quantizes with a stored scale: values beyond the range
    # it was set for saturate to the format's maximum, and stay finite.
    recipe = DELAYED
    state = fp8jax.init_state(recipe)
    x = jnp.full((4, 8), 1e4, jnp.float32)  # 1e4 * scale 1 > 448
    y = jax.jit(lambda x, w, s: fp8jax.dense(x, w, recipe=recipe, state=s))(
        x, jnp.ones((8, 2)), state
    )
    np.testing.assert_array_equal(y, jnp.full((4, 2), 8 * 448.0))

"""fp8jax.moe_mlp: the routed experts as a plain-JAX op; its capacity rule and its errors.

The op's FP8 numerics are tests/flax/test_moe.py's (the Flax blocks call
it); here the routing is checked in f32 (``fp8=False``: lax.ragged_dot in
f32) against an independent f64 numpy reference, token by token, so that
the tolerance is f32 summation only: ``2 * u * (hidden + ffn + top_k)``
of the output's peak, u = 2**-24, the depths of the sums involved.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.ops import moe as moe_ops

T, H, F, E, K = 40, 32, 16, 4, 2
BUDGET = 2 * 2.0**-24 * (H + F + K) * 4  # 4: headroom for the gated product's two roundings


def _inputs(skew=0.0):
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (T, H))
    router = jax.random.normal(keys[1], (H, E))
    wi = jax.random.normal(keys[2], (E, H, 2, F)) * H**-0.5
    wo = jax.random.normal(keys[3], (E, F, H)) * F**-0.5
    return x, (x @ router).at[:, 0].add(skew), wi, wo  # skew: expert 0 is hot


def _reference(x, logits, wi, wo, capacity=None):
    """f64, token by token: each expert keeps its first ``capacity`` slots in slot order."""
    x, logits = np.asarray(x, np.float64), np.asarray(logits, np.float64)
    wi, wo = np.asarray(wi, np.float64), np.asarray(wo, np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :K]
    gates = np.take_along_axis(probs, experts, -1)
    gates /= gates.sum(-1, keepdims=True)
    y, taken, dropped = np.zeros_like(x), np.zeros(E, int), 0
    for t in range(x.shape[0]):
        for k in range(K):
            e = experts[t, k]
            taken[e] += 1
            if capacity is not None and taken[e] > capacity:
                dropped += 1
                continue
            h = x[t] @ wi[e].reshape(H, 2 * F)
            gate, up = h[:F], h[F:]
            y[t] += gates[t, k] * ((gate / (1 + np.exp(-gate)) * up) @ wo[e])
    load = taken / taken.sum()
    # Switch Transformer's balance loss: E * sum_e (share of slots) * (mean router probability).
    return y, load, dropped / (x.shape[0] * K), E * np.sum(load * probs.mean(0))


@pytest.mark.parametrize("capacity_factor", [None, 1.25, 0.5])
def test_values_follow_the_token_order_capacity_rule(capacity_factor):
    x, logits, wi, wo = _inputs(skew=3.0)
    y, stats = jax.jit(lambda *a: fp8jax.moe_mlp(*a, top_k=K, fp8=False,
                                                 capacity_factor=capacity_factor))(
        x, logits, wi, wo)  # fmt: skip
    cap = None if capacity_factor is None else int(np.ceil(capacity_factor * T * K / E))
    want, load, dropped, aux = _reference(x, logits, wi, wo, cap)
    if capacity_factor is not None:
        assert dropped > 0  # the skewed router overfills expert 0
    else:
        assert dropped == 0
    np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=BUDGET * np.abs(want).max())
    np.testing.assert_allclose(np.asarray(stats.expert_load), load, rtol=1e-6)
    np.testing.assert_allclose(float(stats.dropped), dropped, rtol=1e-6)
    # f32 softmax and sums over T tokens: a relative (T + E) 2**-24, 1e-6 covers it.
    np.testing.assert_allclose(float(stats.aux_loss), aux, rtol=1e-6)
    assert abs(aux - 1.0) > 0.05  # the skewed router is unbalanced: aux is not its floor 1


# FP8 against f32/f64, normwise, with tests/flax/flax_reference.py's budgets:
# the output chains four E4M3 roundings (x, wi, the activation, wo), whose
# relative RMS is 0.425 * 2**-4 each: 1.5 * sqrt(4) of it; expert 0's wi
# gradient passes through E5M2 grouped GEMMs: MOE_GRADIENT_BUDGET's 0.35 / 2.
FP8_OUTPUT_BUDGET = 1.5 * 2 * 0.425 * 2.0**-4
FP8_GRADIENT_BUDGET = 0.35 / 2


def _relative(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def test_fp8_dropped_slots_get_no_value_and_no_gradient():
    # With a capacity, a dropped slot's rows sit past the grouped GEMMs' group
    # sizes: zero output there, and zero gradient into its expert. A dropped
    # slot that kept its value or its gradient moves y or expert 0's gradient
    # by about their own size (0.9 of it here), far beyond the FP8 budgets.
    x, logits, wi, wo = _inputs(skew=30.0)  # every token's first choice is expert 0

    def loss(wi, capacity_factor, fp8):
        y, _ = fp8jax.moe_mlp(x, logits, wi, wo, top_k=K, capacity_factor=capacity_factor,
                              fp8=fp8)  # fmt: skip
        return jnp.sum(y * y), y

    grad = jax.jit(jax.grad(loss, has_aux=True), static_argnums=(1, 2))
    capped, y = grad(wi, 0.25, True)  # 5 slots per expert: expert 0 keeps 5 of 40
    want_capped, _ = grad(wi, 0.25, False)
    cap = int(np.ceil(0.25 * T * K / E))
    want_y, _, dropped, _ = _reference(x, logits, wi, wo, cap)
    assert dropped >= (T - cap) / (T * K)  # expert 0 alone drops 35 of its 40 slots
    assert _relative(y, want_y) < FP8_OUTPUT_BUDGET
    assert _relative(capped[0], want_capped[0]) < FP8_GRADIENT_BUDGET
    assert np.isfinite(np.asarray(capped)).all()


@pytest.mark.parametrize("recipe", [None, fp8jax.BlockScaling()], ids=["current", "block"])
def test_a_plain_jax_user_gets_the_flax_blocks_values_and_gradients(recipe):
    import flax.linen as nn

    from fp8jax.flax import linen as fnn

    x, _, _, _ = _inputs()
    block = fnn.MoEBlock(num_experts=E, top_k=K, ffn=F, recipe=recipe)
    params = nn.meta.unbox(jax.jit(block.init)(jax.random.key(1), x))["params"]
    g = jax.random.normal(jax.random.key(7), x.shape)

    def by_block(params, x):
        return jnp.sum(block.apply({"params": params}, x) * g)

    def by_op(params, x):
        y, _ = fp8jax.moe_mlp(x, x @ params["router"], params["wi"], params["wo"], top_k=K,
                              recipe=recipe)  # fmt: skip
        return jnp.sum(y * g)

    want = jax.jit(jax.value_and_grad(by_block, argnums=(0, 1)))(params, x)
    got = jax.jit(jax.value_and_grad(by_op, argnums=(0, 1)))(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sigmoid_gating_of_very_negative_logits_is_finite():
    # The normalized sigmoid sigmoid(l) / sum(sigmoid(l)) was computed as that
    # quotient: below about -88 the f32 sigmoids are subnormal (few digits
    # left) or 0, and a token whose logits all were gave 0 / 0, NaN in y, the
    # aux loss and the router's gradient. Its gates against f64:
    x, logits, wi, wo = _inputs()
    logits = logits.at[0].set(-200.0).at[1].set(jnp.array([-100.0, -101.0, -102.0, -110.0]))

    def loss(logits):
        y, stats = fp8jax.moe_mlp(x, logits, wi, wo, top_k=K, gating="sigmoid", fp8=False)
        return jnp.sum(y) + stats.aux_loss, (y, stats)

    d_logits, (y, stats) = jax.jit(jax.grad(loss, has_aux=True))(logits)  # one program, not per op
    for value in (y, stats.aux_loss, d_logits):
        assert np.isfinite(np.asarray(value)).all()
    # f64: sigmoid(l) = 1 / (1 + exp(-l)), with no underflow at these logits.
    scores = 1 / (1 + np.exp(-np.asarray(logits[:2], np.float64)))
    probs = scores / scores.sum(-1, keepdims=True)
    gates, experts, _ = jax.jit(moe_ops.route, static_argnums=(1, 2))(logits[:2], K, "sigmoid")
    want = -np.sort(-probs, axis=-1)[:, :K]
    np.testing.assert_allclose(gates, want / want.sum(-1, keepdims=True), rtol=1e-6)
    np.testing.assert_array_equal(experts[1], [0, 1])


@pytest.mark.parametrize(
    "factor,same_as", [(1e9, None), (1e308, None), (np.float32(1.25), 1.25)], ids=str
)
def test_any_finite_capacity_factor_runs(factor, same_as):
    # 1e9 overflowed int32 against the slots' ranks (OverflowError), 1e308 made
    # math.ceil see inf; np.float32 was refused as not "a finite number". A
    # capacity of at least the tokens drops nothing: the dropless values.
    x, logits, wi, wo = _inputs(skew=3.0)

    def run(capacity_factor):
        # Jitted (eagerly every step compiled on its own), a function per call: a jit
        # cache keyed on the factor would take np.float32(1.25) and 1.25 for one.
        return jax.jit(lambda *a: fp8jax.moe_mlp(*a, top_k=K, fp8=False,
                                                 capacity_factor=capacity_factor))(
            x, logits, wi, wo)  # fmt: skip

    (y, stats), (want, want_stats) = run(factor), run(same_as)
    np.testing.assert_array_equal(y, want)
    assert float(stats.dropped) == float(want_stats.dropped)


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("empty", ["ffn", "hidden"])
def test_no_ffn_units_or_hidden_features_give_what_jnp_gives(empty, fp8):
    # Each raised ZeroDivisionError (a reshape of zero-size rows by -1). The
    # experts then sum no terms: zeros (or an empty output), zero gradients.
    x, logits, wi, wo = _inputs()
    if empty == "ffn":
        wi, wo = wi[..., :0], wo[:, :0]
    else:
        x, wi, wo = x[:, :0], wi[:, :0], wo[..., :0]

    def loss(x, wi, wo):
        y, _ = fp8jax.moe_mlp(x, logits, wi, wo, top_k=K, fp8=fp8, capacity_factor=0.5)
        return jnp.sum(y), y

    grads, y = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(x, wi, wo)
    np.testing.assert_array_equal(y, jnp.zeros(x.shape))
    for g, primal in zip(grads, (x, wi, wo), strict=True):
        np.testing.assert_array_equal(g, jnp.zeros(primal.shape))


@pytest.mark.parametrize(
    "change,match",
    [
        ({"x": jnp.ones((2, T, H))}, r"x must be 2-D \[tokens, hidden\], got shape \(2, 40, 32\)"),
        ({"wi": jnp.ones((E, H, F))}, r"wi must be \[experts, hidden=32, 2, ffn\].*\(4, 32, 16\)"),
        ({"wo": jnp.ones((E, H, F))}, r"wo must be \[experts, ffn, hidden\] = \(4, 16, 32\)"),
        ({"logits": jnp.ones((T, 3))}, r"logits must be float \[tokens, experts\] = \(40, 4\)"),
        ({"top_k": 5}, r"top_k must be an int in \[1, 4\], got 5"),
        ({"gating": "relu"}, r"gating must be one of \('softmax', 'sigmoid'\), got 'relu'"),
        ({"activation": "linear"}, r"activation must be one of .*got 'linear'"),
        ({"capacity_factor": 0}, r"capacity_factor must be None \(dropless\) or .* got 0"),
        (
            {"recipe": fp8jax.MXFP8Scaling()},
            r"the expert GEMMs take CurrentScaling or BlockScaling only.*Got recipe=MXFP8Scaling",
        ),
    ],
)
def test_bad_arguments_name_the_argument_expected_and_given(change, match):
    x, logits, wi, wo = _inputs()
    args = {"x": x, "logits": logits, "wi": wi, "wo": wo, "top_k": K, **change}
    with pytest.raises(ValueError, match=rf"fp8jax.moe_mlp: {match}"):
        fp8jax.moe_mlp(args.pop("x"), args.pop("logits"), args.pop("wi"), args.pop("wo"), **args)


@pytest.mark.parametrize("fp8", ["false", None, 0])
def test_fp8_must_be_a_bool(fp8):
    # Taken for its truth value, a config's "false" ran the FP8 experts.
    x, logits, wi, wo = _inputs()
    with pytest.raises(TypeError, match=rf"fp8jax.moe_mlp: fp8 must be a bool, got {fp8!r}"):
        fp8jax.moe_mlp(x, logits, wi, wo, top_k=K, fp8=fp8)


@pytest.mark.parametrize("name", ["x", "wi", "wo"])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float8_e4m3fn])
def test_non_float_operands_are_named_by_moe_mlp(name, dtype):
    # They were refused inside the grouped GEMMs as "lhs" or "rhs", names
    # the caller never passed.
    x, logits, wi, wo = _inputs()
    args = {"x": x, "wi": wi, "wo": wo}
    args[name] = args[name].astype(dtype)
    match = rf"fp8jax.moe_mlp: {name} must be a float32, bfloat16 or float16 array, got dtype"
    for fp8 in (True, False):
        with pytest.raises(TypeError, match=match):
            fp8jax.moe_mlp(args["x"], logits, args["wi"], args["wo"], top_k=K, fp8=fp8)

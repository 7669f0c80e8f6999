"""Train steps (Linen make_train_step, NNX train_step): learning, FP8 state, accumulation."""

import flax_reference as ref
import jax
import numpy as np
import optax
import pytest
import tiny_models as tm
from flax import nnx

import fp8jax
from fp8jax.flax import TrainState, make_train_step
from fp8jax.flax import linen as fnn
from fp8jax.flax import nnx as fnnx

DELAYED = fp8jax.DelayedScaling(amax_history_len=16)
RECIPES = pytest.mark.parametrize("recipe", [None, DELAYED], ids=["current", "delayed"])


def linen_run(recipe, steps, model=None, **step_kw):
    model = model or tm.LinenStack(recipe)
    variables = jax.jit(model.init)(jax.random.key(0), tm.batch()[0])
    tx = optax.adam(3e-3)
    state = TrainState.create(variables, tx)
    loss_fn = lambda v, b: tm.mse(model.apply(v, b[0]), b[1])  # noqa: E731
    step = jax.jit(make_train_step(loss_fn, tx, **step_kw))
    losses = []
    for i in range(steps):
        state, loss = step(state, tm.batch(i % 4))
        losses.append(float(loss))
    return state, losses


# standard_promotion: see conftest.py (optax.adam, and JAX's lowering of the
# bf16 attention backward).
@pytest.mark.usefixtures("standard_promotion")
@RECIPES
def test_linen_fifty_steps_lower_the_loss(recipe):
    state, losses = linen_run(recipe, 50)
    assert losses[-1] < 0.25 * losses[0], losses
    assert int(state.step) == 50
    if recipe is None:
        assert state.fp8_state == {}  # CurrentScaling keeps no FP8 state
        return
    qkv = state.fp8_state["layers"]["TransformerLayer_0"]["attention"]["qkv"]["scales"]
    # Stacked per layer; the scales moved off their initial 1.0, and each layer has its own.
    assert qkv.x.scale.shape == (tm.LAYERS,)
    assert np.all(np.asarray(qkv.x.scale) != 1.0)
    assert qkv.x.scale[0] != qkv.x.scale[1]
    assert np.all(np.asarray(qkv.grad.amax_history)[:, :16] > 0)


@pytest.mark.usefixtures("standard_promotion")
@RECIPES
def test_nnx_fifty_steps_lower_the_loss(recipe):
    model = tm.NnxStack(recipe, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    step = nnx.jit(fnnx.train_step, static_argnames=("loss_fn",))
    loss_fn = lambda m, b: tm.mse(m(b[0]), b[1])  # noqa: E731
    losses = [float(step(model, optimizer, loss_fn, tm.batch(i % 4))) for i in range(50)]
    assert losses[-1] < 0.25 * losses[0], losses
    states = nnx.state(model, fnnx.Fp8State)
    if recipe is None:
        assert not jax.tree.leaves(states)
        return
    mlp = model.layers.mlp.scales.get_value()
    assert mlp.fc2.grad.scale.shape == (tm.LAYERS,)
    assert np.all(np.asarray(mlp.fc2.grad.scale) != 1.0)
    assert mlp.fc1.x.scale[0] != mlp.fc1.x.scale[1]


def test_accumulation_merges_states_like_one_big_batch():
    model = tm.LinenMlpStack(DELAYED)
    x, y = tm.batch(size=8)
    variables = jax.jit(model.init)(jax.random.key(0), x)
    tx = optax.sgd(0.1)
    loss_fn = lambda v, b: tm.mse(model.apply(v, b[0]), b[1])  # noqa: E731
    start = TrainState.create(variables, tx)
    whole, whole_loss = jax.jit(make_train_step(loss_fn, tx))(start, (x, y))
    step = make_train_step(loss_fn, tx, accumulation_steps=2, recipe=DELAYED)
    split, split_loss = jax.jit(step)(start, (x, y))
    np.testing.assert_allclose(split_loss, whole_loss, rtol=1e-6)

    def roles(state, role):
        groups = jax.tree.leaves(
            state.fp8_state, is_leaf=lambda n: isinstance(n, fp8jax.DotScaleState)
        )
        return [getattr(g, role) for g in groups]

    # Forward amaxes are maxima over rows, so the merged micro-batch histories
    # equal the big batch's exactly, per layer; so do the scales.
    for role in ("x", "kernel"):
        for got, want in zip(roles(split, role), roles(whole, role), strict=True):
            np.testing.assert_array_equal(got.amax_history, want.amax_history)
            np.testing.assert_array_equal(got.scale, want.scale)
    # Every role, gradients included, is the max-merge of the states each
    # micro-batch (contiguous halves) would give on its own; a sum, as for
    # gradients, would double the histories.
    one = jax.jit(make_train_step(loss_fn, tx))
    halves = [one(start, (x[i : i + 4], y[i : i + 4]))[0].fp8_state for i in (0, 4)]
    merged = fp8jax.combine_states(*halves, recipe=DELAYED)
    for got, want in zip(jax.tree.leaves(split.fp8_state), jax.tree.leaves(merged), strict=True):
        # The scan over micro-batches compiles the same math in another fusion
        # order: f32 amaxes may differ in their last bits.
        np.testing.assert_allclose(got, want, rtol=1e-5)
    # Averaged gradients match the big batch's: the same FP8 scales, but
    # E5M2 roundings of different gradient tensors. E5M2 (u = 2**-3) counts
    # as two E4M3 roundings per GEMM operand: a budget of four.
    leaves = [jax.tree.leaves(t.params) for t in (start, split, whole)]
    for p0, got, want in zip(*leaves, strict=True):
        assert ref.relative_error(got - p0, want - p0) < ref.fp8_budget(4)


@pytest.mark.usefixtures("standard_promotion")
def test_accumulation_with_current_scaling_needs_no_recipe():
    model = fnn.DenseGeneral(tm.HIDDEN)
    state, losses = linen_run(None, 2, model=model, accumulation_steps=2)
    assert int(state.step) == 2 and np.isfinite(losses).all()


def _stacked_state(seed):
    state = fp8jax.init_state(DELAYED)
    key = jax.random.key(seed)

    def fill(leaf):
        return jax.random.uniform(jax.random.fold_in(key, leaf.size), (3, *leaf.shape)) + 0.5

    return jax.tree.map(fill, state)


def test_stacked_state_is_taken_and_combined_per_layer():
    old, new = _stacked_state(0), _stacked_state(1)
    # Layer 1 was not used in the step: its cotangent is zero.
    new = jax.tree.map(lambda a: a.at[1].set(0.0), new)
    taken = fp8jax.take_new_state({"s": old}, {"s": new})["s"]
    merged = fp8jax.combine_states({"s": old}, {"s": new}, recipe=DELAYED)["s"]
    for layer in range(3):
        at = lambda tree, i=layer: jax.tree.map(lambda a: a[i], tree)  # noqa: E731
        want_taken = fp8jax.take_new_state(at(old), at(new))
        want_merged = fp8jax.combine_states(at(old), at(new), recipe=DELAYED)
        for got, want in ((at(taken), want_taken), (at(merged), want_merged)):
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(taken.x.scale[1], old.x.scale[1])


def test_nnx_accumulation_matches_linen():
    x, y = tm.batch(size=8)
    linen = tm.LinenMlpStack(DELAYED)
    variables = jax.jit(linen.init)(jax.random.key(0), x)
    tx = optax.sgd(0.1)
    loss_fn = lambda v, b: tm.mse(linen.apply(v, b[0]), b[1])  # noqa: E731
    step = make_train_step(loss_fn, tx, accumulation_steps=2, recipe=DELAYED)
    want, want_loss = jax.jit(step)(TrainState.create(variables, tx), (x, y))

    model = tm.NnxMlpStack(DELAYED, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    pure = nnx.to_pure_dict(state)
    linen_pure = ref.linen_to_nnx_dict(variables)
    # Linen's scanned block wraps the MLP in one more scope than NNX's stack.
    linen_pure["layers"] = linen_pure["layers"]["LayerNormMLP_0"]
    nnx.replace_by_pure_dict(state, linen_pure)
    model = nnx.merge(graphdef, state)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    nnx_step = nnx.jit(fnnx.train_step, static_argnames=("loss_fn", "accumulation_steps", "recipe"))
    loss = nnx_step(
        model, optimizer, lambda m, b: tm.mse(m(b[0]), b[1]), (x, y),
        accumulation_steps=2, recipe=DELAYED,
    )  # fmt: skip
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    got = nnx.to_pure_dict(nnx.state(model))
    assert jax.tree.structure(got) == jax.tree.structure(pure)
    expect = ref.linen_to_nnx_dict({"params": want.params, "fp8_state": want.fp8_state})
    expect["layers"] = expect["layers"]["LayerNormMLP_0"]
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(expect), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)

"""Steps that differentiate only the params leave the FP8 scales at 1 (issue 32, item 1).

The ops return the next FP8 state as the state's gradient. A plain NNX loop
(``nnx.value_and_grad`` with ``nnx.Optimizer(..., wrt=nnx.Param)``) or a
Linen step over ``params`` alone drops it, and the scales never move. The
modules now warn at trace time, naming the train steps that do it right;
those steps, input-only gradients and CurrentScaling stay quiet (pytest
turns any warning into an error, see pyproject.toml).
"""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import fp8jax
from fp8jax.flax import Fp8StateNotDifferentiatedWarning, make_train_step
from fp8jax.flax import TrainState as LinenTrainState
from fp8jax.flax import linen as fnn
from fp8jax.flax import nnx as fnnx

RECIPE = fp8jax.DelayedScaling(amax_history_len=4)
X = jax.random.normal(jax.random.key(0), (16, 32))
Y = jnp.zeros((16, 32))

NNX_MODULES = {
    "DenseGeneral": lambda recipe: fnnx.DenseGeneral(32, 32, recipe=recipe, rngs=nnx.Rngs(0)),
    "LayerNormDenseGeneral": lambda recipe: fnnx.LayerNormDenseGeneral(
        32, 32, recipe=recipe, rngs=nnx.Rngs(0)
    ),
    "LayerNormMLP": lambda recipe: fnnx.LayerNormMLP(32, 64, recipe=recipe, rngs=nnx.Rngs(0)),
}
LINEN_MODULES = {
    "DenseGeneral": lambda recipe: fnn.DenseGeneral(32, recipe=recipe),
    "LayerNormDenseGeneral": lambda recipe: fnn.LayerNormDenseGeneral(32, recipe=recipe),
    "LayerNormMLP": lambda recipe: fnn.LayerNormMLP(64, recipe=recipe),
}


def _nnx_loss(model, batch):
    # A small loss weight: the case where unscaled E5M2 gradients underflow.
    return 1e-4 * jnp.mean((model(batch[0]) - batch[1]) ** 2)


def _plain_nnx_step(model, optimizer):
    loss, grads = nnx.value_and_grad(_nnx_loss)(model, (X, Y))
    optimizer.update(model, grads)
    return loss


@pytest.mark.parametrize("name", list(NNX_MODULES))
def test_plain_nnx_loop_warns_and_names_the_train_step(name):
    model = NNX_MODULES[name](RECIPE)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.warns(Fp8StateNotDifferentiatedWarning, match=r"fp8jax\.flax\.nnx\.train_step"):
        nnx.jit(_plain_nnx_step)(model, optimizer)
    # What the warning is about: the scales did not move.
    scales = jax.tree.leaves(model.scales.get_value())[1::2]  # (history, scale) pairs
    assert all(float(scale) == 1.0 for scale in scales)


def test_nnx_transformer_layer_warns_through_its_submodules():
    model = fnnx.TransformerLayer(2, 32, 64, recipe=RECIPE, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    x = X.reshape(2, 8, 32)
    with pytest.warns(Fp8StateNotDifferentiatedWarning, match="TransformerLayer|Dense|MLP"):
        nnx.jit(lambda m, o: o.update(m, nnx.grad(lambda m: jnp.sum(m(x)))(m)))(model, optimizer)


@pytest.mark.parametrize("name", list(NNX_MODULES))
def test_nnx_train_step_updates_the_scales_without_a_warning(name):
    model = NNX_MODULES[name](RECIPE)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = nnx.jit(fnnx.train_step, static_argnames=("loss_fn",))
    step(model, optimizer, _nnx_loss, (X, Y))
    state = model.scales.get_value()
    first = state if isinstance(state, fp8jax.DotScaleState) else state.fc1
    # The input's scale is E4M3's max over its amax, no longer 1.
    assert float(first.x.scale) != 1.0
    assert float(first.x.amax_history[0]) > 0


@pytest.mark.parametrize("name", list(LINEN_MODULES))
def test_linen_step_over_params_alone_warns_and_names_make_train_step(name):
    model = LINEN_MODULES[name](RECIPE)
    variables = model.init(jax.random.key(1), X)

    def loss(params):
        out = model.apply({"params": params, "fp8_state": variables["fp8_state"]}, X)
        return jnp.mean(out**2)

    with pytest.warns(Fp8StateNotDifferentiatedWarning, match=r"fp8jax\.flax\.make_train_step"):
        jax.jit(jax.grad(loss))(variables["params"])


@pytest.mark.parametrize("name", list(LINEN_MODULES))
def test_linen_make_train_step_is_quiet(name):
    model = LINEN_MODULES[name](RECIPE)
    tx = optax.sgd(0.1)
    state = LinenTrainState.create(model.init(jax.random.key(1), X), tx)

    def loss_fn(variables, batch):
        return jnp.mean((model.apply(variables, batch[0]) - batch[1]) ** 2)

    state, _ = jax.jit(make_train_step(loss_fn, tx))(state, (X, Y))
    leaves = jax.tree.leaves(state.fp8_state, is_leaf=lambda n: isinstance(n, fp8jax.ScaleState))
    assert any(float(jnp.max(s.amax_history)) > 0 for s in leaves)


def test_input_gradients_and_current_scaling_are_quiet():
    # Saliency-style gradients take neither params nor state; CurrentScaling has no state.
    delayed = NNX_MODULES["DenseGeneral"](RECIPE)
    jax.grad(lambda x: jnp.sum(delayed(x)))(X)
    current = NNX_MODULES["DenseGeneral"](None)
    optimizer = nnx.Optimizer(current, optax.sgd(0.1), wrt=nnx.Param)
    nnx.jit(_plain_nnx_step)(current, optimizer)


def test_the_warning_can_be_made_an_error():
    model = NNX_MODULES["DenseGeneral"](RECIPE)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Fp8StateNotDifferentiatedWarning)
        with pytest.raises(Fp8StateNotDifferentiatedWarning, match="never be updated"):
            nnx.jit(_plain_nnx_step)(model, optimizer)


def test_the_warning_points_at_the_users_line():
    # Not at jax/_src/api_util.py: the first frame outside the libraries is the model call.
    model = NNX_MODULES["DenseGeneral"](RECIPE)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.warns(Fp8StateNotDifferentiatedWarning) as record:
        nnx.jit(_plain_nnx_step)(model, optimizer)
    assert record[0].filename == __file__
    with open(__file__) as source:
        line = source.readlines()[record[0].lineno - 1]
    assert "model(batch[0])" in line


@pytest.mark.parametrize("wrt", [nnx.Variable, fnnx.Fp8State, nnx.Any(nnx.Param, fnnx.Fp8State)])
def test_nnx_train_step_refuses_an_optimizer_over_the_fp8_state(wrt):
    # Issue 56, item 3: adam stepped the scales as if they were weights.
    model = fnnx.TransformerLayer(2, 32, 64, recipe=RECIPE, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(0.1), wrt=wrt)
    step = nnx.jit(fnnx.train_step, static_argnames=("loss_fn",))
    with pytest.raises(TypeError, match=r"wrt=.*FP8 scale state.*wrt=nnx\.Param"):
        step(model, optimizer, lambda m, x: jnp.mean(m(x) ** 2), X.reshape(2, 8, 32))

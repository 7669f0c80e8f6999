"""fp8jax.flax.checkpoint: params, optimizer and FP8 state round-trip; resuming is bitwise exact."""

import jax
import numpy as np
import optax
import pytest
import tiny_models as tm
from flax import nnx

import fp8jax
from fp8jax.flax import TrainState, checkpoint, make_train_step
from fp8jax.flax import nnx as fnnx

DELAYED = fp8jax.DelayedScaling(amax_history_len=8)


def assert_bitwise_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# standard_promotion: optax.adam (conftest.py).
@pytest.mark.usefixtures("standard_promotion")
def test_linen_resume_is_bitwise_identical(tmp_path):
    model = tm.LinenMlpStack(DELAYED)
    tx = optax.adam(3e-3)
    loss_fn = lambda v, b: tm.mse(model.apply(v, b[0]), b[1])  # noqa: E731
    step = jax.jit(make_train_step(loss_fn, tx))
    state = TrainState.create(jax.jit(model.init)(jax.random.key(0), tm.batch()[0]), tx)
    for i in range(3):
        state, _ = step(state, tm.batch(i))
    checkpoint.save(tmp_path, 3, state)
    assert checkpoint.latest_step(tmp_path) == 3
    uninterrupted, loss = step(state, tm.batch(3))

    # A fresh process would rebuild the template from the model and optimizer.
    template = jax.eval_shape(
        lambda: TrainState.create(model.init(jax.random.key(1), tm.batch()[0]), tx)
    )
    restored = checkpoint.restore(tmp_path, template)
    assert isinstance(restored, TrainState)
    assert_bitwise_equal(restored, state)  # params, adam moments, step and FP8 state
    resumed, resumed_loss = step(restored, tm.batch(3))
    assert float(resumed_loss) == float(loss)
    assert_bitwise_equal(resumed, uninterrupted)


@pytest.mark.usefixtures("standard_promotion")
def test_nnx_resume_is_bitwise_identical(tmp_path):
    def make(seed):
        model = tm.NnxMlpStack(DELAYED, rngs=nnx.Rngs(seed))
        return model, nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    step = nnx.jit(fnnx.train_step, static_argnames=("loss_fn",))
    loss_fn = lambda m, b: tm.mse(m(b[0]), b[1])  # noqa: E731
    model, optimizer = make(0)
    for i in range(3):
        step(model, optimizer, loss_fn, tm.batch(i))
    checkpoint.save_nnx(tmp_path, 3, model, optimizer)

    fresh, fresh_optimizer = make(1)
    checkpoint.restore_nnx(tmp_path, fresh, fresh_optimizer)
    assert_bitwise_equal(nnx.state((fresh, fresh_optimizer)), nnx.state((model, optimizer)))
    loss = step(model, optimizer, loss_fn, tm.batch(3))
    resumed_loss = step(fresh, fresh_optimizer, loss_fn, tm.batch(3))
    assert float(resumed_loss) == float(loss)
    assert_bitwise_equal(nnx.state((fresh, fresh_optimizer)), nnx.state((model, optimizer)))
    assert float(fresh.layers.scales.get_value().fc1.x.scale[0]) != 1.0


def test_restore_picks_a_step_and_keeps_max_to_keep(tmp_path):
    tree = {"w": np.arange(3.0, dtype=np.float32)}
    for step in range(4):
        checkpoint.save(tmp_path, step, {"w": tree["w"] + step}, max_to_keep=2)
    assert checkpoint.latest_step(tmp_path) == 3
    np.testing.assert_array_equal(checkpoint.restore(tmp_path, tree, step=2)["w"], tree["w"] + 2)
    with pytest.raises(FileNotFoundError, match=r"saved steps: \[2, 3\]"):
        checkpoint.restore(tmp_path, tree, step=0)


def test_save_refuses_a_step_orbax_would_skip(tmp_path):
    # Orbax writes only steps after the newest: saving step 1 again, or step 0
    # after it, returned without writing, and restore gave the older values.
    checkpoint.save(tmp_path, 1, {"w": np.zeros(2, np.float32)})
    for step in (1, 0):
        with pytest.raises(ValueError, match=f"step {step} cannot be written: .* holds step 1"):
            checkpoint.save(tmp_path, step, {"w": np.ones(2, np.float32)})
    np.testing.assert_array_equal(checkpoint.restore(tmp_path, {"w": np.ones(2)})["w"], [0, 0])
    checkpoint.save(tmp_path, np.int32(2), {"w": np.ones(2, np.float32)})  # an integer scalar
    assert checkpoint.latest_step(tmp_path) == 2


@pytest.mark.parametrize(
    ("step", "error"), [("3", TypeError), (1.0, TypeError), (True, TypeError), (-1, ValueError)]
)
def test_save_names_a_step_that_is_not_an_int_at_least_zero(tmp_path, step, error):
    with pytest.raises(error, match=f"step must be an int >= 0, got {step!r}"):
        checkpoint.save(tmp_path, step, {"w": np.zeros(2, np.float32)})


def test_restore_into_a_template_of_other_shapes_names_the_arrays(tmp_path, capfd):
    # Orbax's error named no array ("Requested shape: (4,) is not compatible with
    # the stored shape: (3,)") and its reads left in flight printed tracebacks.
    checkpoint.save(tmp_path, 0, {"w": np.zeros(3, np.float32), "b": np.zeros(2, np.float32)})
    like = {"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)}
    message = r"1 arrays differ in shape \(w: checkpoint \(3,\), like \(4,\)\)"
    with pytest.raises(ValueError, match=message):
        checkpoint.restore(tmp_path, like)
    assert "Event loop is closed" not in capfd.readouterr().err

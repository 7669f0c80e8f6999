"""bench/harness.py's timing loops, on the CPU: what they call, never how fast."""

import pathlib
import sys

import jax.numpy as jnp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "bench"))
import harness


def test_both_timing_loops_thread_the_state_through_every_call(monkeypatch):
    def step(state, increment):
        return state + increment, state

    monkeypatch.setitem(harness._heat, "seconds", 0.0)
    args = [jnp.zeros(()), jnp.ones(())]
    timing = harness._timed(step, args, warmup=2, iters=5, carry=True)
    # 2 warm-up calls, 5 synchronized ones and 5 pipelined ones, each fed the
    # state the call before it returned.
    assert float(args[0]) == 12
    assert timing["iters"] == 5
    assert timing["pipelined_ms"] > 0
    assert timing["p10_ms"] <= timing["median_ms"] <= timing["p90_ms"]


def test_heating_calls_the_step_back_to_back_ten_at_a_time_before_timing(monkeypatch):
    def step(state, increment):
        return state + increment, state

    monkeypatch.setitem(harness._heat, "seconds", 0.01)
    args = [jnp.zeros(()), jnp.ones(())]
    harness._timed(step, args, warmup=2, iters=5, carry=True)
    heated = float(args[0]) - 12
    assert heated >= 10 and heated % 10 == 0


def test_heat_is_a_start_option_recorded_in_the_environment(compile_cache_reset, monkeypatch):
    import argparse

    import pytest

    monkeypatch.setitem(harness._heat, "seconds", harness._heat["seconds"])
    parser = argparse.ArgumentParser()
    harness.add_compile_cache_argument(parser)
    harness.add_heat_argument(parser)
    assert harness.start(parser.parse_args(["--heat", "0.5"]))["heat_s"] == 0.5
    assert harness._heat["seconds"] == 0.5
    with pytest.raises(ValueError, match="--heat must be >= 0 seconds, got -1.0"):
        harness.start(parser.parse_args(["--heat", "-1"]))


def test_each_loss_gives_the_output_gradient_it_promises():
    # With the mean loss the output gradient is a constant, so XLA may fuse a
    # layer's forward with its backward; the random loss (the default) gives
    # the fixed random tensor r / size, the square loss the output / size.
    import jax
    import pytest

    y = jnp.arange(6.0).reshape(2, 3)
    r = harness.output_cotangent(y.shape)
    assert harness._loss["name"] == "random"
    grads = {}
    try:
        for name in ("random", "square", "mean"):
            harness.set_loss(name)
            grads[name] = jax.grad(harness.output_loss)(y, r)
    finally:
        harness.set_loss("random")
    assert jnp.allclose(grads["random"], r.astype(jnp.float32) / y.size)
    assert float(jnp.std(grads["random"])) > 0  # not a constant
    assert jnp.allclose(grads["square"], y / y.size)
    assert jnp.allclose(grads["mean"], jnp.full_like(y, 1 / y.size))
    assert jnp.array_equal(r, harness.output_cotangent(y.shape))  # fixed across calls
    with pytest.raises(ValueError, match="loss must be one of"):
        harness.set_loss("sum")


def test_compile_cache_is_off_unless_a_directory_is_given(tmp_path, compile_cache_reset):
    import argparse

    import jax

    parser = argparse.ArgumentParser()
    harness.add_compile_cache_argument(parser)
    harness.use_compile_cache(parser.parse_args([]))
    assert jax.config.jax_compilation_cache_dir is None
    harness.use_compile_cache(parser.parse_args(["--compile-cache", str(tmp_path / "c")]))
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c")


def test_start_applies_the_loss_and_records_it_only_where_a_script_has_one(compile_cache_reset):
    import argparse

    with_loss = argparse.ArgumentParser()
    harness.add_loss_argument(with_loss)
    harness.add_compile_cache_argument(with_loss)
    without_loss = argparse.ArgumentParser()
    harness.add_compile_cache_argument(without_loss)
    try:
        env = harness.start(with_loss.parse_args(["--loss", "square"]))
        assert env["loss"] == "square"
        assert harness.output_loss(jnp.full((2,), 2.0), None) == 2.0  # half the mean square
    finally:
        harness.set_loss("random")
    assert "loss" not in harness.start(without_loss.parse_args([]))


def test_a_calibrated_delayed_state_keeps_the_benchmark_gradient_from_quantizing_to_zero():
    # The random loss's output gradient is r / y.size: with a fresh state's
    # scale of 1 it lies far below E5M2's smallest subnormal (2**-16), so an
    # uncalibrated delayed row would time its backward GEMMs on zeros.
    import jax

    import fp8jax

    recipe = fp8jax.DelayedScaling(amax_history_len=4)
    # 2**20 outputs: every |r| / size is below half of E5M2's smallest subnormal.
    x = jax.random.normal(jax.random.key(0), (16384, 32), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (32, 64), jnp.float32)
    r = harness.output_cotangent((16384, 64))

    def loss(w, x, state, r):
        y = fp8jax.dense(x, w, recipe=recipe, state=state)
        return harness.output_loss(y, r)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    fresh = fp8jax.init_state(recipe)
    assert float(jnp.abs(step(w, x, fresh, r)[1][0]).max()) == 0.0  # every weight gradient lost

    state = harness.calibrate_state(step, [w, x, fresh, r], state_arg=2)
    gradient_amax = float(jnp.abs(r.astype(jnp.float32)).max()) / r.size
    assert float(state.grad.amax_history[0]) == pytest.approx(gradient_amax, rel=1e-2)
    assert float(state.grad.scale) == pytest.approx(fp8jax.E5M2.max / gradient_amax, rel=1e-2)
    w_grad = step(w, x, state, r)[1][0]
    exact = x.T @ (r.astype(jnp.float32) / r.size)
    # E5M2 keeps 2 mantissa bits (relative step 2**-2) on the gradient and E4M3
    # 3 bits on x; 0.15 of the largest entry bounds their product's error over
    # 16384 terms of random sign, whose errors partly cancel.
    assert float(jnp.abs(w_grad - exact).max()) <= 0.15 * float(jnp.abs(exact).max())


def test_flax_fp8_state_is_calibrated_before_timing_as_a_flax_training_loop_would():
    # Flax's Fp8DirectDotGeneralOp starts with scales of 1 and amax histories
    # of 0: the benchmark gradient (r / size) would quantize to zeros in E5M2.
    import flax.linen as nn
    import jax
    from flax.linen import fp8_ops

    owg = fp8_ops.OVERWRITE_WITH_GRADIENT
    model = nn.Dense(64, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp)
    x = jax.random.normal(jax.random.key(0), (16384, 32), jnp.float32)
    r = harness.output_cotangent((16384, 64))
    variables = model.init(jax.random.key(1), x)

    def loss(variables, x, r):
        return harness.output_loss(model.apply(variables, x), r)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    assert float(jnp.abs(step(variables, x, r)[1][0]["params"]["kernel"]).max()) == 0.0

    calibrated = harness.calibrate_flax_state(step, [variables, x, r])
    scales = calibrated[owg]["Fp8DirectDotGeneralOp_0"]
    gradient_amax = float(jnp.abs(r.astype(jnp.float32)).max()) / r.size
    # Flax stores the inverse of the scale it multiplies by: amax / 57344.
    assert float(scales["output_grad_scale"][0]) == pytest.approx(gradient_amax / 57344, rel=1e-2)
    assert float(jnp.abs(step(calibrated, x, r)[1][0]["params"]["kernel"]).max()) > 0.0


def test_gradients_with_an_all_zero_leaf_are_refused_whatever_the_others_hold():
    import jax

    good = {"w": jnp.ones((2, 3)), "b": jnp.array([0.0, 1e-30]), "step": jnp.zeros((), jnp.int32)}
    assert harness.check_gradients("row", good) == 2  # the integer leaf is not a gradient
    lost = {**good, "k": jnp.zeros((4, 4), jnp.bfloat16)}
    with pytest.raises(ValueError, match=r"row: 1 of 3 gradients are all zeros.*\['k'\]"):
        harness.check_gradients("row", lost)
    with pytest.raises(ValueError, match="no floating gradients"):
        harness.check_gradients("row", {"step": jnp.zeros((), jnp.int32), "none": None})
    assert jax.tree.leaves(good)  # unchanged


def test_measure_refuses_a_row_whose_uncalibrated_gradient_quantized_to_zeros(monkeypatch):
    # The delayed-scaling dense of the calibration test, its state left fresh
    # (state_arg=None): every weight gradient is zero, and measure must refuse
    # the row rather than time it; with the state calibrated it times it.
    import jax

    import fp8jax

    monkeypatch.setitem(harness._heat, "seconds", 0.0)
    recipe = fp8jax.DelayedScaling(amax_history_len=4)
    x = jax.random.normal(jax.random.key(0), (16384, 32), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (32, 64), jnp.float32)
    r = harness.output_cotangent((16384, 64))

    def loss(w, x, state, r):
        return harness.output_loss(fp8jax.dense(x, w, recipe=recipe, state=state), r)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    args = (w, x, fp8jax.init_state(recipe), r)
    with pytest.raises(ValueError, match="gradients are all zeros"):
        harness.measure("fresh", step, *args, iters=1, gradients=harness.grad_part(1))
    row = harness.measure(
        "calibrated", step, *args, iters=1, state_arg=2, gradients=harness.grad_part(1)
    )
    assert row["gradient_leaves_checked"] >= 2


def test_a_carried_step_is_calibrated_by_its_own_steps_before_its_gradients_are_checked(
    monkeypatch,
):
    # A train step feeds its state forward (carry): its FP8 state is calibrated
    # by running it, so the check sees the state after CALIBRATION_STEPS steps.
    import jax

    monkeypatch.setitem(harness._heat, "seconds", 0.0)
    seen = []

    def gradients(step, args):
        seen.append(int(args[0]))
        return {"g": jnp.float32(1.0)}

    step = jax.jit(lambda state, one: (state + one, state))
    harness.measure("carried", step, jnp.int32(0), jnp.int32(1), iters=1, carry=True,
                    gradients=gradients)  # fmt: skip
    assert seen == [harness.CALIBRATION_STEPS]

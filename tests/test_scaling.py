"""Delayed-scaling state: a 5-step hand computation, the swap-in and max-combine helpers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.scaling import init_scale_state, update_scale_state


def _hand_delayed(amaxes, history_len, algo, fp8_max):
    """TransformerEngine's rule written out, with NaN/Inf amaxes recorded as 0."""
    history, scale, out = [0.0] * history_len, 1.0, []
    for a in amaxes:
        a = a if np.isfinite(a) else 0.0
        history = [a, *history[:-1]]
        chosen = max(history) if algo == "max" else history[0]
        if chosen > 0:
            scale = fp8_max / chosen
        out.append((list(history), scale))
    return out


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_five_dense_steps_match_hand_computation(algo):
    recipe = fp8jax.DelayedScaling(amax_history_len=3, amax_compute_algo=algo)
    x_amaxes = [2.0, 4.0, float("nan"), 1.0, 3.0]
    g_amaxes = [8.0, 0.5, 16.0, float("inf"), 2.0]
    w = jnp.full((16, 4), 0.25, jnp.float32)
    state = fp8jax.init_state(recipe)

    def loss(w, state, x, r):
        return jnp.sum(fp8jax.dense(x, w, recipe=recipe, state=state) * r)

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    pattern = jnp.linspace(-1.0, 1.0, 8 * 16, dtype=jnp.float32).reshape(8, 16)
    g_pattern = jnp.linspace(1.0, -1.0, 8 * 4, dtype=jnp.float32).reshape(8, 4)
    for xa, ga in zip(x_amaxes, g_amaxes, strict=True):
        _, state_grad = step(w, state, pattern * xa, g_pattern * ga)
        state = fp8jax.take_new_state(state, state_grad)

    for role, amaxes, fp8_max in [
        ("x", x_amaxes, 448.0),
        ("kernel", [0.25] * 5, 448.0),
        ("grad", g_amaxes, 57344.0),
    ]:
        history, scale = _hand_delayed(amaxes, 3, algo, fp8_max)[-1]
        got = getattr(state, role)
        np.testing.assert_allclose(got.amax_history, history, rtol=1e-6, err_msg=role)
        np.testing.assert_allclose(got.scale, scale, rtol=1e-6, err_msg=role)


def test_margin_divides_scale_by_power_of_two():
    recipe = fp8jax.DelayedScaling(amax_history_len=2, margin=2)
    s = update_scale_state(init_scale_state(recipe), jnp.float32(7.0), 448.0, recipe)
    assert float(s.scale) == pytest.approx(448.0 / 7.0 / 4.0)


def test_zero_amax_keeps_previous_scale():
    recipe = fp8jax.DelayedScaling(amax_history_len=1)
    s = init_scale_state(recipe)._replace(scale=jnp.float32(3.0))
    s = update_scale_state(s, jnp.float32(0.0), 448.0, recipe)
    assert float(s.scale) == 3.0


def test_unused_state_is_kept_by_take_new_state():
    recipe = fp8jax.DelayedScaling(amax_history_len=2)
    used, unused = fp8jax.init_state(recipe), fp8jax.init_state(recipe)
    unused = unused._replace(x=unused.x._replace(scale=jnp.float32(5.0)))
    x, w = jnp.ones((4, 8)), jnp.ones((8, 2))

    def loss(states):
        return fp8jax.dense(x, w, recipe=recipe, state=states[0]).sum()

    grads = jax.grad(loss)((used, unused))
    new_used, new_unused = fp8jax.take_new_state((used, unused), grads)
    assert float(new_unused.x.scale) == 5.0  # a zero cotangent must not zero the state
    assert float(new_used.x.amax_history[0]) == 1.0


def test_combine_states_equals_one_big_batch():
    recipe = fp8jax.DelayedScaling(amax_history_len=4)
    state = fp8jax.init_state(recipe)
    w = jax.random.normal(jax.random.key(0), (16, 8))
    x = jax.random.normal(jax.random.key(1), (2, 8, 16)) * jnp.array([1.0, 3.0])[:, None, None]
    r = jax.random.normal(jax.random.key(2), (2, 8, 8)) * jnp.array([5.0, 0.5])[:, None, None]

    def new_state(x, r):
        g = jax.grad(lambda s: jnp.sum(fp8jax.dense(x, w, recipe=recipe, state=s) * r))(state)
        return fp8jax.take_new_state(state, g)

    combined = fp8jax.combine_states(new_state(x[0], r[0]), new_state(x[1], r[1]), recipe=recipe)
    whole = new_state(x.reshape(16, 16), r.reshape(16, 8))
    for a, b in zip(jax.tree.leaves(combined), jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(a, b)


def test_combine_states_rejects_current_scaling():
    with pytest.raises(TypeError, match="DelayedScaling recipe"):
        fp8jax.combine_states(None, None, recipe=fp8jax.CurrentScaling())


def test_stacked_state_updates_each_layer_on_its_own():
    # nn.scan stacks states on a leading layer axis; one layer's amax must not
    # reach another layer's scale.
    recipe = fp8jax.DelayedScaling(amax_history_len=3)
    one = init_scale_state(recipe)
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), one)
    amaxes = jnp.array([2.0, 8.0])
    got = update_scale_state(stacked, amaxes, 448.0, recipe)
    for layer in range(2):
        want = update_scale_state(one, amaxes[layer], 448.0, recipe)
        np.testing.assert_array_equal(got.amax_history[layer], want.amax_history)
        np.testing.assert_array_equal(got.scale[layer], want.scale)


def test_an_op_states_update_compiles_to_two_kernels_a_tensor():
    # Each kernel costs a synchronized step a few microseconds of launch
    # (bench/results/h200-2026-11-30-k). Written with jnp.roll and .at[0].set,
    # XLA made four a tensor: a concatenate, a dynamic-update-slice, the
    # history's max and the scale. Now the new history and its max share one
    # reduction kernel, and the scale takes one scalar kernel.
    import re

    from fp8jax.verify import compile_for

    recipe = fp8jax.DelayedScaling(amax_history_len=1024)

    def update(state, amaxes):
        return fp8jax.DotScaleState(*(
            update_scale_state(s, a, 448.0, recipe) for s, a in zip(state, amaxes, strict=True)
        ))  # fmt: skip

    amaxes = [jax.ShapeDtypeStruct((), jnp.float32)] * 3
    hlo = compile_for(update, fp8jax.init_state(recipe), amaxes, target="h100")
    entry = hlo[hlo.index("ENTRY") :]
    launches = re.compile(r" (fusion|copy|custom-call)\(")
    kernels = [line for line in entry.splitlines() if launches.search(line)]
    assert len(kernels) == 6, "\n".join(kernels)
    assert "concatenate" not in entry and "dynamic-update-slice" not in entry

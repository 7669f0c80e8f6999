"""Delayed-scaling state: a 5-step hand computation, the swap-in and max-combine helpers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.scaling import ScaleState, init_scale_state, update_group, update_scale_state


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

    grads = jax.jit(jax.grad(loss))((used, unused))  # one program, not one per op
    new_used, new_unused = jax.jit(fp8jax.take_new_state)((used, unused), grads)
    assert float(new_unused.x.scale) == 5.0  # a zero cotangent must not zero the state
    assert float(new_used.x.amax_history[0]) == 1.0


def test_combine_states_equals_one_big_batch():
    recipe = fp8jax.DelayedScaling(amax_history_len=4)
    state = fp8jax.init_state(recipe)
    w = jax.random.normal(jax.random.key(0), (16, 8))
    x = jax.random.normal(jax.random.key(1), (2, 8, 16)) * jnp.array([1.0, 3.0])[:, None, None]
    r = jax.random.normal(jax.random.key(2), (2, 8, 8)) * jnp.array([5.0, 0.5])[:, None, None]

    # Both sides jitted, one program per step: eagerly every step compiled on its own.
    @jax.jit
    def new_state(x, r):
        g = jax.grad(lambda s: jnp.sum(fp8jax.dense(x, w, recipe=recipe, state=s) * r))(state)
        return fp8jax.take_new_state(state, g)

    combine = jax.jit(lambda a, b: fp8jax.combine_states(a, b, recipe=recipe))
    combined = combine(new_state(x[0], r[0]), new_state(x[1], r[1]))
    whole = new_state(x.reshape(16, 16), r.reshape(16, 8))
    for a, b in zip(jax.tree.leaves(combined), jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(a, b)


def test_combine_states_rejects_current_scaling():
    with pytest.raises(TypeError, match="DelayedScaling recipe"):
        fp8jax.combine_states(None, None, recipe=fp8jax.CurrentScaling())


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        ("mlp", TypeError, r"combine_states: b must have the structure of a.*MlpScaleState"),
        ("longer", ValueError, r"b\.x has .* \(\(8,\), \(\)\), expected a's \(\(4,\), \(\)\)"),
    ],
)
def test_combine_states_refuses_states_that_do_not_match(bad, error, match):
    recipe = fp8jax.DelayedScaling(amax_history_len=4)
    if bad == "mlp":
        bad = fp8jax.init_state(recipe, fp8jax.MlpScaleState)
    else:
        bad = fp8jax.init_state(fp8jax.DelayedScaling(amax_history_len=8))
    with pytest.raises(error, match=match):
        fp8jax.combine_states(fp8jax.init_state(recipe), bad, recipe=recipe)


def test_combine_states_refuses_a_recipe_of_another_history_length():
    # make_train_step(recipe=...) merges micro-batch states with the recipe it is
    # given; another recipe's scales were computed without a word.
    layer = fp8jax.init_state(fp8jax.DelayedScaling(amax_history_len=4))
    states = jax.tree.map(lambda s: jnp.stack([s, s]), layer)  # two scanned layers
    recipe = fp8jax.DelayedScaling(amax_history_len=8)
    match = r"a\.x\.amax_history has shape \(2, 4\), but the recipe's amax_history_len=8"
    with pytest.raises(ValueError, match=match):
        fp8jax.combine_states(states, states, recipe=recipe)


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


def _group_with_history(recipe, group, seed):
    """A state group whose histories and scales hold varied values, with some zeros and NaN-free."""
    state = fp8jax.init_state(recipe, group)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    filled = [
        jnp.abs(jax.random.normal(k, a.shape)) * 10 for k, a in zip(keys, leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, filled)


@pytest.mark.parametrize(
    "group", [fp8jax.DotScaleState, fp8jax.MlpScaleState], ids=lambda g: g.__name__
)
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_update_group_gives_each_tensors_own_update(group, algo):
    # update_group stacks the group's histories; every tensor must get exactly
    # what update_scale_state gives it alone, with its own format's maximum
    # (E4M3 for x and kernel, E5M2 for grad), including a 0 and a NaN amax
    # (the old scale kept, nothing stored).
    recipe = fp8jax.DelayedScaling(amax_history_len=4, margin=1, amax_compute_algo=algo)
    state = _group_with_history(recipe, group, seed=0)
    flat = (
        [0.0, 3.0, jnp.nan]
        if group is fp8jax.DotScaleState
        else [[0.0, 3.0, jnp.nan], [5.0, 0.5, 1e-3]]
    )
    amaxes = jax.tree.map(jnp.float32, flat)
    got = jax.jit(update_group, static_argnums=2)(state, amaxes, recipe)
    subgroups = [state] if group is fp8jax.DotScaleState else list(state)
    sub_amaxes = [amaxes] if group is fp8jax.DotScaleState else amaxes
    got_subgroups = [got] if group is fp8jax.DotScaleState else list(got)
    maxes = {"x": fp8jax.E4M3.max, "kernel": fp8jax.E4M3.max, "grad": fp8jax.E5M2.max}
    for sub, sub_amax, got_sub in zip(subgroups, sub_amaxes, got_subgroups, strict=True):
        for role, old, amax, new in zip(sub._fields, sub, sub_amax, got_sub, strict=True):
            want = update_scale_state(old, amax, maxes[role], recipe)
            np.testing.assert_array_equal(new.amax_history, want.amax_history)
            np.testing.assert_array_equal(new.scale, want.scale)


def test_update_group_updates_stacked_layers_and_unequal_histories():
    # A scanned model's state has a leading layer axis; a hand-made group may
    # mix history lengths, which cannot stack and are updated one by one.
    recipe = fp8jax.DelayedScaling(amax_history_len=3)
    one = _group_with_history(recipe, fp8jax.DotScaleState, seed=1)
    layers = jax.tree.map(lambda a: jnp.stack([a, 2 * a]), one)
    amaxes = (jnp.array([1.0, 2.0]), jnp.array([4.0, 0.0]), jnp.array([8.0, 16.0]))
    update = jax.jit(lambda group, amaxes: update_group(group, amaxes, recipe))  # both sides
    got = update(layers, amaxes)
    for layer in range(2):
        want = update(jax.tree.map(lambda a, i=layer: a[i], layers),
                      tuple(a[layer] for a in amaxes))  # fmt: skip
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a[layer], b)
    mixed = one._replace(grad=ScaleState(jnp.ones(5), jnp.float32(2.0)))
    got = update_group(mixed, (1.0, 2.0, 4.0), recipe)
    assert got.grad.amax_history.shape == (5,) and got.x.amax_history.shape == (3,)
    np.testing.assert_array_equal(
        got.grad.scale,
        update_scale_state(mixed.grad, jnp.float32(4.0), fp8jax.E5M2.max, recipe).scale,
    )


def test_update_group_names_a_wrong_number_of_amaxes():
    recipe = fp8jax.DelayedScaling()
    with pytest.raises(ValueError, match=r"one amax per tensor of the DotScaleState \(3\), got 2"):
        update_group(fp8jax.init_state(recipe), (1.0, 2.0), recipe)


GROUPS = [fp8jax.DotScaleState, fp8jax.MlpScaleState]


@pytest.fixture(scope="module")
def group_update_hlos():
    """``{group: HLO}`` of each group's update_group for an H100, in one child process."""
    from fp8jax.verify import compile_many

    recipe = fp8jax.DelayedScaling(amax_history_len=1024)
    calls = []
    for group in GROUPS:
        state = fp8jax.init_state(recipe, group)
        amaxes = jax.tree.map(
            lambda _: jax.ShapeDtypeStruct((), jnp.float32), jax.tree.leaves(state)[::2]
        )
        calls.append((lambda s, a: update_group(s, a, recipe), (state, amaxes)))
    return dict(zip(GROUPS, compile_many(calls, target="h100"), strict=True))


@pytest.mark.deviceless
@pytest.mark.parametrize("group", GROUPS, ids=lambda g: g.__name__)
def test_a_group_update_compiles_to_three_kernels(group, group_update_hlos):
    # Each kernel costs a synchronized step a few microseconds of launch
    # (docs/design.md#the-delayed-scaling-state-as-a-cotangent). Written with jnp.roll and
    # .at[0].set, XLA made four a tensor: a concatenate, a dynamic-update-slice, the
    # history's max and the scale. With the shift as a pad and a select, two
    # a tensor: six for an op's three. Stacked by update_group, the whole
    # group's maxima take one reduction kernel, its scales one kernel and its
    # histories one, for layernorm_mlp's six tensors as for dense's three.
    import re

    hlo = group_update_hlos[group]
    entry = hlo[hlo.index("ENTRY") :]
    launches = re.compile(r" (fusion|copy|custom-call)\(")
    kernels = [line for line in entry.splitlines() if launches.search(line)]
    assert len(kernels) == 3, "\n".join(kernels)
    assert "concatenate" not in entry and "dynamic-update-slice" not in entry


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (None, TypeError, r"must have the structure of old_state.*PyTreeDef\(None\)"),
        ({"x": 1.0}, TypeError, r"state_grads must have the structure of old_state.*dict"),
        ("x_only", TypeError, r"state_grads must have the structure of old_state.*ScaleState"),
        ("longer", ValueError, r"state_grads\.x has .* \(\(8,\), \(\)\), expected .*\(\(4,\)"),
    ],
)
def test_take_new_state_refuses_a_state_grads_that_does_not_fit(bad, error, match):
    state = fp8jax.init_state(fp8jax.DelayedScaling(amax_history_len=4))
    if bad == "x_only":
        bad = state.x
    elif bad == "longer":
        bad = fp8jax.init_state(fp8jax.DelayedScaling(amax_history_len=8))
    with pytest.raises(error, match=match):
        fp8jax.take_new_state(state, bad)

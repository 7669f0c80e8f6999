"""fp8jax.optim.fused_adamw: optax's clip + AdamW chain bit for bit, one fusion per parameter."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fp8jax.optim import fused_adamw

SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=3, decay_steps=20,
                                              end_value=3e-4)  # fmt: skip


def _params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "kernel": jax.random.normal(k1, (64, 96), jnp.float32),
        "bias": jax.random.normal(k2, (96,), jnp.float32),
        "nested": {"scale": 1.0 + 0.1 * jax.random.normal(k3, (7,), jnp.float32)},
    }


def _grads(key, step, scale):
    key = jax.random.fold_in(key, step)
    return jax.tree.map(lambda p: scale * jax.random.normal(key, p.shape, p.dtype), _params(key))


def _run(tx, steps, grad_scale):
    """``steps`` jitted updates from the same gradients; the params and state after each."""
    params = _params(jax.random.key(0))

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state, history = tx.init(params), []
    for i in range(steps):
        # optax mixes its int32 step count with floats, as fp8jax train lets it.
        # Alternate norms below and above the clip, so both branches run.
        scale = grad_scale if i % 2 else 10 * grad_scale
        with jax.numpy_dtype_promotion("standard"):
            params, state = step(params, state, _grads(jax.random.key(1), i, scale))
        history.append((params, state))
    return history


@pytest.mark.parametrize("learning_rate", [SCHEDULE, 1e-3])
@pytest.mark.parametrize("max_grad_norm", [1.0, None])
@pytest.mark.parametrize("weight_decay", [0.1, 0.0])
def test_bitwise_equal_to_the_optax_chain(learning_rate, max_grad_norm, weight_decay):
    kw = {"b1": 0.9, "b2": 0.95, "eps": 1e-8, "weight_decay": weight_decay}
    adamw = optax.adamw(learning_rate, **kw)
    reference = adamw if max_grad_norm is None else optax.chain(
        optax.clip_by_global_norm(max_grad_norm), adamw
    )  # fmt: skip
    fused = fused_adamw(learning_rate, **kw, max_grad_norm=max_grad_norm)
    for (p_ref, s_ref), (p_new, s_new) in zip(
        _run(reference, 6, 0.05), _run(fused, 6, 0.05), strict=True
    ):
        assert jax.tree.structure(s_ref) == jax.tree.structure(s_new)
        for a, b in zip(jax.tree.leaves((p_ref, s_ref)), jax.tree.leaves((p_new, s_new)),
                        strict=True):  # fmt: skip
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_clip_ran():
    # The same chain without the clip ends elsewhere: the comparison above covers the clip.
    clipped = _run(fused_adamw(1e-3, max_grad_norm=1.0), 2, 0.05)[-1][0]
    unclipped = _run(fused_adamw(1e-3), 2, 0.05)[-1][0]
    assert not np.array_equal(np.asarray(clipped["kernel"]), np.asarray(unclipped["kernel"]))


def test_update_without_params_names_the_argument():
    tx = fused_adamw(1e-3)
    params = _params(jax.random.key(0))
    with pytest.raises(ValueError, match="needs params="):
        tx.update(params, tx.init(params))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"b1": 1.0}, ValueError, r"b1 must be a float in \[0, 1\), got 1.0"),
        ({"b2": -0.1}, ValueError, r"b2 must be a float in \[0, 1\), got -0.1"),
        ({"eps": -1.0}, ValueError, "eps must be a float >= 0, got -1.0"),
        ({"max_grad_norm": 0.0}, ValueError, "max_grad_norm must be a float > 0 or None, got 0.0"),
        ({"weight_decay": "0.1"}, TypeError, "weight_decay must be a float, got '0.1'"),
    ],
)
def test_hyperparameters_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        fused_adamw(1e-3, **kwargs)


def test_learning_rate_is_checked():
    with pytest.raises(TypeError, match="learning_rate must be a float or an optax schedule"):
        fused_adamw("1e-3")


def _update_fusions(hlo: str, shape: tuple[int, ...]) -> list[str]:
    """The entry computation's fusions whose outputs include an f32 array of ``shape``."""
    entry = hlo[hlo.index("\nENTRY") :]
    dims = ",".join(str(d) for d in shape)
    return [
        line for line in entry.splitlines()
        if " fusion(" in line and f"f32[{dims}]" in line.split(" fusion(")[0]
    ]  # fmt: skip


@pytest.mark.deviceless
def test_one_fusion_per_parameter_on_the_gpu():
    from fp8jax.verify import compile_for

    tx = fused_adamw(SCHEDULE, b2=0.95, weight_decay=0.1, max_grad_norm=1.0)
    params = jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), _params(jax.random.key(0))
    )
    state = jax.eval_shape(tx.init, params)

    def step(params, grads, state):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    with jax.numpy_dtype_promotion("standard"):
        hlo = compile_for(step, params, params, state, target="h200")
    for leaf in jax.tree.leaves(params):
        fusions = _update_fusions(hlo, leaf.shape)
        # One multi-output fusion writes the new parameter and both moments.
        assert len(fusions) == 1, fusions
        outputs = re.match(r"\s*%\S+ = \((.*?)\) fusion\(", fusions[0]).group(1)
        assert outputs.count(f"f32[{','.join(map(str, leaf.shape))}]") == 3, fusions[0]


# An independent reference: AdamW with clipping by the global norm, written out
# in numpy f64 from the algorithm (Loshchilov & Hutter's decoupled decay, as
# optax orders it: decay joins the Adam step, both times the learning rate).
def _warmup(step):
    """A hand-written schedule, the same formula in jnp (the op) and numpy f64 (the reference)."""
    return 3e-3 * jnp.minimum(1.0, (step + 1.0) / 3.0)


def _warmup_f64(step):
    return 3e-3 * min(1.0, (step + 1.0) / 3.0)


def _numpy_adamw(params, grads_per_step, *, lr, b1, b2, eps, weight_decay, max_grad_norm):
    """Each step's params (f64) and each element's error budget against f32 arithmetic.

    The budget adds, per step, the f32 roundings an element's update goes
    through: about 12 (clip 2, moments 4 + 3, bias corrections 2, sqrt, eps,
    divide), each a relative 2**-24 of the magnitude ``|m| / (sqrt(v) + eps)``
    (``|m|`` the first moment of ``|g|``, which bounds cancellation in m), plus the
    global norm's sum of squares over n elements, a relative (log2(n) + 2) 2**-24
    at worst for a tree-ordered sum, times 32 to cover a linear order's partial
    sums growing with sqrt(n) in practice; and 4 roundings of |p| (decay,
    learning rate, apply). Budget unit: 2**-24, f32's half step.
    """
    u = 2.0**-24
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    mu = {k: np.zeros_like(v) for k, v in p.items()}
    mu_abs = {k: np.zeros_like(v) for k, v in p.items()}
    nu = {k: np.zeros_like(v) for k, v in p.items()}
    budget = {k: np.zeros_like(v) for k, v in p.items()}
    n = sum(v.size for v in p.values())
    norm_units = 32 * (np.ceil(np.log2(n)) + 2)
    history = []
    for t, grads in enumerate(grads_per_step, start=1):
        g = {k: np.asarray(v, np.float64) for k, v in grads.items()}
        norm = np.sqrt(sum(np.sum(v * v) for v in g.values()))
        if max_grad_norm is not None and norm >= max_grad_norm:
            g = {k: v / norm * max_grad_norm for k, v in g.items()}
        step = lr(t - 1) if callable(lr) else lr
        for k in p:
            mu[k] = b1 * mu[k] + (1 - b1) * g[k]
            mu_abs[k] = b1 * mu_abs[k] + (1 - b1) * np.abs(g[k])
            nu[k] = b2 * nu[k] + (1 - b2) * g[k] ** 2
            denom = np.sqrt(nu[k] / (1 - b2**t)) + eps
            update = (mu[k] / (1 - b1**t)) / denom + weight_decay * p[k]
            magnitude = (mu_abs[k] / (1 - b1**t)) / denom
            budget[k] = (
                budget[k]
                + step * u * (12 + norm_units) * magnitude
                + 4 * u * (np.abs(p[k]) + step * weight_decay * np.abs(p[k]))
            )
            p[k] = p[k] - step * update
        history.append(
            ({k: v.copy() for k, v in p.items()}, {k: v.copy() for k, v in budget.items()})
        )
    return history


def _flat(tree):
    return {
        jax.tree_util.keystr(path): np.asarray(v) for path, v in jax.tree.leaves_with_path(tree)
    }


@pytest.mark.parametrize("schedule", [True, False], ids=["warmup", "constant"])
@pytest.mark.parametrize("max_grad_norm", [1.0, None], ids=["clip", "no-clip"])
@pytest.mark.parametrize("weight_decay", [0.1, 0.0], ids=["decay", "no-decay"])
def test_within_derived_budgets_of_a_numpy_adamw(schedule, max_grad_norm, weight_decay):
    # Gradient norms alternate about 4 (clipped to 1) and 0.4 (kept): both branches.
    grad_scale, steps = 0.005, 5
    kw = {"b1": 0.9, "b2": 0.95, "eps": 1e-8, "weight_decay": weight_decay}
    tx = fused_adamw(_warmup if schedule else 1e-3, **kw, max_grad_norm=max_grad_norm)
    got = [_flat(params) for params, _ in _run(tx, steps, grad_scale)]
    grads = [_flat(_grads(jax.random.key(1), i, grad_scale if i % 2 else 10 * grad_scale))
             for i in range(steps)]  # fmt: skip
    norms = [np.sqrt(sum(np.sum(np.float64(g) ** 2) for g in step.values())) for step in grads]
    assert min(norms) < 1.0 < max(norms)  # the clip both acts and stays out
    want = _numpy_adamw(_flat(_params(jax.random.key(0))), grads, lr=_warmup_f64 if schedule
                        else 1e-3, **kw, max_grad_norm=max_grad_norm)  # fmt: skip
    for step, (params, (ref, budget)) in enumerate(zip(got, want, strict=True)):
        for name in ref:
            err = np.abs(params[name].astype(np.float64) - ref[name])
            worst = np.argmax(err - budget[name])
            assert np.all(err <= budget[name]), (
                f"step {step} {name}: |error| {err.flat[worst]:.3g} > budget "
                f"{budget[name].flat[worst]:.3g}"
            )

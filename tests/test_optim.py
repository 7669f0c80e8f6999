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

"""AdamW with global-norm clipping as one fused update per parameter, as an optax transformation.

:func:`fused_adamw` computes what
``optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.adamw(...))``
computes, with the same operations in the same order and the same state, so
its updates match that chain's bit for bit and a run can switch between the
two mid-way (its checkpoints hold the same tree). What differs is the form:
after the one reduction the global norm needs, each parameter's clip, both
moments, the bias corrections, the weight decay and the learning rate are a
single elementwise expression of that parameter's gradient, moments and
value, which XLA compiles to one multi-output fusion per parameter (the
optimizer's floor: read the parameter, its gradient and both moments once,
write the moments once; docs/design.md#the-ceiling-of-a-step-and-the-element-wise-floor).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax._src import numerics


class _Leaf(NamedTuple):
    """One parameter's new moments and its update."""

    mu: jax.Array
    nu: jax.Array
    update: jax.Array


def fused_adamw(
    learning_rate: float | optax.Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    *,
    max_grad_norm: float | None = None,
) -> optax.GradientTransformation:
    """AdamW after global-norm clipping, one fused elementwise update per parameter.

    Equal to ``optax.chain(optax.clip_by_global_norm(max_grad_norm),
    optax.adamw(learning_rate, b1, b2, eps, weight_decay=weight_decay))``
    (without the clip when ``max_grad_norm`` is None), state included.

    Args:
      learning_rate: a float or an optax schedule of the step count.
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to the square root of the second moment.
      weight_decay: decoupled weight decay, scaled by the learning rate.
      max_grad_norm: clip the gradients to this global norm, or None.

    Returns:
      An ``optax.GradientTransformation``; ``update`` needs ``params``.

    Raises:
      TypeError, ValueError: for a hyperparameter out of its range.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from fp8jax.optim import fused_adamw
      >>> tx = fused_adamw(1e-3, b2=0.95, weight_decay=0.1, max_grad_norm=1.0)
      >>> params = {"w": jnp.ones((2, 3))}
      >>> updates, state = tx.update({"w": jnp.full((2, 3), 5.0)}, tx.init(params), params)
      >>> optax.apply_updates(params, updates)["w"][0, 0]
      Array(0.9989, dtype=float32)
    """
    _check_hyperparameters(learning_rate, b1, b2, eps, weight_decay, max_grad_norm)
    reference = _reference_chain(learning_rate, b1, b2, eps, weight_decay, max_grad_norm)

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(
                "fused_adamw's update needs params= (the weight decay reads them); got None."
            )
        clip_state, (adam, decay_state, lr_state) = _split_state(state, max_grad_norm)
        count_inc = numerics.safe_increment(adam.count)
        scalars = _scalars(updates, adam.count, count_inc, lr_state, learning_rate, b1, b2,
                           max_grad_norm)  # fmt: skip
        leaves = jax.tree.map(
            lambda g, m, v, p: _leaf(g, m, v, p, scalars, b1, b2, eps, weight_decay),
            updates, adam.mu, adam.nu, params,
        )  # fmt: skip
        new_adam = optax.ScaleByAdamState(
            count=count_inc, mu=_field(leaves, "mu"), nu=_field(leaves, "nu")
        )
        if isinstance(lr_state, optax.ScaleByScheduleState):
            lr_state = optax.ScaleByScheduleState(count=numerics.safe_increment(lr_state.count))
        new_state = (new_adam, decay_state, lr_state)
        if max_grad_norm is not None:
            new_state = (clip_state, new_state)
        return _field(leaves, "update"), new_state

    return optax.GradientTransformation(reference.init, update_fn)


def _field(leaves, name: str):
    """The tree of one :class:`_Leaf` field."""
    return jax.tree.map(
        lambda leaf: getattr(leaf, name), leaves, is_leaf=lambda x: isinstance(x, _Leaf)
    )


def _reference_chain(learning_rate, b1, b2, eps, weight_decay, max_grad_norm):
    """The optax chain fused_adamw equals; its ``init`` is fused_adamw's."""
    adamw = optax.adamw(learning_rate, b1, b2, eps, weight_decay=weight_decay)
    if max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw)


def _split_state(state, max_grad_norm):
    """``(clip state or None, (adam, decay, learning-rate state))`` of the chain's state."""
    if max_grad_norm is None:
        return None, state
    return state


def _scalars(grads, count, count_inc, lr_state, learning_rate, b1, b2, max_grad_norm):
    """The step's scalars, as optax's transformations compute them."""
    if max_grad_norm is None:
        keep, g_norm = None, None
    else:
        g_norm = optax.tree.norm(grads)
        keep = jnp.squeeze(g_norm < max_grad_norm)
    if isinstance(lr_state, optax.ScaleByScheduleState):
        step_size = -1 * learning_rate(lr_state.count)
    else:
        step_size = -1 * learning_rate
    return {
        "keep": keep,
        "g_norm": g_norm,
        "max_norm": max_grad_norm,
        "bc1": 1 - b1**count_inc,
        "bc2": 1 - b2**count_inc,
        "step_size": step_size,
    }


def _leaf(g, mu, nu, p, s, b1, b2, eps, weight_decay) -> _Leaf:
    """One parameter's clip, moments, bias corrections, decay and step: one expression."""
    if s["keep"] is not None:
        g = jax.lax.select(s["keep"], g, (g / s["g_norm"].astype(g.dtype)) * s["max_norm"])
    mu_new = (1 - b1) * (g**1) + b1 * mu
    nu_new = (1 - b2) * (g**2) + b2 * nu
    mu_hat = mu_new / s["bc1"].astype(mu_new.dtype)
    nu_hat = nu_new / s["bc2"].astype(nu_new.dtype)
    update = mu_hat / (jnp.sqrt(nu_hat + 0.0) + eps)
    if not (isinstance(weight_decay, int | float) and weight_decay == 0.0):
        update = update + weight_decay * p
    update = jnp.array(s["step_size"], dtype=update.dtype) * update
    return _Leaf(mu_new.astype(mu.dtype), nu_new.astype(nu.dtype), update)


def _check_hyperparameters(learning_rate, b1, b2, eps, weight_decay, max_grad_norm) -> None:
    if not (callable(learning_rate) or isinstance(learning_rate, int | float)):
        raise TypeError(
            f"learning_rate must be a float or an optax schedule, got {learning_rate!r}."
        )
    for name, value in (("b1", b1), ("b2", b2)):
        if not (isinstance(value, int | float) and 0.0 <= value < 1.0):
            raise ValueError(f"{name} must be a float in [0, 1), got {value!r}.")
    if not (isinstance(eps, int | float) and eps >= 0.0):
        raise ValueError(f"eps must be a float >= 0, got {eps!r}.")
    if not isinstance(weight_decay, int | float):
        raise TypeError(f"weight_decay must be a float, got {weight_decay!r}.")
    if max_grad_norm is not None and not (
        isinstance(max_grad_norm, int | float) and max_grad_norm > 0.0
    ):
        raise ValueError(f"max_grad_norm must be a float > 0 or None, got {max_grad_norm!r}.")

"""NNX train step: optax on params through ``nnx.Optimizer``, FP8 state swapped in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from fp8jax.flax.nnx._base import Fp8State
from fp8jax.flax.train import OPTIMIZER_SCOPE, grads_and_fp8_state
from fp8jax.recipes import DelayedScaling


def train_step(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    loss_fn: Callable[[nnx.Module, Any], jax.Array],
    batch,
    *,
    accumulation_steps: int = 1,
    recipe: DelayedScaling | None = None,
) -> jax.Array:
    """One optimizer step on ``model``, in place; returns the loss.

    The loss is differentiated with respect to the optimizer's parameters
    (``optimizer.wrt``) and every :class:`Fp8State`. Param gradients go to
    ``optimizer.update``; the FP8 state "gradients" are the ops' new states and
    are swapped in with ``fp8jax.take_new_state`` (per layer when stacked by
    ``nnx.scan``/``nnx.vmap``). Other state the loss changes (RNG counts for
    dropout, say) is written back too.

    Args:
      model: the model, updated in place.
      optimizer: ``nnx.Optimizer(model, tx, wrt=nnx.Param)``.
      loss_fn: ``loss_fn(model, batch) -> scalar loss``.
      batch: a pytree whose leaves share a leading batch axis.
      accumulation_steps: split the batch into this many micro-batches,
        average gradients and merge FP8 states by max.
      recipe: the model's DelayedScaling; required when accumulating with state.

    Returns:
      The loss (the mean over micro-batches).

    Example:
      >>> import jax.numpy as jnp, optax, fp8jax
      >>> from flax import nnx
      >>> from fp8jax.flax import nnx as fnnx
      >>> recipe = fp8jax.DelayedScaling(amax_history_len=4)
      >>> model = fnnx.DenseGeneral(32, 8, recipe=recipe, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> loss_fn = lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2)
      >>> step = nnx.jit(fnnx.train_step, static_argnames=("loss_fn",))
      >>> loss = step(model, optimizer, loss_fn, (jnp.ones((16, 32)), jnp.zeros((16, 8))))
      >>> float(model.scales.get_value().x.scale)
      448.0
    """
    _check_wrt(model, optimizer.wrt)
    graphdef, params, fp8_state, rest = nnx.split(model, optimizer.wrt, Fp8State, ...)

    def split_loss(params, fp8_state, rest, batch):
        # jax.grad hands undifferentiated arguments over as they are; rebuilding
        # their Variables here lets the loss update them (RNG counts) at this trace.
        rest = jax.tree.map(lambda leaf: leaf, rest)
        merged = nnx.merge(graphdef, params, fp8_state, rest)
        loss = loss_fn(merged, batch)
        return loss, nnx.split(merged, optimizer.wrt, Fp8State, ...)[3]

    loss, grads, fp8_state, rest = grads_and_fp8_state(
        split_loss,
        params,
        fp8_state,
        rest,
        batch,
        accumulation_steps=accumulation_steps,
        recipe=recipe,
    )
    with jax.named_scope(OPTIMIZER_SCOPE):
        optimizer.update(model, grads)
    nnx.update(model, fp8_state, rest)
    return loss


def _check_wrt(model: nnx.Module, wrt) -> None:
    """Raises if the optimizer's ``wrt`` takes in FP8 state, which must never reach optax."""
    taken = [
        "/".join(map(str, path))
        for path, variable in nnx.to_flat_state(nnx.state(model, wrt))
        if isinstance(variable, Fp8State)
    ]
    if taken:
        raise TypeError(
            f"train_step: the optimizer's wrt={wrt!r} includes the model's FP8 scale state "
            f"({', '.join(taken[:3])}{', ...' if len(taken) > 3 else ''}), which the ops "
            "update themselves and an optimizer must never step. Optimize the parameters "
            "only: nnx.Optimizer(model, tx, wrt=nnx.Param)."
        )

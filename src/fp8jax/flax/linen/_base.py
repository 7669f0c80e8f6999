"""Linen plumbing shared by the modules: logically partitioned params, FP8 state."""

from __future__ import annotations

import flax.linen as nn

from fp8jax.flax._common import is_delayed
from fp8jax.flax.train import FP8_COLLECTION, watch_state
from fp8jax.recipes import Recipe, resolve_recipe
from fp8jax.scaling import DotScaleState, init_state


def param(module: nn.Module, name: str, init, shape, dtype, axes):
    """``module.param`` whose value carries logical axis names for sharding rules."""
    return module.param(name, nn.with_logical_partitioning(init, axes), tuple(shape), dtype)


def scale_state(
    module: nn.Module, recipe: Recipe | None, param, group: type = DotScaleState
):  # fmt: skip
    """The module's delayed-scaling state, created at init; None under CurrentScaling.

    It lives in the ``"fp8_state"`` collection, read-only during ``apply``:
    the op returns the next state as this variable's gradient. A gradient
    that takes ``param`` (the kernel) but not the state warns
    (:func:`fp8jax.flax.train.watch_state`): the scales would never change.
    """
    if not is_delayed(recipe):
        return None
    state = module.variable(FP8_COLLECTION, "scales", init_state, resolve_recipe(recipe), group)
    return watch_state(state.value, param, type(module).__name__)

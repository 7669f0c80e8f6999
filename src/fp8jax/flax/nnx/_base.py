"""NNX plumbing shared by the modules: the Fp8State variable, sharded params."""

from __future__ import annotations

import jax
from flax import nnx
from flax.core import meta

from fp8jax.flax._common import is_delayed
from fp8jax.flax.train import watch_state
from fp8jax.recipes import Recipe, resolve_recipe
from fp8jax.scaling import DotScaleState, init_state


class Fp8State(nnx.Variable):
    """Delayed-scaling state of one op (a ``DotScaleState`` or ``MlpScaleState``).

    Its own Variable type, so that ``nnx.Optimizer(model, tx, wrt=nnx.Param)``
    never touches it and the train step can select it with a filter.
    """


def param(init, rngs: nnx.Rngs, shape, dtype, axes, *, enabled: bool = True) -> nnx.Param | None:
    """An ``nnx.Param`` whose ``out_sharding`` metadata holds logical axis names.

    None when not ``enabled`` (NNX wants an attribute assigned once, as data or not).
    """
    if not enabled:
        return None
    value = init(rngs.params(), tuple(shape), dtype)
    # Flax shards a variable eagerly when asked, which needs a mesh; without one
    # the names are kept as metadata for nnx.get_partition_spec and rules later.
    eager = None if meta.global_mesh_defined() else False
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=eager)


def scale_state(recipe: Recipe | None, group: type = DotScaleState) -> Fp8State | None:
    """The op's delayed-scaling state; None under CurrentScaling."""
    if not is_delayed(recipe):
        return None
    return Fp8State(init_state(resolve_recipe(recipe), group))


def state_value(variable: Fp8State | None, param: jax.Array, owner: str):
    """What the op takes as ``state``; warns if a gradient takes ``param`` but not the state.

    See :func:`fp8jax.flax.train.watch_state`: a hand-written NNX step that
    differentiates only ``nnx.Param`` would leave the scales at 1.0.
    """
    return None if variable is None else watch_state(variable.get_value(), param, owner)


def value_of(variable: nnx.Variable | None):
    """An optional parameter's array, or None."""
    return None if variable is None else variable[...]

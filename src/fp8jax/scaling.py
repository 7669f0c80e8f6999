"""Per-tensor FP8 scale state and its pure update rules.

Delayed scaling keeps, for every tensor role of an op (input, kernel,
gradient), a :class:`ScaleState`: a rolling amax history and the scale to use
next. An op's states travel together in a small NamedTuple such as
:class:`DotScaleState`. Nothing here is global: states are created by
:func:`init_state`, passed to ops, and replaced by the train step.

The ops return updated state through the *cotangent* of their ``state``
argument ("meta as gradient"): ``jax.grad`` with respect to the state gives
the new state. :func:`take_new_state` swaps it in, and :func:`combine_states`
merges the states of several micro-batches by max.

Every rule here treats leading axes as independent tensors: a state stacked
by ``nn.scan``/``jax.lax.scan`` over layers (history ``(layers, L)``, scale
``(layers,)``) is updated, swapped and merged layer by layer.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.recipes import CurrentScaling, DelayedScaling, resolve_recipe


class ScaleState(NamedTuple):
    """Delayed-scaling state of one tensor.

    Attributes:
      amax_history: f32[..., amax_history_len]; slot 0 holds the newest amax.
      scale: f32[...]; quantization computes ``x * scale``. Leading axes,
        if any, stack independent tensors (scanned layers).
    """

    amax_history: jax.Array
    scale: jax.Array


class DotScaleState(NamedTuple):
    """Scale states of one FP8 dot_general: its input, kernel and gradient."""

    x: ScaleState
    kernel: ScaleState
    grad: ScaleState


class MlpScaleState(NamedTuple):
    """Scale states of ``layernorm_mlp``: one :class:`DotScaleState` per GEMM."""

    fc1: DotScaleState
    fc2: DotScaleState


# Which half of recipe.formats each role of a state group is quantized to.
# (NamedTuple turns annotated class attributes into fields, so these are set here.)
DotScaleState.ROLE_FORMATS = {"x": "forward", "kernel": "forward", "grad": "backward"}
MlpScaleState.SUBGROUPS = (DotScaleState, DotScaleState)


def init_scale_state(recipe: DelayedScaling) -> ScaleState:
    """Fresh state for one tensor: empty history, scale 1."""
    return ScaleState(
        amax_history=jnp.zeros((recipe.amax_history_len,), jnp.float32),
        scale=jnp.ones((), jnp.float32),
    )


def init_state(recipe, group=DotScaleState):
    """Creates the scale state an op needs under ``recipe``.

    Args:
      recipe: a :class:`DelayedScaling` or :class:`CurrentScaling` (or None,
        meaning CurrentScaling).
      group: the op's state NamedTuple: :class:`DotScaleState` for
        ``dot_general``, ``dense``, ``einsum`` and ``layernorm_dense``;
        :class:`MlpScaleState` for ``layernorm_mlp``.

    Returns:
      A ``group`` of fresh :class:`ScaleState` for DelayedScaling, or None for
      CurrentScaling, which keeps no state.

    Example:
      >>> import fp8jax
      >>> state = fp8jax.init_state(fp8jax.DelayedScaling(amax_history_len=4))
      >>> state.kernel.amax_history.shape
      (4,)
      >>> fp8jax.init_state(fp8jax.CurrentScaling()) is None
      True
    """
    recipe = resolve_recipe(recipe)
    if isinstance(recipe, CurrentScaling):
        return None
    if hasattr(group, "SUBGROUPS"):
        return group(*(init_state(recipe, sub) for sub in group.SUBGROUPS))
    if not hasattr(group, "ROLE_FORMATS"):
        raise TypeError(
            f"group must be a state NamedTuple such as fp8jax.DotScaleState, got {group!r}."
        )
    return group(*(init_scale_state(recipe) for _ in group._fields))


def scale_from_amax(amax: jax.Array, fp8_max: float, margin: float, fallback) -> jax.Array:
    """``fp8_max / amax / 2**margin``, or ``fallback`` when amax is 0 or not finite."""
    amax = amax.astype(jnp.float32)
    scale = (jnp.float32(fp8_max) / amax) / jnp.float32(2.0**margin)
    # A denormal amax can overflow the division; treat it like no information.
    usable = (amax > 0) & jnp.isfinite(amax) & jnp.isfinite(scale)
    safe = jnp.where(usable, scale, jnp.asarray(fallback, jnp.float32))
    return safe


def _amax_of_history(history: jax.Array, recipe: DelayedScaling) -> jax.Array:
    if recipe.amax_compute_algo == "max":
        return jnp.max(history, axis=-1)
    return history[..., 0]


def update_scale_state(
    state: ScaleState, amax: jax.Array, fp8_max: float, recipe: DelayedScaling
) -> ScaleState:
    """One delayed-scaling step: record ``amax`` and compute the next scale.

    Args:
      state: the state the step quantized with.
      amax: the tensor's amax observed this step (f32 scalar).
      fp8_max: largest finite value of the tensor's FP8 format.
      recipe: supplies margin and amax_compute_algo.

    Returns:
      The next state: history rolled one slot with ``amax`` in slot 0, and the
      scale computed from it, or the previous scale if that amax is 0.

    Example:
      >>> import jax.numpy as jnp, fp8jax
      >>> from fp8jax.scaling import init_scale_state, update_scale_state
      >>> r = fp8jax.DelayedScaling(amax_history_len=3)
      >>> s = update_scale_state(init_scale_state(r), jnp.float32(2.0), 448.0, r)
      >>> s.amax_history.tolist(), float(s.scale)
      ([2.0, 0.0, 0.0], 224.0)
    """
    amax = amax.astype(jnp.float32)
    # A NaN/Inf amax carries no usable range information; storing it would make
    # max(history) non-finite for amax_history_len steps.
    amax = jnp.where(jnp.isfinite(amax), amax, jnp.float32(0))
    history = _shift_in(state.amax_history, amax)
    scale = scale_from_amax(_amax_of_history(history, recipe), fp8_max, recipe.margin, state.scale)
    return ScaleState(history, scale)


def _shift_in(history: jax.Array, amax: jax.Array) -> jax.Array:
    """``history`` moved one slot along its last axis, the oldest entry dropped, ``amax`` in slot 0.

    Written as a pad and a select rather than ``jnp.roll(...).at[0].set(...)``:
    XLA makes a roll a concatenate, which no fusion shares, and the set a
    dynamic-update-slice; four kernels a tensor in all. A pad is elementwise,
    so the new history and its maximum come out of one reduction kernel, and
    the scale from one scalar kernel after it (deviceless H100 compile).
    """
    older = lax.pad(
        history[..., :-1], jnp.float32(0), [(0, 0, 0)] * (history.ndim - 1) + [(1, 0, 0)]
    )
    slot = lax.broadcasted_iota(jnp.int32, history.shape, history.ndim - 1)
    return jnp.where(slot == 0, amax[..., None], older)


def _is_group(node) -> bool:
    return hasattr(type(node), "ROLE_FORMATS") and isinstance(node, tuple)


def _combine_group(a, b, recipe: DelayedScaling):
    merged = []
    for role, sa, sb in zip(a._fields, a, b, strict=True):
        fmt = getattr(recipe.formats, type(a).ROLE_FORMATS[role])
        history = jnp.maximum(sa.amax_history, sb.amax_history)
        # Both inputs kept the same old scale wherever no amax was usable.
        fallback = jnp.minimum(sa.scale, sb.scale)
        scale = scale_from_amax(_amax_of_history(history, recipe), fmt.max, recipe.margin, fallback)
        merged.append(ScaleState(history, scale))
    return type(a)(*merged)


def combine_states(a, b, *, recipe: DelayedScaling):
    """Merges two new states computed from the same old state (micro-batches).

    Under gradient accumulation every micro-batch starts from the same state
    and observes its own amaxes. The right combined state is the one a single
    big batch would give: histories merged by elementwise max, then the scale
    recomputed. Summing, as a gradient would be, is wrong.

    Args:
      a: a pytree holding state groups such as :class:`DotScaleState`.
      b: a pytree of the same structure.
      recipe: the DelayedScaling the states were made with.

    Returns:
      The merged pytree.

    Example:
      >>> import jax.numpy as jnp, fp8jax
      >>> r = fp8jax.DelayedScaling(amax_history_len=2)
      >>> s = fp8jax.init_state(r)
      >>> a = s._replace(x=s.x._replace(amax_history=jnp.array([4.0, 0.0])))
      >>> b = s._replace(x=s.x._replace(amax_history=jnp.array([8.0, 0.0])))
      >>> float(fp8jax.combine_states(a, b, recipe=r).x.scale)
      56.0
    """
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(
            f"combine_states needs the DelayedScaling recipe of the states, got {recipe!r}."
        )
    return jax.tree.map(lambda x, y: _combine_group(x, y, recipe), a, b, is_leaf=_is_group)


def take_new_state(old_state, state_grads):
    """Swaps in the updated state that ops returned as the state's gradient.

    Use it with ``jax.grad`` taken with respect to the state. A state that no
    op consumed in the step gets a zero cotangent; since a real scale is never
    0, such states keep their old value rather than being zeroed.

    Args:
      old_state: the state pytree passed into the step.
      state_grads: its gradient from ``jax.grad``.

    Returns:
      The state for the next step.

    Example:
      >>> import jax, jax.numpy as jnp, fp8jax
      >>> state = fp8jax.init_state(fp8jax.DelayedScaling(amax_history_len=4))
      >>> x, w = jnp.ones((8, 16)), jnp.ones((16, 4))
      >>> def loss(w, state):
      ...     y = fp8jax.dense(x, w, recipe=fp8jax.DelayedScaling(amax_history_len=4), state=state)
      ...     return y.sum()
      >>> w_grad, state_grad = jax.grad(loss, argnums=(0, 1))(w, state)
      >>> new_state = fp8jax.take_new_state(state, state_grad)
      >>> new_state.x.amax_history.tolist()
      [1.0, 0.0, 0.0, 0.0]
    """

    def pick(old: ScaleState, new: ScaleState) -> ScaleState:
        consumed = new.scale > 0
        return ScaleState(
            jnp.where(consumed[..., None], new.amax_history, old.amax_history),
            jnp.where(consumed, new.scale, old.scale),
        )

    return jax.tree.map(pick, old_state, state_grads, is_leaf=lambda n: isinstance(n, ScaleState))

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

from types import MappingProxyType
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.recipes import DelayedScaling, Recipe, resolve_recipe


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
    # Which half of recipe.formats each role is quantized to. Unannotated, so
    # NamedTuple keeps it a class attribute, not a field.
    ROLE_FORMATS = MappingProxyType({"x": "forward", "kernel": "forward", "grad": "backward"})


class MlpScaleState(NamedTuple):
    """Scale states of ``layernorm_mlp``: one :class:`DotScaleState` per GEMM."""

    fc1: DotScaleState
    fc2: DotScaleState
    SUBGROUPS = (DotScaleState, DotScaleState)  # each field's group (a class attribute)


def init_scale_state(recipe: DelayedScaling) -> ScaleState:
    """Fresh state for one tensor: empty history, scale 1."""
    return ScaleState(
        amax_history=jnp.zeros((recipe.amax_history_len,), jnp.float32),
        scale=jnp.ones((), jnp.float32),
    )


def init_state(recipe: Recipe | None, group: type = DotScaleState):
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
    if not isinstance(recipe, DelayedScaling):  # current and fine-grained scaling: no state
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


def group_scales(group_amax: jax.Array, fp8_max: float, margin: float,
                 power_of_two: bool) -> jax.Array:  # fmt: skip
    """Each group's scale from its amax (:func:`scale_from_amax`, fallback 1).

    ``power_of_two``: rounded down to a power of two, so that the group's
    amax still maps within ``fp8_max``: the f32's mantissa bits cleared. The
    scale is positive, finite and normal (``fp8_max / amax`` with amax below
    f32's maximum), so that is exact. ``exp2(floor(log2(scale)))`` is not on
    the GPU: XLA's exp2 there gave 8.000001 for 8 (an H200, jax 0.11.2).
    """
    scale = scale_from_amax(group_amax, fp8_max, margin, fallback=1.0)
    if power_of_two:
        bits = lax.bitcast_convert_type(scale, jnp.uint32) & jnp.uint32(0xFF800000)
        scale = lax.bitcast_convert_type(bits, jnp.float32)
    return scale


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


def update_group(group, amaxes, recipe: DelayedScaling):
    """:func:`update_scale_state` for every tensor of a state group, in one update.

    The group's histories are stacked and updated as one array. For an op's
    group (unstacked tensors), each amax may come as an array of maxima
    whose maximum is the amax, such as the per-tile maxima of the cast
    kernels; they are reduced in the same kernel that takes the histories'
    maxima. XLA then gives an op's tensors (three, or ``layernorm_mlp``'s
    six) one reduction kernel, one for the scales and one for the histories,
    where tensor by tensor it took two each, and a kernel or two more to
    reduce each tensor's maxima (deviceless H100 compile). Each kernel costs
    a synchronized train step a few microseconds of launch
    (docs/design.md#the-delayed-scaling-state-as-a-cotangent). The values are those
    :func:`update_scale_state` gives tensor by tensor.

    Under ``jax.vmap`` with the state shared by every mapped element (not
    mapped itself), the elements' amaxes are max-reduced over the mapped
    axis first, so the new state is the one a single op over the whole batch
    gives, as :func:`combine_states` merges micro-batches. Without that, the
    backward of the vmap would *sum* the per-element new states (the
    transpose of an unmapped input), and the next forward would quantize
    with a scale many times too large. A mapped state (one per element: an
    ensemble) is updated element by element.

    Args:
      group: a state group such as :class:`DotScaleState` or :class:`MlpScaleState`.
      amaxes: the amaxes observed this step, nested like ``group``'s roles:
        ``(x, kernel, grad)`` for a DotScaleState, a pair of those for an
        MlpScaleState. Each is an f32 array whose maximum is the amax; for
        states stacked over layers (history ``(layers, L)``), an array of
        the states' leading shape, one amax per layer.
      recipe: the DelayedScaling the group was made with.

    Returns:
      The group's next state.

    Example:
      >>> import jax.numpy as jnp, fp8jax
      >>> from fp8jax.scaling import update_group
      >>> r = fp8jax.DelayedScaling(amax_history_len=2)
      >>> s = update_group(fp8jax.init_state(r), (2.0, jnp.array([1.0, 4.0]), 8.0), r)
      >>> [float(t.scale) for t in s]
      [224.0, 112.0, 7168.0]
    """
    states, _ = _roles(group, recipe)
    amaxes = [jnp.asarray(a, jnp.float32) for a in jax.tree.leaves(amaxes)]
    if len(amaxes) != len(states):
        raise ValueError(
            f"amaxes must hold one amax per tensor of the {type(group).__name__} "
            f"({len(states)}), got {len(amaxes)}."
        )
    return _mapped_update(recipe)(group, amaxes)


def _mapped_update(recipe: DelayedScaling):
    """:func:`_update_group` with the vmap rule :func:`update_group` documents."""

    @jax.custom_batching.custom_vmap
    def update(group, amaxes):
        return _update_group(group, amaxes, recipe)

    @update.def_vmap
    def rule(axis_size, in_batched, group, amaxes):
        group_batched, amaxes_batched = in_batched
        if any(jax.tree.leaves(group_batched)):
            # One state per mapped element: the mapped axis becomes a leading
            # axis of stacked states (as nn.scan's layers), each with its own
            # amax. Not jax.vmap: under this level it would call this rule again.
            group = _broadcast_unmapped(group, group_batched, axis_size)
            tensor_shape = jax.tree.leaves(group)[1].shape  # a scale: (axis_size, *layers)
            amaxes = [
                _per_element_amax(a, tensor_shape) if mapped
                else jnp.broadcast_to(_per_element_amax(a, tensor_shape[1:]), tensor_shape)
                for a, mapped in zip(amaxes, amaxes_batched, strict=True)
            ]  # fmt: skip
            new = update(group, amaxes)
            return new, jax.tree.map(lambda _: True, new)
        # One state for all elements: it observed them all, so its amax is
        # their maximum (the mapped axis is axis 0 in a custom_vmap rule).
        amaxes = [
            jnp.max(a, axis=0) if mapped else a
            for a, mapped in zip(amaxes, amaxes_batched, strict=True)
        ]
        new = update(group, amaxes)
        return new, jax.tree.map(lambda _: False, new)

    return update


def _per_element_amax(a: jax.Array, tensor_shape: tuple[int, ...]) -> jax.Array:
    """An amax (state axes, then maxima) reduced to one per state of ``tensor_shape``."""
    return jnp.max(a.reshape(*tensor_shape, -1), axis=-1)


def _broadcast_unmapped(tree, mapped, axis_size: int):
    return jax.tree.map(
        lambda a, m: a if m else jnp.broadcast_to(a, (axis_size, *jnp.shape(a))), tree, mapped
    )


def _update_group(group, amaxes: list[jax.Array], recipe: DelayedScaling):
    """:func:`update_group` on checked f32 amaxes, one per tensor."""
    states, fp8_maxes = _roles(group, recipe)
    tensor_shape = states[0].scale.shape
    if tensor_shape:
        wrong = [a.shape for a in amaxes if a.shape != tensor_shape]
        if wrong:
            raise ValueError(
                f"amaxes of states stacked as {tensor_shape} must have that shape, one amax "
                f"per layer; got shapes {wrong}."
            )
    if len({s.amax_history.shape for s in states}) != 1:
        # Stacking needs one shape; states of unequal history lengths (hand-made)
        # are updated one by one, with the same values.
        amaxes = amaxes if tensor_shape else [jnp.max(a) for a in amaxes]
        new = [
            update_scale_state(s, a, m, recipe)
            for s, a, m in zip(states, amaxes, fp8_maxes, strict=True)
        ]
    elif tensor_shape:
        stacked = ScaleState(jnp.stack([s.amax_history for s in states]),
                             jnp.stack([s.scale for s in states]))  # fmt: skip
        fp8_max = jnp.asarray(fp8_maxes, jnp.float32).reshape((-1,) + (1,) * len(tensor_shape))
        updated = update_scale_state(stacked, jnp.stack(amaxes), fp8_max, recipe)
        new = [ScaleState(updated.amax_history[i], updated.scale[i]) for i in range(len(states))]
    else:
        new = _update_from_maxima(states, amaxes, fp8_maxes, recipe)
    return _rebuild(group, iter(new))


# Maxima beyond this many a tensor are first reduced on their own, so that a
# row of the update's reduction (maxima and history) stays one kernel: XLA
# splits row reductions longer than 16384 into two (deviceless H100 compile).
_MAXIMA_IN_UPDATE = 8192


def _update_from_maxima(states, maxima, fp8_maxes, recipe: DelayedScaling) -> list[ScaleState]:
    """:func:`update_group` for unstacked tensors, each amax the maximum of an array of maxima.

    Each tensor's amax is the maximum of its maxima, and the maximum of its
    shifted history that of the amax and the history but its oldest entry;
    one reduction kernel takes both for every tensor.
    """
    flat = [_at_most(m.reshape(-1), _MAXIMA_IN_UPDATE) for m in maxima]
    width = max(f.shape[0] for f in flat)
    tiles = jnp.stack([jnp.pad(f, (0, width - f.shape[0])) for f in flat])  # maxima are >= 0
    history = jnp.stack([s.amax_history for s in states])
    # Maxima and older history side by side in rows of one width, each
    # padded with zeros where the other lies, so that one variadic reduce
    # gives both maxima: as two reduces of one concatenate, XLA wrote the
    # concatenate out and reduced it twice (deviceless H100 compile).
    older = history[:, :-1]
    tiles = jnp.pad(tiles, ((0, 0), (0, older.shape[1])))
    older = jnp.pad(older, ((0, 0), (width, 0)))
    amax, older_max = lax.reduce(
        (tiles, older), (jnp.float32(0), jnp.float32(0)),
        lambda a, b: (jnp.maximum(a[0], b[0]), jnp.maximum(a[1], b[1])), (1,),
    )  # fmt: skip
    # As update_scale_state: a NaN/Inf amax is stored as 0.
    amax = jnp.where(jnp.isfinite(amax), amax, jnp.float32(0))
    window_amax = jnp.maximum(amax, older_max) if recipe.amax_compute_algo == "max" else amax
    fp8_max = jnp.asarray(fp8_maxes, jnp.float32)
    old_scales = jnp.stack([s.scale for s in states])
    scales = scale_from_amax(window_amax, fp8_max, recipe.margin, old_scales)
    histories = _shift_in(history, amax)
    return [ScaleState(histories[i], scales[i]) for i in range(len(states))]


def _at_most(values: jax.Array, count: int) -> jax.Array:
    """A 1-D ``values`` max-reduced in groups to at most ``count`` entries with the same maximum."""
    if values.shape[0] <= count:
        return values
    group = -(-values.shape[0] // count)
    padded = jnp.pad(values, (0, -values.shape[0] % group))
    return jnp.max(padded.reshape(-1, group), axis=1)


def _roles(group, recipe: DelayedScaling) -> tuple[list[ScaleState], list[float]]:
    """A group's ScaleStates in field order, nested groups flattened, and each one's FP8 max."""
    if hasattr(type(group), "SUBGROUPS"):
        states, maxes = [], []
        for sub in group:
            sub_states, sub_maxes = _roles(sub, recipe)
            states += sub_states
            maxes += sub_maxes
        return states, maxes
    formats = type(group).ROLE_FORMATS
    return list(group), [getattr(recipe.formats, formats[role]).max for role in group._fields]


def _rebuild(group, new_states):
    if hasattr(type(group), "SUBGROUPS"):
        return type(group)(*(_rebuild(sub, new_states) for sub in group))
    return type(group)(*(next(new_states) for _ in group._fields))


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

    Raises:
      TypeError: for a recipe other than DelayedScaling, or ``a`` and ``b``
        of different structures.
      ValueError: for states of different shapes (another amax_history_len), or
        states whose history length is not the recipe's.

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
    _check_like(
        "combine_states", ("a", a), ("b", b),
        "two new states from one old state, one per micro-batch", hint="",
    )  # fmt: skip
    n = recipe.amax_history_len
    is_state = lambda s: isinstance(s, ScaleState)  # noqa: E731
    for path, s in jax.tree_util.tree_leaves_with_path(a, is_leaf=is_state):
        if is_state(s) and jnp.shape(s.amax_history)[-1:] != (n,):
            # The merged scales would come from another recipe's margin and algorithm.
            raise ValueError(
                f"combine_states: a{jax.tree_util.keystr(path)}.amax_history has shape "
                f"{jnp.shape(s.amax_history)}, but the recipe's amax_history_len={n} needs a "
                "last axis of that length; pass the DelayedScaling the states were made with."
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
    _check_like(
        "take_new_state", ("old_state", old_state), ("state_grads", state_grads),
        "the gradient of the state from jax.grad",
        hint=" Pass the gradient taken with respect to the state, e.g. "
        "`_, (grads, state_grads) = jax.value_and_grad(loss, argnums=(0, 1))(params, state)`.",
    )  # fmt: skip

    def pick(old: ScaleState, new: ScaleState) -> ScaleState:
        consumed = new.scale > 0
        return ScaleState(
            jnp.where(consumed[..., None], new.amax_history, old.amax_history),
            jnp.where(consumed, new.scale, old.scale),
        )

    return jax.tree.map(pick, old_state, state_grads, is_leaf=lambda n: isinstance(n, ScaleState))


def _check_like(fn: str, want: tuple, got: tuple, what: str, hint: str) -> None:
    """Raises unless state pytree ``got`` has ``want``'s structure and state shapes.

    ``want``, ``got``: (argument name, pytree); ``what``: what ``got`` should
    be; ``hint``: appended to each message.
    """
    (want_name, want_tree), (got_name, got_tree) = want, got
    is_state = lambda n: isinstance(n, ScaleState)  # noqa: E731
    want_def = jax.tree.structure(want_tree, is_leaf=is_state)
    got_def = jax.tree.structure(got_tree, is_leaf=is_state)
    if want_def != got_def:
        raise TypeError(
            f"{fn}: {got_name} must have the structure of {want_name} ({what}); expected "
            f"{want_def}, got {got_def} ({type(got_tree).__name__}).{hint}"
        )
    got_leaves = jax.tree.leaves(got_tree, is_leaf=is_state)
    want_leaves = jax.tree_util.tree_leaves_with_path(want_tree, is_leaf=is_state)
    for (path, w), g in zip(want_leaves, got_leaves, strict=True):
        if not is_state(w):
            continue
        want_shapes = (jnp.shape(w.amax_history), jnp.shape(w.scale))
        got_shapes = (jnp.shape(g.amax_history), jnp.shape(g.scale))
        if want_shapes != got_shapes:
            raise ValueError(
                f"{fn}: {got_name}{jax.tree_util.keystr(path)} has (amax_history, scale) "
                f"shapes {got_shapes}, expected {want_name}'s {want_shapes}: the two states "
                f"come from different recipes (amax_history_len) or models.{hint}"
            )

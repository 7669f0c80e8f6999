"""What the FP8 ops need to know about sharding: Explicit mesh axes and shard_map.

Under ``jit`` with ``AxisType.Auto`` mesh axes the partitioner places every
collective and nothing here changes the program. Two cases need the ops' help:

* **Explicit axes** (``jax.make_mesh``'s default since JAX 0.9): shardings are
  part of the types, and ``lax.dot_general`` refuses products whose result
  sharding is ambiguous or illegal, such as the FSDP dgrad
  ``g[batch@fsdp] . w[embed@fsdp]``. Each GEMM therefore gets an
  ``out_sharding``:

  - a gradient is sharded like its primal (dgrad like ``x``, wgrad like the
    kernel);
  - a forward product keeps the activation's sharding. The mesh axes of the
    activation's leading (batch) axis are data-parallel: the kernel is
    gathered over them (FSDP; the gather moves the FP8 copy). The kernel
    keeps its other output-axis splits (tensor parallelism), and an
    activation axis split over the same mesh axis is gathered instead
    (Megatron's sequence parallelism).

  Parameter vectors that multiply or shift activations (norm scales and
  shifts, biases) are replicated first, and their gradients resharded like
  them: an FSDP-sharded norm scale cannot meet a batch sharded on the same
  axis.
* **shard_map**: JAX types each value by the manual axes it varies along. A
  custom_vjp must give each input a cotangent of the input's own type, so a
  weight replicated over ``dp`` gets its per-device wgrads summed over ``dp``
  (what JAX's own transpose of the implicit broadcast does), and amaxes are
  max-reduced over ``recipe.amax_reduction_axes`` so that every device picks
  the same scales.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from fp8jax.kernels.dispatch import varying_axes
from fp8jax.recipes import Recipe


class InputType(NamedTuple):
    """What an op input's cotangent must match besides shape and dtype."""

    varying: frozenset  # the shard_map axes it varies along
    sharding: NamedSharding | None  # its sharding over Explicit mesh axes, if any


def reduce_amax(amax: jax.Array, recipe: Recipe) -> jax.Array:
    """``amax`` max-reduced over the recipe's ``amax_reduction_axes`` (inside shard_map)."""
    axes = recipe.amax_reduction_axes
    if not axes:
        return amax
    try:
        return lax.pmax(amax, axes)
    except NameError as e:
        raise ValueError(
            f"recipe.amax_reduction_axes={axes} names a mesh axis that is not bound here "
            f"({e}). The field is for code inside shard_map over those axes; under jit the "
            "amax of a sharded array is already global, so leave it () there."
        ) from None


def _explicit_mesh(x):
    mesh = jax.typeof(x).sharding.mesh
    if mesh.empty or AxisType.Explicit not in tuple(mesh.axis_types):
        return None
    return mesh


def input_types(*inputs) -> tuple[InputType, ...]:
    """For each op input (an array, a state pytree or None): what its cotangent must match."""
    types = []
    for x in inputs:
        leaves = jax.tree.leaves(x)
        varying = frozenset().union(*(varying_axes(leaf) for leaf in leaves))
        sharding = None
        if hasattr(x, "shape") and _explicit_mesh(x) is not None:
            sharding = jax.typeof(x).sharding
        types.append(InputType(varying, sharding))
    return tuple(types)


def match_cotangents(cotangents: tuple, new_state, types: tuple[InputType, ...]) -> tuple:
    """An op's cotangents (arrays, then the new state) typed like its inputs.

    Array cotangents are summed over the extra axes they vary along and
    resharded like their inputs. The new state is never summed: scales do not
    add up. If its amaxes vary along an axis the state does not, the devices
    disagree on the next scale, which only ``amax_reduction_axes`` can fix.
    """
    arrays = tuple(_match(ct, t) for ct, t in zip(cotangents, types, strict=False))
    if new_state is None:
        return (*arrays, None)
    state_axes = types[len(cotangents)].varying
    extra = input_types(new_state)[0].varying - state_axes
    if extra:
        names = tuple(sorted(extra, key=str))
        raise ValueError(
            f"inside shard_map, the FP8 amaxes vary along mesh axes {names} but the "
            "DelayedScaling state does not, so the devices would disagree on the next scales. "
            f"Pass DelayedScaling(amax_reduction_axes={names}, ...) (or all of the shard_map's "
            "axes) so that every amax is max-reduced over them."
        )
    state_type = InputType(state_axes, None)
    return (*arrays, jax.tree.map(lambda leaf: _match(leaf, state_type), new_state))


def _match(cotangent, primal: InputType):
    if cotangent is None:
        return None
    axes = varying_axes(cotangent)
    extra = tuple(sorted(axes - primal.varying, key=str))
    if extra:
        cotangent = lax.psum(cotangent, extra)
    missing = tuple(sorted(primal.varying - axes, key=str))
    if missing:
        cotangent = lax.pcast(cotangent, missing, to="varying")
    if primal.sharding is not None and jax.typeof(cotangent).sharding != primal.sharding:
        cotangent = jax.sharding.reshard(cotangent, primal.sharding)
    return cotangent


def broadcastable(v: jax.Array, ndim: int) -> jax.Array:
    """A parameter ``v`` (norm scale, bias) shaped ``(1, ..., 1, *v.shape)`` to meet activations.

    Leading size-1 axes rather than ``broadcast_to``, so that the gradient is
    a sum over those axes where the activations' shards lie, not a gather of
    the activations' gradient to the parameter's (replicated) layout. Over
    Explicit mesh axes it is replicated first.
    """
    mesh = _explicit_mesh(v)
    if mesh is not None and any(entry is not None for entry in jax.typeof(v).sharding.spec):
        v = jax.sharding.reshard(v, NamedSharding(mesh, P()))
    return v.reshape((1,) * (ndim - v.ndim) + v.shape)


def _spec(x) -> list:
    aval = jax.typeof(x)
    spec = list(aval.sharding.spec)
    return spec + [None] * (len(aval.shape) - len(spec))


def _axes(entry) -> tuple:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _without(entry, removed):
    kept = tuple(a for a in _axes(entry) if a not in removed)
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else kept


def ragged_out_sharding(lhs, rhs):
    """The result sharding of a grouped GEMM ``lhs [m, k] . rhs [g, k, n]``; None unless Explicit.

    As :func:`dot_out_sharding`'s forward rule: the rows keep ``lhs``'s
    (data-parallel) axes, ``n`` keeps ``rhs``'s split unless a row axis is
    among it.
    """
    # The context's mesh too: rows created inside the program (a MoE block's
    # tokens) may carry no mesh in their type, and lax.ragged_dot still refuses.
    mesh = _explicit_mesh(lhs) or _explicit_mesh(rhs)
    if mesh is None:
        context = jax.sharding.get_abstract_mesh()
        if context.empty or AxisType.Explicit not in tuple(context.axis_types):
            return None
        mesh = context
    rows = _spec(lhs)[0]
    return NamedSharding(mesh, P(rows, _without(_spec(rhs)[2], set(_axes(rows)))))


def dot_out_sharding(lhs, rhs, dims, like=None, permutation=None):
    """The ``out_sharding`` for ``dot_general(lhs, rhs, dims)``; None unless axes are Explicit.

    ``like``: the primal whose sharding the (permuted) result must have, for
    dgrad and wgrad. Without it, the forward rule in this module's docstring.
    """
    mesh = _explicit_mesh(lhs)
    if mesh is None:
        return None
    if like is not None:
        target = _spec(like)
        if permutation is None:
            return NamedSharding(mesh, P(*target))
        # jnp.transpose(y, permutation) puts y's axis permutation[a] at a.
        spec = [None] * len(target)
        for axis, source in enumerate(permutation):
            spec[source] = target[axis]
        return NamedSharding(mesh, P(*spec))
    (lc, rc), (lb, rb) = dims
    lhs_spec, rhs_spec = _spec(lhs), _spec(rhs)
    lhs_free = [a for a in range(len(lhs_spec)) if a not in lc and a not in lb]
    rhs_free = [a for a in range(len(rhs_spec)) if a not in rc and a not in rb]
    data_parallel = set(_axes(lhs_spec[0])) if 0 not in lc else set()
    kernel = [_without(rhs_spec[a], data_parallel) for a in rhs_free]
    tensor_parallel = {axis for entry in kernel for axis in _axes(entry)}
    activation = [_without(lhs_spec[a], tensor_parallel) for a in (*lb, *lhs_free)]
    return NamedSharding(mesh, P(*activation, *kernel))

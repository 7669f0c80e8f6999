"""A call's arguments as flat, abstract, sharded leaves, for tracing on any mesh.

Both sides of a deviceless compile use this: the caller to export the call
over an ``AbstractMesh``, the compiling process to re-create the same
shardings on the target's devices.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec


def flatten_call(fn, args, in_shardings, axes):
    """``fn`` as a function of its array leaves, with the leaves and their specs.

    Non-array leaves are closed over, as if static. Each spec is the
    ``PartitionSpec`` to re-create on the target mesh (None without a mesh).
    """
    leaves, treedef = jax.tree.flatten(args)
    specs = _leaf_specs(args, in_shardings, len(leaves)) if axes else [None] * len(leaves)
    is_array = [hasattr(leaf, "shape") and hasattr(leaf, "dtype") for leaf in leaves]

    def flat_fn(*arrays):
        it = iter(arrays)
        full = [next(it) if array else leaf for leaf, array in zip(leaves, is_array, strict=True)]
        outputs, flat_fn.out_tree = jax.tree.flatten(fn(*jax.tree.unflatten(treedef, full)))
        return tuple(outputs)

    flat_fn.__name__ = flat_fn.__qualname__ = getattr(fn, "__name__", type(fn).__name__)
    arrays = [leaf for leaf, array in zip(leaves, is_array, strict=True) if array]
    return flat_fn, arrays, [s for s, array in zip(specs, is_array, strict=True) if array]


def donated_leaves(args, donate_argnums) -> tuple[int, ...]:
    """The indices, among ``flatten_call``'s array leaves, of the arguments ``donate_argnums``."""
    donated, index = [], 0
    for position, arg in enumerate(args):
        arrays = [x for x in jax.tree.leaves(arg) if hasattr(x, "shape") and hasattr(x, "dtype")]
        if position in donate_argnums:
            donated.extend(range(index, index + len(arrays)))
        index += len(arrays)
    return tuple(donated)


def _leaf_specs(args, in_shardings, n_leaves) -> list[PartitionSpec]:
    """One spec per leaf: from ``in_shardings`` (a prefix of args) or the leaf's own."""
    own = []
    for leaf in jax.tree.leaves(args):
        sharding = getattr(leaf, "sharding", None)
        own.append(sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec())
    if in_shardings is None:
        return own
    try:
        given = broadcast_prefix(in_shardings, args)
    except ValueError as e:
        raise ValueError(f"in_shardings must be a pytree prefix of args: {e}") from None
    assert len(given) == n_leaves
    return [
        _spec(g, "in_shardings") if g is not None else o for g, o in zip(given, own, strict=True)
    ]


def broadcast_prefix(prefix, tree) -> list[Any]:
    """Repeats each leaf of ``prefix`` over the leaves of the subtree it covers."""
    out: list[Any] = []
    jax.tree.map(
        lambda spec, sub: out.extend([spec] * len(jax.tree.leaves(sub))),
        prefix,
        tree,
        is_leaf=lambda x: x is None or isinstance(x, PartitionSpec | jax.sharding.Sharding),
    )
    return out


def _spec(value, name) -> PartitionSpec:
    if isinstance(value, NamedSharding):
        return value.spec
    if isinstance(value, PartitionSpec):
        return value
    raise TypeError(f"{name} leaves must be PartitionSpec or NamedSharding, got {value!r}.")


def out_specs(flat_fn, arrays, out_shardings) -> list[PartitionSpec | None] | None:
    """``out_shardings`` as one spec per output leaf of ``flatten_call``'s function."""
    if out_shardings is None:
        return None
    leaves = jax.eval_shape(flat_fn, *arrays)  # also records flat_fn.out_tree
    outputs = jax.tree.unflatten(flat_fn.out_tree, leaves)
    try:
        given = broadcast_prefix(out_shardings, outputs)
    except ValueError as e:
        raise ValueError(f"out_shardings must be a pytree prefix of the outputs: {e}") from None
    return [None if g is None else _spec(g, "out_shardings") for g in given]


def abstract_args(arrays, specs, sharding_for) -> list[jax.ShapeDtypeStruct]:
    """``ShapeDtypeStruct``s for the array leaves, each with ``sharding_for(spec)``."""
    return [
        jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=sharding_for(s), weak_type=getattr(a, "weak_type", False)
        )
        for a, s in zip(arrays, specs, strict=True)
    ]

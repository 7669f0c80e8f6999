"""Meshes without devices: read a mesh from any accepted form, re-create it on a target.

A deviceless compile cannot use the caller's devices, so a mesh travels as its
axis names, sizes and axis types, and is rebuilt over the target's GPUs (or as
an ``AbstractMesh`` for tracing). Shardings move between meshes by axis name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, NamedSharding


class MeshAxes(NamedTuple):
    """A mesh without devices: axis names, sizes and types (``"auto"``/``"explicit"``)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    types: tuple[str, ...]

    @property
    def size(self) -> int:
        return int(np.prod(self.sizes))

    def build(self, devices: Sequence[Any] | None = None):
        """An ``AbstractMesh``, or a ``Mesh`` over ``devices`` (first ``size`` of them)."""
        types = tuple(AxisType.Explicit if t == "explicit" else AxisType.Auto for t in self.types)
        if devices is None:
            return AbstractMesh(self.sizes, self.names, axis_types=types)
        grid = np.array(list(devices)[: self.size], dtype=object).reshape(self.sizes)
        return jax.sharding.Mesh(grid, self.names, axis_types=types)

    def __str__(self) -> str:
        return ",".join(f"{n}={s}" for n, s in zip(self.names, self.sizes, strict=True))


def resolve_mesh(mesh: Any, trees: Sequence[Any] = ()) -> MeshAxes | None:
    """Reads ``mesh`` in any accepted form, or else the mesh the ``trees`` are sharded on."""
    from_args = {_axes_of(s.mesh) for s in named_shardings(trees)}
    if mesh is None:
        if len(from_args) > 1:
            found = ", ".join(sorted(str(a) for a in from_args))
            raise ValueError(
                f"the arguments are sharded over different meshes ({found}); "
                "pass mesh= to choose one."
            )
        return from_args.pop() if from_args else None
    axes = _parse_mesh(mesh)
    for other in from_args:
        if (other.names, other.sizes) != (axes.names, axes.sizes):
            raise ValueError(
                f"mesh={axes} does not match the mesh the arguments are sharded over "
                f"({other}); shardings move between meshes by axis name and size."
            )
    return axes


def _parse_mesh(mesh: Any) -> MeshAxes:
    if isinstance(mesh, MeshAxes):
        return mesh
    if isinstance(mesh, jax.sharding.Mesh | AbstractMesh):
        return _axes_of(mesh)
    if isinstance(mesh, str):
        try:
            pairs = [(k.strip(), int(v)) for k, v in (p.split("=") for p in mesh.split(","))]
        except ValueError:
            raise ValueError(f"mesh string must look like 'dp=2,fsdp=4', got {mesh!r}.") from None
    elif isinstance(mesh, Mapping):
        pairs = list(mesh.items())
    elif isinstance(mesh, Sequence) and mesh and all(isinstance(p, tuple | list) for p in mesh):
        pairs = [tuple(p) for p in mesh]
    elif isinstance(mesh, Sequence) and len(mesh) % 2 == 0:
        pairs = list(zip(mesh[::2], mesh[1::2], strict=True))
    else:
        raise TypeError(
            "mesh must be a dict like {'fsdp': 8}, pairs, a flat ('dp', 2, 'fsdp', 4), "
            f"a 'dp=2,fsdp=4' string or a Mesh; got {mesh!r}."
        )
    for pair in pairs:
        if len(pair) != 2 or not isinstance(pair[0], str) or not _positive_int(pair[1]):
            raise ValueError(f"mesh axes must be (name, positive size) pairs; got {pair!r}.")
    names = tuple(name for name, _ in pairs)
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"mesh axis names must be unique and non-empty, got {names}.")
    return MeshAxes(names, tuple(int(size) for _, size in pairs), ("auto",) * len(names))


def _positive_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and value > 0


def _axes_of(mesh) -> MeshAxes:
    types = tuple("explicit" if t == AxisType.Explicit else "auto" for t in mesh.axis_types)
    return MeshAxes(tuple(mesh.axis_names), tuple(mesh.axis_sizes), types)


def named_shardings(trees) -> list[NamedSharding]:
    """The ``NamedSharding``s in ``trees``: leaves that are one, or that carry one."""
    leaves = jax.tree.leaves(trees, is_leaf=lambda x: isinstance(x, NamedSharding))
    found = []
    for leaf in leaves:
        sharding = leaf if isinstance(leaf, NamedSharding) else getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            found.append(sharding)
    return found

"""Sharding for FP8 training: mesh-axis roles, logical-axis rules, meshes and shardings.

The FP8 ops need no sharding code of their own under ``jit``: each quantizes
the shard it is given (an amax over a sharded array is global, XLA adds the
all-reduce), and the partitioner all-gathers the FP8 copy of an FSDP weight,
half the bytes of BF16. This module is the one place where parallelism is
described:

* :class:`ShardingConfig` names the mesh axis that plays each role: data
  parallel (``dp``), fully sharded data parallel (``fsdp``), tensor parallel
  (``tp``), sequence parallel (``sp``) and expert parallel (``ep``, off by
  default).
* :meth:`ShardingConfig.rules` maps the logical axis names of the
  :mod:`fp8jax.flax` modules (``embed``, ``mlp``, ``act``, ``heads``, ``qkv``,
  ``kv``, ``expert``, and ``batch``, ``length`` for activations) to those axes.
* :func:`make_mesh`, :func:`variable_shardings`, :func:`logical_spec` build
  the mesh and the ``NamedSharding``s; :func:`use_mesh` activates both for the
  modules' activation constraints (:func:`constrain`).
* :func:`use_mesh` also declares the config's batch axes to the kernel
  dispatcher (:func:`fp8jax.kernels.data_parallel`), and
  :func:`data_parallel_axes` says when the token rows alone are split, so
  that the ops can run their kernels per device.
* :func:`global_amax` is the amax of a tensor sharded inside ``shard_map``;
  the ops do the same when a recipe sets ``amax_reduction_axes``.

Example:
  >>> import jax, fp8jax.sharding as fs
  >>> mesh = fs.make_mesh(dp=2, fsdp=2, tp=2)
  >>> dict(mesh.shape)
  {'dp': 2, 'fsdp': 2, 'tp': 2}
  >>> fs.logical_spec(("embed", "mlp"))
  P('fsdp', 'tp')
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from fp8jax import kernels
from fp8jax.axes import ACT, BATCH, EMBED, EXPERT, HEADS, KV, LAYERS, LENGTH, MLP, QKV
from fp8jax.quantize import amax

ROLES = ("dp", "fsdp", "ep", "sp", "tp")  # mesh order: outermost (across nodes) to innermost


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingConfig:
    """Which mesh axis plays which parallelism role; None switches a role off.

    Attributes:
      dp: data parallel: the batch is split, parameters are replicated.
      fsdp: fully sharded data parallel: the batch is split and every
        parameter's model width (``embed``) too; the FP8 copy of a kernel is
        all-gathered before its GEMM.
      tp: tensor parallel: attention heads and the MLP width are split
        (column-parallel QKV and first MLP GEMM, row-parallel output and
        second MLP GEMM).
      sp: sequence parallel: the sequence axis of the residual stream (norms,
        MLP, residual adds) is split. ``sp=None`` (default) is off;
        ``sp="tp"`` is Megatron's sequence parallelism on the tensor-parallel
        axis (an all-gather before each column-parallel GEMM, a
        reduce-scatter after each row-parallel one); a separate axis name
        splits the sequence over its own mesh axis, and attention gathers
        keys and values.
      ep: expert parallel: the experts of an MoE block (``wi``, ``wo``) are
        split over this axis, and the batch too (the rest of the model sees
        it as one more data-parallel axis); each device sends its tokens'
        rows to the experts' devices and back
        (:mod:`fp8jax.flax._expert_parallel`). ``ep=None`` (default) is off;
        ``ep="dp"`` (or ``"fsdp"``) splits the experts over that batch axis
        instead of an axis of its own.

    Example:
      >>> import fp8jax.sharding as fs
      >>> fs.ShardingConfig(sp="tp").logical_rules()[:2]
      (('heads', 'tp'), ('mlp', 'tp'))
    """

    dp: str | None = "dp"
    fsdp: str | None = "fsdp"
    tp: str | None = "tp"
    sp: str | None = None
    ep: str | None = None

    def __post_init__(self):
        for role in ROLES:
            value = getattr(self, role)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(
                    f"ShardingConfig.{role} must be a mesh axis name (a non-empty str) or None, "
                    f"got {value!r}."
                )
        named = [(role, getattr(self, role)) for role in ("dp", "fsdp", "tp")]
        names = [name for _, name in named if name is not None]
        if len(set(names)) != len(names):
            raise ValueError(
                f"ShardingConfig: dp, fsdp and tp must be different mesh axes, got {dict(named)}."
            )
        if self.sp is not None and self.sp in (self.dp, self.fsdp):
            raise ValueError(
                f"ShardingConfig.sp={self.sp!r} is also a batch axis (dp={self.dp!r}, "
                f"fsdp={self.fsdp!r}); use its own axis, or sp={self.tp!r} (the tp axis) for "
                "Megatron-style sequence parallelism."
            )
        if self.ep is not None and self.ep in (self.tp, self.sp):
            raise ValueError(
                f"ShardingConfig.ep={self.ep!r} is also the tp or sp axis (tp={self.tp!r}, "
                f"sp={self.sp!r}), which splits no tokens; use its own axis, or a batch axis "
                f"(dp={self.dp!r}, fsdp={self.fsdp!r})."
            )

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The distinct mesh axes that split the batch: ``dp``, ``fsdp``, ``ep``, in mesh order."""
        return tuple(dict.fromkeys(a for a in (self.dp, self.fsdp, self.ep) if a is not None))

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """The distinct mesh axis names, outermost first (in :data:`ROLES`' order)."""
        names = [getattr(self, role) for role in ROLES]
        return tuple(dict.fromkeys(n for n in names if n is not None))

    def logical_rules(self) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
        """``(logical name, mesh axes)`` pairs, highest precedence first.

        The format of ``flax.linen.logical_axis_rules``. Tensor-parallel names
        come first, so that under ``sp == tp`` a tensor with both ``heads`` and
        ``length`` axes (the queries) is split by heads.
        """
        return (
            (HEADS, self.tp),
            (MLP, self.tp),
            (EXPERT, self.ep),
            (BATCH, self.batch_axes or None),
            (LENGTH, self.sp),
            (EMBED, self.fsdp),
            (ACT, None),
            (QKV, None),
            (KV, None),
            (LAYERS, None),
        )


DEFAULT = ShardingConfig()


def make_mesh(
    *,
    dp: int = 1,
    fsdp: int = 1,
    tp: int = 1,
    sp: int = 1,
    ep: int = 1,
    config: ShardingConfig = DEFAULT,
    axis_types: AxisType = AxisType.Auto,
    devices: Sequence[jax.Device] | None = None,
) -> jax.sharding.Mesh:
    """A mesh with one axis per role of ``config``, sized as given, outermost ``dp``.

    Axes run ``dp``, ``fsdp``, ``ep``, ``sp``, ``tp`` from outermost to innermost, so
    ``tp`` spans neighbouring devices (one NVLink domain) and ``dp`` spans
    nodes. Roles of size 1 keep their axis, so one set of rules serves every
    mesh.

    Args:
      dp, fsdp, tp, sp, ep: the size of each role's axis. Their product is
        the number of devices used.
      config: the axis names; a role that is None must have size 1, and
        ``sp`` sharing the ``tp`` axis takes its size from ``tp`` (``ep``
        sharing a batch axis, from that axis).
      axis_types: ``AxisType.Auto`` (default: the partitioner places the
        collectives) or ``AxisType.Explicit`` (shardings in the types; the
        ops give every GEMM its output sharding).
      devices: the devices to use; default ``jax.devices()``.

    Returns:
      A ``jax.sharding.Mesh``.

    Raises:
      ValueError: for sizes that do not multiply to the device count or that
        name a role the config switches off.

    Example:
      >>> import fp8jax.sharding as fs
      >>> dict(fs.make_mesh(fsdp=4, tp=2, config=fs.ShardingConfig(sp="tp")).shape)
      {'dp': 1, 'fsdp': 4, 'tp': 2}
    """
    sizes = {"dp": dp, "fsdp": fsdp, "ep": ep, "sp": sp, "tp": tp}
    axes: dict[str, int] = {}
    for role in ROLES:
        size, name = sizes[role], getattr(config, role)
        if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
            raise ValueError(f"make_mesh: {role} must be an int >= 1, got {size!r}.")
        shared = (role == "sp" and name == config.tp) or (
            role == "ep" and name in (config.dp, config.fsdp)
        )
        if name is None or shared:
            if size != 1:
                why = "is None" if name is None else f"shares the {name!r} axis"
                raise ValueError(
                    f"make_mesh: {role}={size}, but config.{role} {why}, so it has no axis of "
                    f"its own; size that axis instead (config: {config})."
                )
            continue
        axes[name] = int(size)
    devices = list(jax.devices() if devices is None else devices)
    total = math.prod(axes.values())
    if total != len(devices):
        raise ValueError(
            f"make_mesh: the axis sizes {axes} use {total} devices, but {len(devices)} were "
            "given; make their product equal the device count."
        )
    types = (axis_types,) * len(axes)
    return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=types, devices=devices)


def _rules(config, rules):
    if rules is not None:
        return tuple(rules)
    return (config or DEFAULT).logical_rules()


def _check_names(owner: str, names, shape) -> None:
    """``names`` is a sequence of names, one per axis of ``shape`` (when given)."""
    # A str is a sequence: "embed" was read as five names, one per character.
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise TypeError(
            f"{owner}: names must be a sequence of logical names (or None), one per axis, "
            f"got {names!r}; for one axis write ({names!r},)."
        )
    if shape is not None and len(names) != len(shape):
        raise ValueError(
            f"{owner}: names gives {len(names)} logical names {tuple(names)!r} for an array of "
            f"shape {tuple(shape)} (rank {len(shape)}); give one per axis."
        )


def _as_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def logical_spec(
    names: Sequence[str | None],
    *,
    config: ShardingConfig | None = None,
    rules=None,
    mesh=None,
    shape: Sequence[int] | None = None,
) -> P:
    """The ``PartitionSpec`` of an array whose axes have logical ``names``.

    Rules are applied in order of precedence; a mesh axis already used by an
    earlier axis of the array is not used again. Axes the mesh lacks are
    dropped, and with ``shape`` so are those that do not divide their
    dimension (a batch of 1 at inference stays unsplit).

    Args:
      names: one logical name (or None) per array axis.
      config: the roles; default :data:`DEFAULT`.
      rules: explicit ``(name, mesh axes)`` pairs instead of ``config``'s.
      mesh: a ``Mesh`` or ``AbstractMesh``; restricts to its axes.
      shape: the array's shape, to drop axes that do not divide it.

    Returns:
      A ``PartitionSpec`` with one entry per axis.

    Example:
      >>> import fp8jax.sharding as fs
      >>> fs.logical_spec(("batch", "length", None))
      P(('dp', 'fsdp'), None, None)
    """
    _check_names("logical_spec", names, shape)
    available = None if mesh is None else dict(mesh.shape)
    result: list[tuple[str, ...]] = [() for _ in names]
    used: set[str] = set()
    for logical, target in _rules(config, rules):
        for pos, name in enumerate(names):
            if name != logical or result[pos]:
                continue
            axes = tuple(
                a
                for a in _as_axes(target)
                if a not in used and (available is None or a in available)
            )
            if shape is not None and available is not None:
                while axes and shape[pos] % math.prod(available[a] for a in axes):
                    axes = axes[:-1]
            result[pos] = axes
            used.update(axes)
    return P(*(None if not a else a[0] if len(a) == 1 else a for a in result))


def named_sharding(
    mesh, names: Sequence[str | None], config: ShardingConfig | None = None, shape=None
) -> NamedSharding:
    """``NamedSharding(mesh, logical_spec(names, ...))``: e.g. for a batch.

    Example:
      >>> import fp8jax.sharding as fs
      >>> mesh = fs.make_mesh(dp=2, fsdp=4)
      >>> fs.named_sharding(mesh, ("batch", "length", None)).spec
      P(('dp', 'fsdp'), None, None)
    """
    return NamedSharding(mesh, logical_spec(names, config=config, mesh=mesh, shape=shape))


def _logical_names(leaf):
    """The logical axis names a Flax variable carries, or None."""
    names = getattr(leaf, "names", None)  # Linen's nn.LogicallyPartitioned
    if names is None and hasattr(leaf, "get_metadata"):  # an nnx.Variable
        metadata = leaf.get_metadata()
        names = metadata.get("out_sharding", metadata.get("sharding_names"))
    return None if names is None else tuple(names)


def _is_box(leaf) -> bool:
    return _logical_names(leaf) is not None


def variable_shardings(tree, mesh, config: ShardingConfig | None = None):
    """``NamedSharding``s for Flax variables, from their logical axis names.

    Args:
      tree: Linen variables as ``model.init`` returns them (boxed by
        ``nn.with_logical_partitioning``; ``jax.eval_shape`` of the init is
        enough), a ``TrainState`` holding them, or an NNX state
        (``nnx.state(model)``). Leaves without names (FP8 scale state, step
        counters) are replicated.
      mesh: the mesh.
      config: the roles; default :data:`DEFAULT`.

    Returns:
      The tree with a ``NamedSharding`` in place of each variable: pass it as
      ``jax.jit(..., out_shardings=)`` for the init or to ``jax.device_put``.

    Raises:
      ValueError: if a dimension does not divide over the mesh axes its
        name maps to, naming the variable (e.g. 4 heads over ``tp=8``).

    Example:
      >>> import jax, fp8jax.sharding as fs
      >>> from fp8jax.flax import linen as fnn
      >>> model = fnn.LayerNormMLP(intermediate_dim=64)
      >>> abstract = jax.eval_shape(model.init, jax.random.key(0), jax.numpy.ones((8, 32)))
      >>> s = fs.variable_shardings(abstract, fs.make_mesh(fsdp=4, tp=2))
      >>> s["params"]["kernel_1"].spec
      P('fsdp', None, 'tp')
    """

    def sharding(path, leaf):
        names = _logical_names(leaf)
        if names is None:
            return NamedSharding(mesh, P())
        value = leaf.get_value() if hasattr(leaf, "get_value") else getattr(leaf, "value", leaf)
        shape = tuple(getattr(value, "shape", ()))
        spec = logical_spec(names, config=config, mesh=mesh)
        for dim, (size, entry) in enumerate(zip(shape, spec, strict=False)):
            split = math.prod(mesh.shape[a] for a in _as_axes(entry))
            if size % split:
                raise ValueError(
                    f"{jax.tree_util.keystr(path)} has size {size} on axis {dim} "
                    f"({names[dim]!r}), which does not split over mesh axes {entry} "
                    f"({split} devices); make that axis smaller or the dimension a multiple."
                )
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(sharding, tree, is_leaf=_is_box)


@contextlib.contextmanager
def use_mesh(mesh, config: ShardingConfig | None = None):
    """``jax.set_mesh(mesh)`` plus ``config``'s rules as Flax's logical axis rules.

    Inside it, the :mod:`fp8jax.flax` modules constrain their activations
    (:func:`constrain`) and Linen applies parameter constraints; outside it
    they do neither. It also declares ``config``'s batch axes (``dp``,
    ``fsdp``, ``ep``) to the kernel dispatcher (:func:`fp8jax.kernels.data_parallel`),
    so that the ops run their kernels on each device's token rows where only
    those axes split. Trace (``jax.jit``) and run the step inside it.

    Example:
      >>> import jax, jax.numpy as jnp, fp8jax.sharding as fs
      >>> with fs.use_mesh(fs.make_mesh(dp=8)):
      ...     y = jax.jit(lambda x: fs.constrain(x * 2, ("batch", None)))(jnp.ones((8, 4)))
      >>> y.sharding.spec[0]
      'dp'
    """
    from flax.core import spmd

    with (
        jax.set_mesh(mesh),
        spmd.logical_axis_rules(_rules(config, None)),
        kernels.data_parallel((config or DEFAULT).batch_axes),
    ):
        yield mesh


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrains an activation's sharding by logical names; a no-op without a mesh and rules.

    It applies when a mesh is set (``jax.set_mesh`` / :func:`use_mesh`) and
    Flax logical axis rules are active, and not inside ``shard_map``.
    ``with_sharding_constraint`` on ``AxisType.Auto`` axes, ``reshard`` on
    Explicit ones. Axes that do not divide their dimension are left unsplit.

    Args:
      x: the array.
      names: one logical name (or None, meaning unsplit) per axis.

    Returns:
      ``x``, constrained.
    """
    from flax.core import spmd

    # Checked with or without a mesh, so that a mismatch shows on one device too.
    _check_names("constrain", names, x.shape)
    rules = spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty or AxisType.Manual in tuple(mesh.axis_types):
        return x
    spec = logical_spec(names, rules=rules, mesh=mesh, shape=x.shape)
    explicit = {
        a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Explicit
    }
    if not explicit:
        return lax.with_sharding_constraint(x, spec)
    # Explicit axes live in the type: reshard changes it; Auto axes are left to the partitioner.
    spec = P(*(tuple(a for a in _as_axes(e) if a in explicit) or None for e in spec))
    return jax.sharding.reshard(x, spec)


def data_parallel_axes() -> tuple[str, ...] | None:
    """The mesh axes that split the batch, when the mesh in context splits nothing else.

    Under :func:`use_mesh` with only batch axes (``dp``, ``fsdp``) of size > 1,
    all ``Auto``, every activation and its gradient is split along its
    leading (token) axes over them and whole along the rest: the ops then run
    per-device kernels on the token rows (:mod:`fp8jax.kernels.dispatch`)
    without moving data. None without a mesh or declared batch axes
    (:func:`fp8jax.kernels.data_parallel`, which :func:`use_mesh` enters), or
    when another axis (``tp``, ``sp``) splits, or an axis is ``Explicit`` or
    manual.

    Example:
      >>> import fp8jax.sharding as fs
      >>> with fs.use_mesh(fs.make_mesh(dp=2, fsdp=4)):
      ...     fs.data_parallel_axes()
      ('dp', 'fsdp')
      >>> with fs.use_mesh(fs.make_mesh(fsdp=4, tp=2)):
      ...     fs.data_parallel_axes() is None
      True
    """
    return kernels.data_parallel_axes()


def global_amax(x: jax.Array, axis_names: str | Sequence[str] = ()) -> jax.Array:
    """The amax of the whole tensor ``x`` is a shard of, inside ``shard_map``.

    Under ``jit`` ``fp8jax.quantize``'s amax of a sharded array is already
    global; inside ``shard_map`` each device sees its shard, and the maxima
    must be reduced over the axes the tensor is split along. The ops do this
    themselves when the recipe sets ``amax_reduction_axes``.

    Args:
      x: a high-precision array (the local shard inside ``shard_map``).
      axis_names: the mesh axes ``x`` is split along.

    Returns:
      An f32 scalar, the same on every device.

    Example:
      >>> import jax, jax.numpy as jnp, fp8jax.sharding as fs
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = fs.make_mesh(dp=8)
      >>> x = jnp.arange(16.0).reshape(8, 2)
      >>> f = jax.shard_map(lambda s: fs.global_amax(s, "dp"), mesh=mesh, in_specs=P("dp"),
      ...                   out_specs=P())
      >>> float(jax.jit(f)(x))
      15.0
    """
    axes = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    local = amax(x)
    return lax.pmax(local, axes) if axes else local

"""The one place that decides whether a Pallas kernel runs, and where: each device's rows, or XLA.

fp8jax's kernels (:mod:`fp8jax.kernels.cast_transpose`,
:mod:`fp8jax.kernels.activation_cast`, :mod:`fp8jax.kernels.norm_forward`,
:mod:`fp8jax.kernels.norm_backward`) each have an XLA twin that computes
the same values. Which one a traced op gets depends on four things, all
decided here:

* **the switch**: :data:`PALLAS`, a JAX config option (``fp8jax_pallas``)
  in the ``jit`` cache key, default from the environment variable
  ``FP8JAX_PALLAS`` (1). Set it with ``with fp8jax.kernels.use_pallas(False):``
  or :func:`set_pallas`; a function traced before the change is traced
  again. A JAX without the Pallas Triton backend turns the kernels off, with
  a warning.
* **where arrays live** (:func:`is_local`): a ``pallas_call`` has no
  partitioning rule, so under a sharded ``jit`` XLA would gather its
  operands in high precision. It runs as is where every array is whole on
  each device (no mesh axis of size > 1 but manual ones, i.e. inside
  ``shard_map``), and on each device's rows (:func:`on_each_device`) where
  data parallelism alone splits token rows (:func:`data_parallel_axes`).
* **the shape**: each kernel's ``fits``, asked with the number of devices
  its rows are split over.
* **the platform**: :func:`on_each_device` stages both and lets
  ``lax.platform_dependent`` keep the kernel on CUDA only.

:func:`decide` weighs the first three and answers every caller with one
:class:`Placement`.

Every kernel calls :func:`pallas_call` rather than Pallas's own: inside a
user's ``shard_map`` (``check_vma=True``, JAX's default) a result must say
which manual axes it varies along, which ``pl.pallas_call`` does not infer.

Which mesh axes split the token rows is not in the values' types under
``AxisType.Auto`` axes (``jax.typeof(x).sharding`` names Explicit axes
only), so it is declared: :func:`data_parallel` (which
:func:`fp8jax.sharding.use_mesh` enters with its config's ``dp`` and
``fsdp`` axes), itself an option in the jit key. Nothing here reads Flax's
logical-axis rules.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import jax
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from fp8jax.kernels import _options

PALLAS = _options.bool_option(
    "fp8jax_pallas",
    "Whether fp8jax's Pallas kernels may run (on NVIDIA GPUs); XLA computes the same values "
    "otherwise. Default from the environment variable FP8JAX_PALLAS.",
    default=True,
)
_DATA_PARALLEL = _options.option(
    "fp8jax_data_parallel_axes",
    "The mesh axes that split token rows (data parallelism), or None: see "
    "fp8jax.kernels.data_parallel.",
    default=None,
)


def _check_flag(flag) -> bool:
    if not isinstance(flag, bool):
        raise TypeError(f"the Pallas switch must be a bool (True: kernels on), got {flag!r}.")
    return flag


def use_pallas(flag: bool):
    """A context manager: fp8jax's Pallas kernels on (True) or off (False) inside it.

    Example:
      >>> import jax, jax.numpy as jnp, fp8jax
      >>> with fp8jax.kernels.use_pallas(False):
      ...     fp8jax.kernels.enabled()
      False
    """
    return PALLAS(_check_flag(flag))


def set_pallas(flag: bool) -> None:
    """Turns fp8jax's Pallas kernels on or off for the process (``FP8JAX_PALLAS``'s role)."""
    _options.set_global(PALLAS, _check_flag(flag))


def enabled() -> bool:
    """Whether the kernels may run: the switch is on and this JAX has Pallas's Triton backend."""
    return bool(PALLAS.value) and _triton_backend_available()


@functools.cache
def _triton_backend_available() -> bool:
    try:
        from jax.experimental.pallas import triton  # noqa: F401
    except ImportError:
        warnings.warn(
            "fp8jax: this JAX has no Pallas Triton backend, so FP8 gradients are cast and "
            "transposed by XLA's slower kernels (fp8jax.kernels.dispatch).",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


@contextlib.contextmanager
def data_parallel(axes: Sequence[str] | None) -> Iterator[None]:
    """Declares the mesh axes that split token rows (batch and sequence of activations).

    Under a mesh whose axes of size > 1 are all ``Auto`` and all among
    ``axes``, the kernels then run on each device's rows. Traced inside it;
    part of the jit key. ``None`` declares nothing (the kernels stay off
    under such a mesh).

    Example:
      >>> import fp8jax.sharding as fs, fp8jax.kernels as fk, jax
      >>> with jax.set_mesh(fs.make_mesh(dp=8)), fk.data_parallel(("dp",)):
      ...     fk.data_parallel_axes()
      ('dp',)
    """
    if axes is not None:
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        if not all(isinstance(a, str) and a for a in axes):
            raise TypeError(
                "data_parallel: axes must be mesh axis names (non-empty str) or None, "
                f"got {axes!r}."
            )
    with _DATA_PARALLEL(axes):
        yield


def is_local() -> bool:
    """Whether arrays are whole on each device: every mesh axis manual or of size 1.

    Under a mesh with ``Auto`` or ``Explicit`` axes a ``pallas_call`` (which
    has no partitioning rule: XLA gathers its operands in high precision)
    runs only inside ``shard_map`` (:func:`on_each_device`), and a kernel's
    matrix view (:func:`fp8jax.ops.gemm.as_kernel_matrices`) costs
    collectives. Inside ``shard_map`` every array is local.

    With no mesh in context (``jax.set_mesh``, :func:`fp8jax.sharding.use_mesh`),
    a ``jit`` may still get sharded inputs, which tracing cannot see; then
    arrays count as whole only where the process has one GPU (or none: the
    deviceless compiles). Trace sharded programs under their mesh.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return jax.default_backend() == "cpu" or jax.device_count() == 1
    return all(
        kind == AxisType.Manual or size == 1
        for kind, size in zip(mesh.axis_types, mesh.axis_sizes, strict=True)
    )


def data_parallel_axes() -> tuple[str, ...] | None:
    """The mesh axes splitting token rows, when the mesh in context splits nothing else.

    Those of the declared axes (:func:`data_parallel`) that have size > 1,
    in the declared order, when every axis of size > 1 is declared and
    ``Auto``. None without a mesh or a declaration, or when another axis
    splits (tensor or sequence parallelism splits columns or what the
    activation kernels read whole), or an axis is ``Explicit`` or manual.
    """
    declared = _DATA_PARALLEL.value
    mesh = jax.sharding.get_abstract_mesh()
    if declared is None or mesh.empty:
        return None
    split = [
        (name, kind)
        for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types, strict=True)
        if size > 1
    ]  # fmt: skip
    if not split or any(kind != AxisType.Auto or name not in declared for name, kind in split):
        return None
    names = {name for name, _ in split}
    return tuple(a for a in declared if a in names)


def _row_axes(rows_are_tokens: bool) -> tuple[str, ...] | None:
    """() on whole arrays, the mesh axes splitting a kernel's rows, or None: XLA's path.

    None where the switch is off or arrays are sharded otherwise.
    ``rows_are_tokens``: the operand's rows are tokens (an activation or its
    gradient), which data parallelism splits; a weight's are not.
    """
    if not enabled():
        return None
    if is_local():
        return ()
    if not rows_are_tokens:
        return None
    return data_parallel_axes()


def devices_along(axes: Sequence[str]) -> int:
    """How many devices the mesh in context has along ``axes``."""
    return math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes)


class Placement(NamedTuple):
    """A decision: XLA's twin (``kernel`` False), or the kernel on ``row_axes``'s share of rows.

    ``row_axes`` () runs the kernel on whole arrays; ``interpret`` runs it in
    Pallas interpret mode, wherever it is (tests, on the CPU).
    """

    kernel: bool
    row_axes: tuple[str, ...] = ()
    interpret: bool = False


XLA = Placement(kernel=False)


def decide(fits: Callable[[int], bool], *, rows_are_tokens: bool = True) -> Placement:
    """Where a kernel runs here, taken before any work it would change.

    The kernel runs on whole arrays where arrays are whole on each device,
    on each device's rows where data parallelism alone splits them
    (``rows_are_tokens``: the operand's rows are tokens, which data
    parallelism splits; a weight's are not), and nowhere with the switch
    off; in each case only where its shape rule ``fits(row_shards)`` takes
    the rows of one device (``row_shards``: the devices they are split
    over, 1 for whole arrays). Elsewhere :data:`XLA`.
    """
    axes = _row_axes(rows_are_tokens)
    if axes is None or not fits(devices_along(axes)):
        return XLA
    return Placement(kernel=True, row_axes=axes)


def on_each_device(pallas_fn, xla_fn, operands, n_row_split: int, out_layouts, row_axes=()):
    """``pallas_fn(*operands)`` on NVIDIA GPUs, ``xla_fn`` elsewhere or with the kernels off.

    With ``row_axes`` the call runs on each device's rows inside
    ``shard_map`` over the mesh in context: the first ``n_row_split``
    operands (pytrees) split along their rows, the rest whole on every
    device. ``out_layouts`` says per output "rows" (split as the operands)
    or "columns" (a transposed copy, split along its columns). No data
    moves; per-tile partials the caller reduces become small all-reduces.
    """
    if not enabled():
        return xla_fn(*operands)

    def call(*ops):
        return lax.platform_dependent(*ops, cuda=pallas_fn, default=xla_fn)

    if not row_axes:
        return call(*operands)
    layouts = {"rows": P(row_axes, None), "columns": P(None, row_axes)}
    specs = [layouts["rows"]] * n_row_split + [P()] * (len(operands) - n_row_split)
    in_specs = tuple(
        jax.tree.map(lambda _, spec=spec: spec, operand)
        for operand, spec in zip(operands, specs, strict=True)
    )
    return jax.shard_map(
        call, in_specs=in_specs, out_specs=tuple(layouts[o] for o in out_layouts),
        # pallas_call does not type its outputs by the manual axes they vary along.
        check_vma=False,
    )(*operands)  # fmt: skip


def varying_axes(x) -> frozenset:
    """The shard_map axes ``x`` varies along (empty outside shard_map)."""
    aval = jax.typeof(x)
    # JAX <= 0.9 calls this ShapedArray.vma; 0.10 moved it to manual_axis_type.
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def _varying_struct(struct: jax.ShapeDtypeStruct, axes: frozenset) -> jax.ShapeDtypeStruct:
    if hasattr(jax.sharding, "ManualAxisType"):  # JAX >= 0.10
        typed = {"manual_axis_type": jax.sharding.ManualAxisType(varying=axes)}
    else:
        typed = {"vma": axes}
    return jax.ShapeDtypeStruct(struct.shape, struct.dtype, **typed)


def _operands_varying_axes(operands) -> frozenset | None:
    """The shard_map axes any operand varies along; None outside shard_map."""
    if AxisType.Manual not in tuple(jax.sharding.get_abstract_mesh().axis_types):
        return None
    return frozenset().union(*(varying_axes(x) for x in jax.tree.leaves(operands)))


def varying_like(out, operands):
    """``out`` typed to vary along every shard_map axis an operand varies along.

    For a kernel whose result type says nothing of them (a Mosaic GPU
    ``plgpu.kernel``), as :func:`pallas_call` types Pallas's; outside
    shard_map ``out`` as it is.
    """
    axes = _operands_varying_axes(operands)
    if axes is None:
        return out

    def cast(x):
        missing = tuple(sorted(axes - varying_axes(x)))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, out)


def pallas_call(kernel, *, out_shape, **kwargs):
    """``pl.pallas_call(kernel, out_shape=..., **kwargs)``, its results typed for shard_map.

    Each result varies along every shard_map axis an operand varies along
    (none for a replicated weight's cast); outside shard_map the call is
    Pallas's own. Without that type, tracing the call inside ``jax.shard_map`` (with JAX's default
    ``check_vma=True``) fails: a kernel's output, like any value there, must
    say whether devices hold different data.
    """
    from jax.experimental import pallas as pl

    def call(*operands):
        shapes = out_shape
        axes = _operands_varying_axes(operands)
        if axes is not None:
            shapes = jax.tree.map(lambda s: _varying_struct(s, axes), out_shape)
        return pl.pallas_call(kernel, out_shape=shapes, **kwargs)(*operands)

    return call

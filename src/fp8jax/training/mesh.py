"""``--mesh dp=2,fsdp=4``: a device mesh, and how the train state and batches lie on it.

The roles and rules are :mod:`fp8jax.sharding`'s, with tensor parallelism
off: the batch is split over every mesh axis, and each parameter (with its
AdamW moments) is split over ``fsdp`` along its logical ``embed`` axis, which
every GPT parameter has; an ``ep`` axis also splits the MoE layers' experts.
FP8 scale state and scalars are replicated.

The step must be traced inside :func:`sharding_context`, where the modules
constrain their activations to be split by batch. Without those constraints
XLA (Auto axes) was free to split the GEMMs along the hidden axis instead:
on two H200s the ``medium`` step then all-reduced BF16 activations, never
gathered a weight, and ran slower than one GPU (docs/design.md#fsdp-gathers-fp8). With them,
each FSDP kernel is quantized shard by shard and all-gathered in FP8.
"""

from __future__ import annotations

import contextlib
import math

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import fp8jax.sharding as fs
from fp8jax.flax._common import BATCH
from fp8jax.training.errors import ConfigError

AXES = ("dp", "fsdp", "ep")
SHARDING = fs.ShardingConfig(dp="dp", fsdp="fsdp", tp=None)
# With an ep axis the MoE blocks' experts are split over it and each device sends its
# tokens' rows to their experts' devices (fp8jax.flax._expert_parallel); without one
# they route locally. The rest of the model sees ep as one more batch axis.
EXPERT_PARALLEL = fs.ShardingConfig(dp="dp", fsdp="fsdp", tp=None, ep="ep")


def _config(mesh: Mesh) -> fs.ShardingConfig:
    return EXPERT_PARALLEL if "ep" in mesh.axis_names else SHARDING


def parse_mesh(text: str | None) -> dict[str, int]:
    """``"dp=2,fsdp=4"`` as ``{"dp": 2, "fsdp": 4}``; None or ``""`` is ``{}`` (one device).

    Raises:
      ConfigError: for a malformed string, an axis other than dp/fsdp/ep, or a size < 1.
    """
    if not text:
        return {}
    axes: dict[str, int] = {}
    for part in text.split(","):
        name, eq, size = part.strip().partition("=")
        # isdecimal, not isdigit: int() refuses digits such as '²', which isdigit accepts.
        if not eq or not size.strip().isdecimal():
            raise ConfigError(
                f"--mesh must look like 'fsdp=8', 'dp=2,fsdp=4' or 'ep=8', got {text!r}."
            )
        name = name.strip()
        if name not in AXES or name in axes:
            raise ConfigError(
                f"--mesh axes are {AXES}, each at most once; got {name!r} in {text!r}."
            )
        if int(size) < 1:
            raise ConfigError(f"--mesh axis {name} must have size >= 1, got {text!r}.")
        axes[name] = int(size)
    return axes


def build_mesh(
    axes: dict[str, int], *, batch_size: int, hidden: int, experts: int = 0
) -> Mesh | None:
    """A Mesh over the first ``prod(sizes)`` devices, or None for ``{}``.

    ``experts`` is the model's routed experts per MoE layer (0: a dense model),
    which an ``ep`` axis splits.

    Raises:
      ConfigError: if there are too few devices, the batch, the model width or
        the experts do not split evenly, or ``ep`` is given for a dense model.
    """
    if not axes:
        return None
    size = math.prod(axes.values())
    devices = jax.devices()
    spec = ",".join(f"{k}={v}" for k, v in axes.items())
    if size > len(devices):
        raise ConfigError(
            f"--mesh {spec} needs {size} devices, but JAX sees {len(devices)} "
            f"({devices[0].platform}); use a smaller mesh."
        )
    if batch_size % size:
        raise ConfigError(
            f"--batch-size {batch_size} must be divisible by the mesh size {size} ({spec}): "
            "every device gets an equal share of each batch."
        )
    fsdp = axes.get("fsdp", 1)
    if hidden % fsdp:
        raise ConfigError(
            f"fsdp={fsdp} must divide the model width {hidden}: parameters are split along it."
        )
    ep = axes.get("ep")
    if ep is not None and (not experts or experts % ep):
        what = "the model has no MoE layer" if not experts else f"the model has {experts}"
        raise ConfigError(
            f"--mesh ep={ep} splits each MoE layer's routed experts evenly over {ep} devices, "
            f"but {what}; use an ep that divides the experts, or dp/fsdp."
        )
    config = EXPERT_PARALLEL if ep is not None else SHARDING
    return fs.make_mesh(**axes, config=config, devices=devices[:size])


def param_shardings(boxed_params, mesh: Mesh):
    """NamedShardings of the params from their logical axis names (``embed`` -> ``fsdp``)."""
    return fs.variable_shardings(boxed_params, mesh, _config(mesh))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The batch axis split over every mesh axis."""
    return fs.named_sharding(mesh, (BATCH, None), _config(mesh))


def sharding_context(mesh: Mesh | None):
    """Where to trace and run the step: the mesh and its rules, or nothing for one device."""
    return contextlib.nullcontext() if mesh is None else fs.use_mesh(mesh, _config(mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def process_rows(sharding: NamedSharding, batch_size: int) -> slice:
    """The rows of a ``(batch_size, ...)`` batch that this process's devices hold.

    The mesh lists each process's devices together, so they hold one
    contiguous block of rows, which is all a process loads.
    """
    index = sharding.addressable_devices_indices_map((batch_size, 1))
    spans = sorted({s[0].indices(batch_size)[:2] for s in index.values()})
    start, stop = spans[0][0], spans[-1][1]
    covered = sum(b - a for a, b in spans)
    assert covered == stop - start, f"this process's batch rows are not contiguous: {spans}"
    return slice(start, stop)

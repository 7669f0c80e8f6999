"""``--mesh dp=2,fsdp=4``: a device mesh, and how the train state and batches lie on it.

Deliberately small: the batch is split over every mesh axis, and each
parameter (with its AdamW moments) is split over ``fsdp`` along its logical
``embed`` axis, which every GPT parameter has. FP8 scale state and scalars are
replicated. Axes are ``AxisType.Auto``, so XLA inserts the all-gathers and
reduce-scatters; under FSDP the FP8 ops quantize the local shard first and
the all-gather moves FP8 bytes.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from fp8jax.flax._common import EMBED
from fp8jax.training.errors import ConfigError

AXES = ("dp", "fsdp")


def parse_mesh(text: str | None) -> dict[str, int]:
    """``"dp=2,fsdp=4"`` as ``{"dp": 2, "fsdp": 4}``; None or ``""`` is ``{}`` (one device).

    Raises:
      ConfigError: for a malformed string, an axis other than dp/fsdp, or a size < 1.
    """
    if not text:
        return {}
    axes: dict[str, int] = {}
    for part in text.split(","):
        name, eq, size = part.strip().partition("=")
        if not eq or not size.strip().isdigit():
            raise ConfigError(f"--mesh must look like 'fsdp=8' or 'dp=2,fsdp=4', got {text!r}.")
        name = name.strip()
        if name not in AXES or name in axes:
            raise ConfigError(
                f"--mesh axes are {AXES}, each at most once; got {name!r} in {text!r}."
            )
        if int(size) < 1:
            raise ConfigError(f"--mesh axis {name} must have size >= 1, got {text!r}.")
        axes[name] = int(size)
    return axes


def build_mesh(axes: dict[str, int], *, batch_size: int, hidden: int) -> Mesh | None:
    """A Mesh over the first ``prod(sizes)`` devices, or None for ``{}``.

    Raises:
      ConfigError: if there are too few devices, or the batch or the model
        width does not split evenly.
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
    grid = np.array(devices[:size], dtype=object).reshape(tuple(axes.values()))
    return Mesh(grid, tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def param_shardings(boxed_params, mesh: Mesh):
    """NamedShardings of the params from their logical axis names (``embed`` -> ``fsdp``)."""
    rules = ((EMBED, "fsdp"),) if "fsdp" in mesh.axis_names else ()
    return nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed_params), mesh, rules)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The batch axis split over every mesh axis."""
    return NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())

"""``fp8jax train`` on several processes: joining them, and which of them writes.

One process drives the GPUs of one host (or a share of them); the processes
meet through ``jax.distributed.initialize`` before JAX starts its backends.
They are found either from options (``--coordinator-address``,
``--num-processes``, ``--process-id``, the address also from
``JAX_COORDINATOR_ADDRESS``) or from a cluster environment that JAX detects
itself: SLURM (``srun``) and Open MPI (``mpirun``), when they started more than
one task. Nothing is initialized for a run of one process.

Every process runs the same step on the same global mesh, loads only the rows
of each batch its devices hold, and takes part in every checkpoint save and
restore (orbax coordinates them; the run directory must be on a file system
all hosts share). Only process 0 prints and writes ``config.json``,
``metrics.jsonl`` and ``summary.json`` (docs/scaling.md).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import jax
import numpy as np

from fp8jax.training.errors import ConfigError

# The variables JAX's own cluster detection reads (jax._src.clusters): SLURM's
# job step and Open MPI's mpirun. Only these two are recognized by fp8jax; others
# (Kubernetes, Cloud TPU) need the explicit options.
_SLURM = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
_OMPI = ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE")


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this process joins the run.

    Attributes:
      source: ``"options"``, ``"slurm"``, ``"ompi"`` or ``"single"`` (one process, no join).
      coordinator_address: ``host:port`` of process 0's coordinator, or None to
        let JAX's cluster detection choose it.
      num_processes, process_id: None to let JAX's cluster detection read them.
    """

    source: str
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


def _task_count(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ.get(name, "1"))
    except ValueError:
        return 1


def _host_and_port(address) -> bool:
    # The port is checked here: jax.distributed.initialize segfaulted on 'localhost:abc'.
    if not isinstance(address, str):
        return False
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdecimal() and 0 < int(port) < 2**16


def plan(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    environ: Mapping[str, str] | None = None,
) -> Launch:
    """Decides how to join from the options and the environment; starts nothing.

    Raises:
      ConfigError: for an incomplete or inconsistent set of options.
    """
    environ = os.environ if environ is None else environ
    address = coordinator_address or environ.get("JAX_COORDINATOR_ADDRESS") or None
    for name, value, low in (("num-processes", num_processes, 1), ("process-id", process_id, 0)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < low):  # fmt: skip
            raise ConfigError(f"--{name} must be an int >= {low}, got {value!r}.")
    if address is not None and not _host_and_port(address):
        raise ConfigError(
            "--coordinator-address must look like 'host:port' (process 0's host, a port from 1 "
            f"to 65535), got {address!r}."
        )
    if num_processes is not None or process_id is not None:
        missing = [
            f"--{n}"
            for n, v in (
                ("coordinator-address", address),
                ("num-processes", num_processes),
                ("process-id", process_id),
            )
            if v is None
        ]
        if missing:
            raise ConfigError(
                f"a multi-process run outside SLURM or Open MPI needs --coordinator-address "
                f"(or JAX_COORDINATOR_ADDRESS), --num-processes and --process-id; "
                f"{', '.join(missing)} missing."
            )
        if process_id >= num_processes:
            raise ConfigError(
                f"--process-id must be below --num-processes ({num_processes}), got {process_id}."
            )
        if num_processes == 1:
            return Launch("single")
        return Launch("options", address, num_processes, process_id)
    if all(k in environ for k in _SLURM) and _task_count(environ, "SLURM_NTASKS") > 1:
        return Launch("slurm", address)
    if all(k in environ for k in _OMPI) and _task_count(environ, "OMPI_COMM_WORLD_SIZE") > 1:
        return Launch("ompi", address)
    if coordinator_address is not None:
        raise ConfigError(
            f"--coordinator-address {coordinator_address!r} was given without --num-processes "
            "and --process-id, outside SLURM or Open MPI; pass both."
        )
    return Launch("single")


def initialize(launch: Launch) -> None:
    """Joins the other processes (``jax.distributed.initialize``), unless one process runs.

    A caller that initialized ``jax.distributed`` itself keeps its own setup.

    Raises:
      ConfigError: when JAX has started its backends already, or cannot join.
    """
    if launch.source == "single" or jax.distributed.is_initialized():
        return
    kwargs = {}
    if launch.source in ("slurm", "ompi"):
        kwargs["cluster_detection_method"] = launch.source
    try:
        jax.distributed.initialize(
            launch.coordinator_address,
            num_processes=launch.num_processes,
            process_id=launch.process_id,
            **kwargs,
        )
    except (RuntimeError, ValueError) as e:
        raise ConfigError(
            f"joining the other processes ({launch.source}) failed: {e}. "
            "jax.distributed must start before anything else in the process uses JAX."
        ) from None


def is_writer() -> bool:
    """Whether this process prints and writes the run's files (process 0)."""
    return jax.process_index() == 0


def check_mesh(mesh) -> None:
    """Under several processes the mesh must span every process's devices.

    Raises:
      ConfigError: when it does not (no mesh, or a mesh of fewer devices).
    """
    if jax.process_count() == 1:
        return
    total = jax.device_count()
    size = 0 if mesh is None else mesh.size
    if size != total:
        given = "no --mesh" if mesh is None else f"a mesh of {size} devices"
        raise ConfigError(
            f"--mesh must span all {total} devices of the {jax.process_count()} processes "
            f"(e.g. --mesh fsdp={total} or dp={jax.process_count()},fsdp="
            f"{total // jax.process_count()}); got {given}."
        )


def differing_processes(digest: str) -> list[int]:
    """The processes whose hex ``digest`` differs from process 0's; [] for one process."""
    if jax.process_count() == 1:
        return []
    from jax.experimental import multihost_utils

    mine = np.frombuffer(bytes.fromhex(digest)[:16], np.uint32)
    every = np.asarray(multihost_utils.process_allgather(mine))
    return [i for i, row in enumerate(every) if not np.array_equal(row, every[0])]

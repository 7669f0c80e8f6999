"""fp8jax's Pallas kernels, each with its XLA twin; the switch; the one decision of kernel or XLA.

:mod:`fp8jax.kernels.dispatch` decides, for every kernel, whether it runs
and on which rows. The cast kernels live here: an FP8 operand with its
transposed copy (:mod:`fp8jax.kernels.cast_transpose`) and the MLP's
activation and its gradient inside FP8 casts
(:mod:`fp8jax.kernels.activation_cast`). The norm's kernels
(:mod:`fp8jax.ops.norm_forward`, :mod:`fp8jax.ops.norm_backward`) stay
beside the norm's row arithmetic in :mod:`fp8jax.ops.norm`, which both
they and their XLA twins run. This package imports nothing from
:mod:`fp8jax.ops`.
"""

from fp8jax.kernels.dispatch import (
    PALLAS,
    XLA,
    Placement,
    data_parallel,
    data_parallel_axes,
    decide,
    enabled,
    is_local,
    placement,
    row_axes,
    set_pallas,
    use_pallas,
)

__all__ = [
    "PALLAS",
    "XLA",
    "Placement",
    "data_parallel",
    "data_parallel_axes",
    "decide",
    "enabled",
    "is_local",
    "placement",
    "row_axes",
    "set_pallas",
    "use_pallas",
]

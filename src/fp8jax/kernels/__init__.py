"""fp8jax's Pallas kernels, each with its XLA twin; the switch; the one decision of kernel or XLA.

:mod:`fp8jax.kernels.dispatch` decides, for every kernel, whether it runs
and on which rows. The cast kernels live here: an FP8 operand with its
transposed copy (:mod:`fp8jax.kernels.cast_transpose`) and the MLP's
activation and its gradient inside FP8 casts
(:mod:`fp8jax.kernels.activation_cast`), the norm's forward with its cast
and its backward (:mod:`fp8jax.kernels.norm_forward`,
:mod:`fp8jax.kernels.norm_backward`, over the row arithmetic of
:mod:`fp8jax.kernels.norm_rows`), and the fine-grained and grouped GEMMs
(the BF16 baseline's on JAX's Mosaic GPU kernels:
:mod:`fp8jax.kernels.bf16_grouped`). This package imports nothing from :mod:`fp8jax.ops` or above
(tests/test_imports.py checks it).
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
    "set_pallas",
    "use_pallas",
]

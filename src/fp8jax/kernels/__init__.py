"""fp8jax's Pallas kernels: the switch, and the one decision of kernel or XLA.

:mod:`fp8jax.kernels.dispatch` decides, for every kernel, whether it runs
and on which rows; the kernels themselves and their XLA twins live with the
ops that use them (:mod:`fp8jax.ops.cast_transpose`, ``norm_forward``,
``norm_backward``, ``activation_cast``). This package imports nothing from
:mod:`fp8jax.ops`.
"""

from fp8jax.kernels.dispatch import (
    PALLAS,
    data_parallel,
    data_parallel_axes,
    enabled,
    is_local,
    placement,
    row_axes,
    set_pallas,
    use_pallas,
)

__all__ = [
    "PALLAS",
    "data_parallel",
    "data_parallel_axes",
    "enabled",
    "is_local",
    "placement",
    "row_axes",
    "set_pallas",
    "use_pallas",
]

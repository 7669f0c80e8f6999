"""The one static config of the fine-grained GEMMs: rowwise, block and MX.

Each of :func:`fp8jax.ops.rowwise.row_dot`, :func:`fp8jax.ops.blockwise.block_dot`
and :func:`fp8jax.ops.mx.mx_dot` multiplies ``a (B, M, K)`` by ``b (B, N,
K)^T`` in a custom_vjp whose one static argument is a :class:`FineDotConfig`;
:func:`fp8jax.ops.fine_grained.dot_general` picks the GEMM from the
recipe's declared granularity (:meth:`fp8jax.recipes.RowwiseScaling.granularity`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fp8jax.ops import _partitioning
from fp8jax.recipes import BlockScaling, MXFP8Scaling, RowwiseScaling


@dataclasses.dataclass(frozen=True)
class FineDotConfig:
    """Everything static about one fine-grained GEMM: its custom_vjp's only static argument."""

    recipe: RowwiseScaling | BlockScaling | MXFP8Scaling
    out_dtype: np.dtype
    a_dtype: np.dtype
    b_dtype: np.dtype
    # What each operand's cotangent must match: shard_map axes, Explicit sharding.
    inputs: tuple[_partitioning.InputType, ...] = ()

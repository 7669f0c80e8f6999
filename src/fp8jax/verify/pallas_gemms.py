"""fp8jax's own Pallas GEMM kernels, as the GEMM report recognizes them.

A Pallas Triton kernel compiles to a ``__gpu$xla.gpu.triton`` custom call
whose backend config names the kernel (``name = "..."``). Such a call is a
GEMM of the report only when its name is one of :data:`KERNELS`, each
listed with the operands that hold its two GEMM inputs; it is FP8 when both
are f8, as for cuBLASLt's and Triton's GEMMs. Other Pallas kernels (casts,
norms) stay out of the report.
"""

from __future__ import annotations

import re

TRITON_TARGET = "__gpu$xla.gpu.triton"
BACKEND = "pallas"
# Kernel name -> the operand indices of its two GEMM inputs.
KERNELS = {"fp8jax_block_scaled_gemm": (0, 1)}  # fp8jax.ops.block_gemm

_NAME = re.compile(r'\bname = "([^"]*)"')


def gemm_operands(target: str, attrs: str) -> tuple[int, int] | None:
    """The GEMM inputs' operand indices if the custom call is a known Pallas GEMM, else None."""
    if target != TRITON_TARGET:
        return None
    match = _NAME.search(attrs.split("backend_config=", 1)[-1])
    return KERNELS.get(match.group(1)) if match else None

"""fp8jax's own Pallas GEMM kernels, as the GEMM report recognizes them.

A Pallas Triton kernel compiles to a ``__gpu$xla.gpu.triton`` custom call
whose backend config names the kernel (``name = "..."``); a Pallas Mosaic
GPU kernel to a ``mosaic_gpu_v2`` custom call whose ``op_name`` ends in
``<name>/mpmd_map``. Such a call is a GEMM of the report only when its name
is one of :data:`KERNELS`, each listed with the operands that hold its two
GEMM inputs; it is FP8 when both are f8 (backend ``pallas-fp8``, else
``pallas``), as for cuBLASLt's and Triton's GEMMs. Other Pallas kernels
(casts, norms) stay out of the report.
"""

from __future__ import annotations

import re

TRITON_TARGET = "__gpu$xla.gpu.triton"
MOSAIC_GPU_TARGET = "mosaic_gpu_v2"
# Kernel name -> the operand indices of its two GEMM inputs.
KERNELS = {
    "fp8jax_block_scaled_gemm": (0, 1),  # fp8jax.kernels.block_gemm (Mosaic GPU)
    # fp8jax.kernels.grouped_gemm: the group tables come first, the operands last.
    "fp8jax_grouped_gemm": (-2, -1),
    "fp8jax_grouped_gemm_wgrad": (-2, -1),
    # fp8jax.kernels.attention: Q and K (QKᵀ; the kernel's PV runs on the same FP8 tensor cores).
    "fp8jax_attention_fwd": (0, 1),
    # fp8jax.kernels.attention_backward: the gradient products take BF16 Q and V
    # (the scores' recompute is FP8), so the report lists them as not FP8.
    "fp8jax_attention_dkv": (4, 6),
    "fp8jax_attention_dq": (4, 6),
}

_NAME = re.compile(r'\bname = "([^"]*)"')


def kernel_name(target: str, attrs: str, op_name: str) -> str | None:
    """The :data:`KERNELS` name of a Pallas custom call, or None for any other call."""
    if target not in (TRITON_TARGET, MOSAIC_GPU_TARGET):
        return None
    # A Triton call's backend config names the kernel; JAX's op_name ends in
    # ".../<name>/pallas_call" (Triton) or ".../<name>/mpmd_map" (Mosaic GPU).
    match = _NAME.search(attrs.split("backend_config=", 1)[-1]) if target == TRITON_TARGET else None
    parts = op_name.split("/")
    names = [match.group(1)] if match else []
    if len(parts) >= 2 and parts[-1] in ("pallas_call", "mpmd_map"):
        names.append(parts[-2])
    return next((name for name in names if name in KERNELS), None)


def backend(lhs_is_fp8: bool, rhs_is_fp8: bool) -> str:
    """The report's backend of a Pallas GEMM: ``pallas-fp8`` on two f8 operands."""
    return "pallas-fp8" if lhs_is_fp8 and rhs_is_fp8 else "pallas"

"""Prove that a program's GEMMs run in FP8, on a CPU-only machine or on the GPU.

``compile_for`` compiles a function for an H100 or H200 (deviceless, in a child
process, 1 to 16+ devices over any mesh) or for the GPU at hand
(``target="live"``), and returns the optimized HLO. ``gemm_report`` reads that
HLO and lists every GEMM with its backend, operand dtypes and source line, and
every collective with its dtype. ``jaxpr_dots`` lists a function's
dot_generals before any compiler pass, without compiling. ``assert_fp8_gemms``
fails, naming the line, when a GEMM is not FP8. ``fp8_relayouts`` lists the
kernels that only move FP8 data into another layout, and flags the transposes
XLA emits untiled (slow).
``fp8jax verify MODULE:FUNCTION`` does the same from the shell.

What counts as FP8: a GEMM whose kernel reads two FP8 operands, i.e. a
cuBLASLt ``__cublas$lt$matmul$f8`` call (backend ``cublaslt-fp8``) or a Triton
GEMM fusion whose ``dot`` reads f8 values (``triton-fp8``), including a fusion
that converts a BF16 input to f8 inside, before its dot, or one of fp8jax's
Pallas grouped-GEMM kernels reading two f8 operands (``pallas-fp8``). A GEMM that reads
values converted from f8 to BF16/F32 (quantize, then dequantize, then a BF16
dot) is not FP8; the report marks it ``upcast_from_fp8``.

XLA flags, and why fp8jax sets none:
  Without a device, XLA does no autotuning. Every dot then becomes a Triton
  GEMM fusion, unless ``--xla_gpu_enable_triton_gemm=false`` is in
  ``XLA_FLAGS``; with it, FP8 dots become ``__cublas$lt$matmul$f8`` calls. On a
  live GPU the autotuner picks per GEMM and may mix both. The verifier
  therefore accepts both backends as FP8 and asserts on structure (operand
  dtypes, upcasts, collective dtypes), never on tuning choices.

  Measured on an H200 for a full transformer layer (forward + backward):
  Flax's direct FP8 path ran slower with Triton GEMMs off, while Flax's
  quantize-dequantize path only becomes FP8 at all with them off (0 FP8
  GEMMs with them on; docs/design.md#why-fp8-operands-go-straight-into-dot_general).
  fp8jax hands FP8-typed operands to
  ``lax.dot_general``, so it is FP8 either way and does not set the flag for
  its users; pass ``xla_flags=`` here to check the other configuration.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from fp8jax import verify
  >>> x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
  >>> qdq = lambda a: a.astype(jnp.float8_e4m3fn).astype(jnp.bfloat16)
  >>> report = verify.gemm_report(verify.compile_for(lambda a, b: qdq(a) @ qdq(b).T, x, x))
  >>> [(g.backend, g.lhs_dtype, g.is_fp8) for g in report.gemms]
  [('triton', 'bf16', False)]
"""

from fp8jax.verify.assertions import Fp8VerificationError, assert_fp8_gemms
from fp8jax.verify.compilation import CompileError, Memory, compile_for, compile_many, memory_many

# The function, not its module: importing the submodule binds ``verify.jaxpr_dots`` to the
# module, and this line rebinds it, so ``fp8jax.verify.jaxpr_dots(fn, *args)`` works as the
# README says (``from fp8jax.verify.jaxpr_dots import jaxpr_dots`` still does too).
from fp8jax.verify.jaxpr_dots import JaxprDot, jaxpr_dots
from fp8jax.verify.pallas_gemms import read_ptx
from fp8jax.verify.relayouts import RelayoutRow, fp8_relayouts
from fp8jax.verify.report import CollectiveRow, GemmRow, Report, gemm_report

__all__ = [
    "CollectiveRow",
    "CompileError",
    "Fp8VerificationError",
    "GemmRow",
    "JaxprDot",
    "Memory",
    "RelayoutRow",
    "Report",
    "assert_fp8_gemms",
    "compile_for",
    "compile_many",
    "fp8_relayouts",
    "gemm_report",
    "jaxpr_dots",
    "memory_many",
    "read_ptx",
]

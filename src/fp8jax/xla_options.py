"""XLA compiler options for programs whose GEMMs are fp8jax's FP8 GEMMs.

On a live GPU, XLA's default pipeline wraps an FP8 ``dot_general`` together
with its output scale into a Triton GEMM fusion, autotunes it against
cuBLASLt, and then compiles the Triton kernels it picked: a first compile of
minutes for one transformer layer. fp8jax's own FP8 dots name their FP8
algorithm when lowered for CUDA, which Triton does not take, so a plain
``jax.jit`` already gives cuBLASLt FP8 calls
(:func:`fp8jax.ops.gemm.fp8_dot_general`). Under a mesh, XLA's sharding pass
can drop a dot's algorithm (jaxlib 0.10.2) and Triton takes that GEMM again;
with Triton GEMMs off every GEMM is a cuBLASLt FP8 call with the scale folded
into it, whatever the mesh (docs/design.md#first-compile-time has the
measurements and what it costs). ``fp8jax train`` and the benchmarks compile
with these options; sharded programs of your own can too::

    step = jax.jit(train_step, compiler_options=fp8jax.compiler_options())

They are per-compile options: they change no global state and leave every
other program of the process as it was. On the CPU they are accepted and do
nothing.
"""

from __future__ import annotations

# Why these and no others: docs/design.md#first-compile-time.
_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def compiler_options() -> dict[str, bool]:
    """The XLA options fp8jax compiles its own programs with, as a fresh dict.

    Returns:
      A mapping for ``jax.jit(..., compiler_options=...)`` or
      ``jitted.lower(...).compile(compiler_options=...)``: Triton GEMM fusion
      off, so that every FP8 GEMM goes to cuBLASLt without autotuning Triton
      kernels first.

    Example:
      >>> import jax, jax.numpy as jnp, fp8jax
      >>> f = jax.jit(lambda x, w: fp8jax.dense(x, w), compiler_options=fp8jax.compiler_options())
      >>> f(jnp.ones((16, 32), jnp.bfloat16), jnp.ones((32, 16), jnp.bfloat16)).shape
      (16, 16)
    """
    return dict(_OPTIONS)


def as_xla_flags() -> str:
    """:func:`compiler_options` as ``XLA_FLAGS`` text, for a deviceless compile in a child process.

    Example:
      >>> from fp8jax.xla_options import as_xla_flags
      >>> as_xla_flags()
      '--xla_gpu_enable_triton_gemm=false'
    """
    return " ".join(f"--{k}={str(v).lower()}" for k, v in _OPTIONS.items())

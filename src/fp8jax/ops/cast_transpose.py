"""FP8 cast of a GEMM operand, its transposed copy, column sums and amax, in one pass.

cuBLASLt's FP8 GEMMs take only operands whose contracting axis is the minor
one, so each FP8 operand is needed in two layouts: a gradient ``g`` (tokens,
features) feeds the dgrad GEMM as itself and the wgrad GEMM transposed, an
input ``x`` the forward GEMM as itself and the wgrad GEMM transposed, and a
kernel (in, out) the dgrad GEMM as itself and the forward GEMM transposed.
XLA casts in one kernel and transposes the FP8 copy in another, moving
1-byte elements through its transpose emitter at about 2.3 TB/s; its
reductions with fused math run slower still (bench/results/h200-2026-11-30-e).
On NVIDIA GPUs :func:`cast_transpose` is one Pallas (Triton) kernel that
reads the operand once and writes both FP8 copies, per-tile column sums (a
bias's gradient) and per-tile maxima (delayed scaling's amax). On the H200 a
(16384, 32768) bf16 gradient took 0.63 ms where XLA's two kernels took
0.78 + 0.46 ms. Elsewhere (the CPU tests) XLA computes the same values.

The kernel sees whole arrays: call it only where the operand is local to
each device (no mesh axis splits it, or inside ``shard_map``). A
``pallas_call`` has no partitioning rule, so under a sharded ``jit`` XLA
would gather its operands in high precision; the callers keep XLA's path
there (``fp8jax.ops.dense._kernel_is_local``).

JAX 0.11 deprecates Pallas's Triton backend in favour of Mosaic GPU, and
warns (DeprecationWarning) when it lowers the kernel. Mosaic GPU in the JAX
versions fp8jax supports cannot express this kernel: it has no transpose of
a register array and no reduction over an axis (deviceless H100 compile,
jax 0.10.2). ``FP8JAX_PALLAS=0`` in the environment turns the kernel off;
a JAX without the Triton backend turns it off with a warning. Either way
XLA computes the same values.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.formats import Fp8Format
from fp8jax.quantize import quantize_with_scale

# Tile rows x columns of g per program. 64 x 128 with 4 warps was the fastest
# of five shapes on the H200 (32-128 rows, 64-128 columns, 4-8 warps).
BLOCK_ROWS, BLOCK_COLS, WARPS = 64, 128, 4


def enabled() -> bool:
    """Whether :func:`cast_transpose` may run its Pallas kernel (see the module docstring)."""
    return os.environ.get("FP8JAX_PALLAS", "1") != "0" and _triton_backend_available()


@functools.cache
def _triton_backend_available() -> bool:
    try:
        from jax.experimental.pallas import triton  # noqa: F401
    except ImportError:
        warnings.warn(
            "fp8jax: this JAX has no Pallas Triton backend, so FP8 gradients are cast and "
            "transposed by XLA's slower kernels (fp8jax.ops.cast_transpose).",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def tiles_fit(shape: tuple[int, ...]) -> bool:
    """Whether ``shape`` is 2-D and splits into whole kernel tiles."""
    return len(shape) == 2 and shape[0] % BLOCK_ROWS == 0 and shape[1] % BLOCK_COLS == 0


class CastTransposed(NamedTuple):
    """What :func:`cast_transpose` returns for a (rows, columns) array ``g``."""

    q: jax.Array  # (rows, columns), the FP8 cast
    q_t: jax.Array  # (columns, rows), its transpose
    column_sums: jax.Array  # (columns,) f32 sums of g over its rows
    amax: jax.Array  # () f32 max |g|


def _kernel(fmt: Fp8Format, g_ref, scale_ref, q_ref, qt_ref, sum_ref, max_ref):
    g = g_ref[...].astype(jnp.float32)
    q = quantize_with_scale(g, fmt, scale_ref[0]).data
    q_ref[...] = q
    qt_ref[...] = q.T
    sum_ref[...] = jnp.sum(g, axis=0)[None, :]
    max_ref[...] = jnp.max(jnp.abs(g), axis=0)[None, :]


def _pallas(g, scale, fmt: Fp8Format, interpret: bool = False):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pallas_triton

    rows, cols = g.shape
    grid = (rows // BLOCK_ROWS, cols // BLOCK_COLS)
    params = {} if interpret else {"compiler_params": pallas_triton.CompilerParams(num_warps=WARPS)}
    q, qt, partial_sums, partial_maxima = pl.pallas_call(
        functools.partial(_kernel, fmt),
        grid=grid,
        in_specs=[
            pl.BlockSpec((BLOCK_ROWS, BLOCK_COLS), lambda i, j: (i, j)),
            pl.BlockSpec((1,), lambda i, j: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((BLOCK_ROWS, BLOCK_COLS), lambda i, j: (i, j)),
            pl.BlockSpec((BLOCK_COLS, BLOCK_ROWS), lambda i, j: (j, i)),
            pl.BlockSpec((1, BLOCK_COLS), lambda i, j: (i, j)),
            pl.BlockSpec((1, BLOCK_COLS), lambda i, j: (i, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((rows, cols), fmt.dtype),
            jax.ShapeDtypeStruct((cols, rows), fmt.dtype),
            jax.ShapeDtypeStruct((grid[0], cols), jnp.float32),
            jax.ShapeDtypeStruct((grid[0], cols), jnp.float32),
        ],
        interpret=interpret,
        name="fp8jax_cast_transpose",
        **params,
    )(g, scale.astype(jnp.float32).reshape(1))
    return q, qt, jnp.sum(partial_sums, axis=0), jnp.max(partial_maxima)


def _xla(g, scale, fmt: Fp8Format):
    q = quantize_with_scale(g, fmt, scale).data
    g32 = g.astype(jnp.float32)
    return q, q.T, jnp.sum(g32, axis=0), jnp.max(jnp.abs(g32))


def cast_transpose(g: jax.Array, scale: jax.Array, fmt: Fp8Format) -> CastTransposed:
    """The saturating FP8 cast of a 2-D ``g`` at ``scale``, its transpose, column sums and amax.

    ``q`` holds exactly the bytes of ``quantize_with_scale(g, fmt, scale).data``;
    the column sums are f32 sums of ``g`` over its rows, the amax ``max |g|``
    (delayed scaling's history entry, taken in the same pass). ``g``'s shape
    must split into whole tiles (:func:`tiles_fit`). With the kernel switched
    off (:func:`enabled`) XLA computes the same values on every platform.
    """
    if not tiles_fit(g.shape):
        raise ValueError(
            f"g must be 2-D with rows a multiple of {BLOCK_ROWS} and columns a multiple of "
            f"{BLOCK_COLS}, got shape {g.shape}."
        )
    if not enabled():
        return CastTransposed(*_xla(g, scale, fmt))
    return CastTransposed(*lax.platform_dependent(
        g, scale, cuda=functools.partial(_pallas, fmt=fmt), default=functools.partial(_xla, fmt=fmt)
    ))  # fmt: skip

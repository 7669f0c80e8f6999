"""The FP8 GEMMs of every op: forward, dgrad and wgrad on FP8-typed operands.

XLA's quantize->dequantize pattern matcher runs after Triton GEMM fusion and
simplifies the round trip away
(docs/design.md#why-fp8-operands-go-straight-into-dot_general), so the
operands handed to ``lax.dot_general`` here are already E4M3/E5M2 arrays,
and the product is rescaled by ``scale_inv_a * scale_inv_b``, a scalar XLA
folds into the cuBLASLt call. Forward: x(E4M3) . w(E4M3); backward: dgrad
g(E5M2) . w(E4M3) and wgrad x(E4M3) . g(E5M2). E5M2 x E5M2, which cuBLASLt
rejects, never occurs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8jax.kernels import dispatch
from fp8jax.ops import _partitioning, dimensions
from fp8jax.ops.operand import Fp8Layout, QuantizedOperand
from fp8jax.quantize import Fp8Array, check_high_precision
from fp8jax.recipes import Recipe


def scaled_dot(
    a: Fp8Array, b: Fp8Array | QuantizedOperand, dims, out_dtype, precision, permutation=None,
    like=None,
) -> jax.Array:  # fmt: skip
    """``dot_general(a.data, b.data) * a.scale_inv * b.scale_inv`` in ``out_dtype``.

    ``like``: for a gradient, its primal, whose sharding it takes over
    Explicit mesh axes (see :mod:`fp8jax.ops._partitioning`). A
    :class:`~fp8jax.ops.operand.QuantizedOperand` ``b`` (a forward GEMM's
    kernel) with a transposed copy gives that copy to
    :func:`as_kernel_matrices` as the (free, contracted) matrix.
    """
    kernel_t = None
    if isinstance(b, QuantizedOperand):
        kernel_t = b.transposed.data if b.has_transposed else None
        b = b.fp8
    matrices = as_kernel_matrices(a.data, b.data, dims, kernel_t)
    if matrices is None:
        a_data, b_data, gemm_dims, out_shape = a.data, b.data, dims, None
    else:
        a_data, b_data, out_shape = matrices
        gemm_dims = (((a_data.ndim - 1,), (1,)), ((), ()))
    out_sharding = _partitioning.dot_out_sharding(a_data, b_data, gemm_dims, like, permutation)
    acc = gemm_dtype(out_dtype)
    y = fp8_dot_general(a_data, b_data, gemm_dims, precision, acc, out_sharding)
    if out_shape is not None:
        y = y.reshape(out_shape)
    # In the GEMM's dtype: a float16 output's scale (scale_inv_a * scale_inv_b)
    # is below float16's smallest subnormal for operands of amax below about 0.1.
    y = (y * (a.scale_inv * b.scale_inv).astype(acc)).astype(out_dtype)
    return y if permutation is None else jnp.transpose(y, permutation)


def gemm_dtype(out_dtype) -> np.dtype:
    """The dtype an FP8 GEMM writes before its scales multiply it.

    Unscaled, the product of two FP8 operands reaches ``448**2 * K`` (about
    3e9 for K = 16384; E5M2 x E4M3, ``57344 * 448 * K``): beyond float16's
    range, within bfloat16's. bfloat16 output rounds once more (a relative
    2**-9, against E4M3's 2**-4 per operand) and halves what the GEMM writes;
    float16 and float32 outputs are computed in float32, as cuBLASLt scales
    its f32 accumulator before it converts (docs/design.md#fine-grained-scaling).
    """
    return jnp.dtype(jnp.bfloat16) if jnp.dtype(out_dtype) == jnp.bfloat16 else np.dtype(np.float32)


# The cuBLASLt accumulation each lax.Precision asks for, as the FP8 dot
# algorithm that names it: XLA's GPU backend gives fast accumulation to an FP8
# dot of DEFAULT precision and to ANY_F8_ANY_F8_F32_FAST_ACCUM, split
# accumulation to any other precision and to ANY_F8_ANY_F8_F32.
_CUDA_ALGORITHM = {
    lax.Precision.DEFAULT: lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM,
    lax.Precision.HIGH: lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32,
    lax.Precision.HIGHEST: lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32,
}


def fp8_dot_general(a, b, dims, precision, out_dtype, out_sharding=None) -> jax.Array:
    """``lax.dot_general`` of FP8 operands, named by its FP8 algorithm where lowered for CUDA.

    XLA's GEMM fusion hands Triton every dot whose algorithm Triton supports,
    and a Triton GEMM fusion is autotuned against cuBLASLt on the first
    compile (minutes for a layer). Triton supports no explicit FP8 algorithm,
    so a dot that names one is left to the cuBLASLt FP8 rewrite, with the
    same accumulation as ``precision`` (:data:`_CUDA_ALGORITHM`) and no flag
    from the user (docs/design.md#first-compile-time). JAX refuses these
    algorithms on the CPU, so other platforms lower the plain dot; only the
    branch of the platform being compiled for is lowered.
    """
    precision = lax.Precision.DEFAULT if precision is None else precision

    def dot(algorithm):
        return lambda a, b: lax.dot_general(
            a, b, dims, precision=algorithm, preferred_element_type=out_dtype,
            out_sharding=out_sharding,
        )  # fmt: skip

    return lax.platform_dependent(
        a, b, cuda=dot(_CUDA_ALGORITHM[precision]), default=dot(precision)
    )


def kernel_contraction(dims, a_ndim: int, kernel_ndim: int) -> int | None:
    """How many leading kernel axes ``dims`` contracts against ``a``'s trailing ones, or None.

    None for any other form: batch axes, a kernel with no free axis, no
    contracted axis (an outer product: the backward of a rank-1 operand's
    dot), or contracted axes elsewhere.
    """
    (a_contract, k_contract), (a_batch, k_batch) = dims
    n = len(k_contract)
    if a_batch or k_batch or kernel_ndim == n or n == 0:
        return None
    if tuple(k_contract) != tuple(range(n)):
        return None
    if tuple(a_contract) != tuple(range(a_ndim - n, a_ndim)):
        return None
    return n


def as_kernel_matrices(a: jax.Array, kernel: jax.Array, dims, kernel_t=None):
    """``(a, kernel)`` as a matrix product with the kernel transposed in the program, or None.

    cuBLASLt's FP8 GEMM takes only operands whose contracting axis is minor
    in memory, so a kernel contracted on its leading axes (every forward
    GEMM) needs a transposed FP8 copy. Left to XLA (jaxlib 0.11.2), the GEMM
    rewriter makes it with an untiled ``kLoop`` transpose between ``{0,1}``
    layouts at about 0.3 TB/s on the H200, where tiled transposes move FP8 at
    about 2.4 TB/s.
    Here the kernel is viewed as a (contracting, free) matrix and transposed
    explicitly; the optimization barrier keeps the algebraic simplifier from
    folding the transpose back into the dot. XLA then writes the transposed
    copy from the quantize fusion itself
    (docs/design.md#the-forward-kernel-transposed-in-the-program). A transpose
    of the three-dimensional kernel without the matrix view stayed slow: XLA
    gave it a layout that made it a bitcast. ``kernel_t``, the transposed
    matrix where the cast kernel wrote one
    (:func:`fp8jax.ops.quantizing.quantize_operand`), is used as is.

    Returns ``(a_matrix, kernel_transposed, result_shape)``, or None when
    the kernel is not contracted on its leading axes against ``a``'s trailing
    ones (:func:`kernel_contraction`), or when it may be sharded: under a
    mesh with ``Auto`` or ``Explicit`` axes the matrix view costs
    collectives (:func:`fp8jax.kernels.dispatch.is_local`).
    """
    n = kernel_contraction(dims, a.ndim, kernel.ndim)
    if n is None or not dispatch.is_local():
        return None
    depth = math.prod(kernel.shape[:n])
    free = kernel.shape[n:]
    if kernel_t is None:
        kernel_t = lax.optimization_barrier(kernel.reshape(depth, math.prod(free)).T)
    a_matrix = a.reshape(*a.shape[: a.ndim - n], depth) if n > 1 else a
    return a_matrix, kernel_t, (*a.shape[: a.ndim - n], *free)


def dgrad_dot(dims, lhs_ndim: int, rhs_q: Fp8Array, g_q: Fp8Array, lhs_dtype, recipe: Recipe,
              like=None):  # fmt: skip
    """The dgrad GEMM of ``dot_general(lhs, rhs, dims)``: lhs's gradient, in ``lhs_dtype``."""
    dg = dimensions.dgrad(dims, lhs_ndim, rhs_q.data.ndim)
    return scaled_dot(g_q, rhs_q, dg.dimension_numbers, lhs_dtype, recipe.dgrad_precision,
                      dg.permutation, like=like)  # fmt: skip


def wgrad_over_tokens(
    lhs: Fp8Layout, g: Fp8Layout, kernel_shape, dtype, recipe: Recipe
) -> jax.Array:
    """``lhs^T . g`` summed over the token axes: the wgrad of a kernel of ``kernel_shape``.

    Each operand comes as itself, tokens leading (``lhs``: tokens x the
    kernel's contracted axes, ``g``: tokens x its free axes), or transposed
    to (features, tokens) by the cast kernel; at least one of them
    transposed. cuBLASLt's FP8 GEMM wants the tokens as the minor axis of
    both, so XLA transposes only an operand that comes as itself.
    """
    if not (lhs.transposed or g.transposed):
        raise ValueError("wgrad_over_tokens needs lhs or g transposed to (features, tokens).")
    total = math.prod(kernel_shape)
    depth = lhs.fp8.shape[0] if lhs.transposed else total // g.fp8.shape[0]
    lhs_matrix = lhs.fp8.data if lhs.transposed else lhs.fp8.data.reshape(-1, depth)
    g_matrix = g.fp8.data if g.transposed else g.fp8.data.reshape(-1, total // depth)
    dims = (((1 if lhs.transposed else 0,), (1 if g.transposed else 0,)), ((), ()))
    return scaled_dot(
        Fp8Array(lhs_matrix, lhs.fp8.scale_inv, lhs.fp8.format),
        Fp8Array(g_matrix, g.fp8.scale_inv, g.fp8.format),
        dims, dtype, recipe.wgrad_precision,
    ).reshape(kernel_shape)  # fmt: skip


def backward_dots(
    dims, lhs_ndim: int, lhs: Fp8Layout, rhs_q: Fp8Array, g: QuantizedOperand, lhs_dtype,
    rhs_dtype, recipe: Recipe,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """dgrad and wgrad of ``dot_general(lhs, rhs, dims)``, both FP8.

    ``lhs``: the FP8 copy of lhs its forward saved, transposed to (features,
    tokens) where the cast kernel wrote that copy; ``g``: the quantized
    output gradient, maybe with its own transposed copy. Transposed copies
    exist only when ``dims`` contract lhs's trailing axes against the
    kernel's leading ones (:func:`kernel_contraction`); the wgrad GEMM then
    reads them as they are (:func:`wgrad_over_tokens`).
    """
    d_lhs = dgrad_dot(dims, lhs_ndim, rhs_q, g.fp8, lhs_dtype, recipe,
                      like=None if lhs.transposed else lhs.fp8.data)  # fmt: skip
    return d_lhs, wgrad_dot(dims, lhs_ndim, lhs, g.for_wgrad(), rhs_q.data, rhs_dtype, recipe)


def wgrad_dot(dims, lhs_ndim: int, lhs: Fp8Layout, g: Fp8Layout, rhs_like, rhs_dtype,
              recipe: Recipe) -> jax.Array:  # fmt: skip
    """The wgrad GEMM of ``dot_general(lhs, rhs, dims)``: rhs's gradient, in ``rhs_dtype``.

    ``lhs``, ``g``: as :func:`backward_dots` takes them (``g`` as the wgrad
    reads it); ``rhs_like``: an array of rhs's shape and sharding, which the
    gradient takes.
    """
    if not (lhs.transposed or g.transposed):
        wg = dimensions.wgrad(dims, lhs_ndim, rhs_like.ndim)
        return scaled_dot(lhs.fp8, g.fp8, wg.dimension_numbers, rhs_dtype,
                          recipe.wgrad_precision, wg.permutation, like=rhs_like)  # fmt: skip
    return wgrad_over_tokens(lhs, g, rhs_like.shape, rhs_dtype, recipe)


def check_bias(bias: jax.Array | None, expected: tuple[int, ...], name: str = "bias") -> None:
    """Raises unless ``bias`` is None or a high-precision array of its kernel's output shape."""
    if bias is None:
        return
    check_high_precision(name, bias)
    if tuple(bias.shape) != tuple(expected):
        raise ValueError(
            f"{name} must have the kernel's output shape {tuple(expected)}, "
            f"got {tuple(bias.shape)}."
        )


def add_bias(y: jax.Array, bias: jax.Array | None, n_out_axes: int) -> jax.Array:
    """``y + bias`` over ``y``'s last ``n_out_axes`` axes (the kernel's output axes)."""
    if bias is None:
        return y
    check_bias(bias, y.shape[y.ndim - n_out_axes :])
    return y + _partitioning.broadcastable(bias.astype(y.dtype), y.ndim)

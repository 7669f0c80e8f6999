"""MXFP8Scaling's GEMMs, forward and backward: OCP MX blocks of 32 along K, E8M0 scales.

Operands come as ``a`` (B, M, K), the activation, and ``b`` (B, N, K), the
weight with its contracted axis minor; every extent a multiple of 128
(:mod:`fp8jax.ops.fine_grained` pads, as cuDNN's block-scaled GEMM lays its
scales out in 128-row tiles). Every operand is scaled per block of 32 along
the axis its GEMM contracts, by the smallest power of two that keeps the
block within the format (:func:`fp8jax.ops.fine_quantize.quantize_tiles` with
power-of-two scales), so the weight, unlike BlockScaling's, is quantized
again for the input gradient, which contracts N: the forward saves ``a``
quantized along M and ``b`` along N, both FP8.

On NVIDIA GPUs the GEMM is ``jax.nn.scaled_matmul`` on E8M0 scales, which
XLA compiles to cuDNN's block-scaled FP8 GEMM (``__cudnn$blockScaledDot``)
for Blackwell. For Hopper XLA would dequantize both operands to BF16 and
multiply in BF16, so :func:`check_devices` refuses a GPU below compute
capability 10 before anything is traced. Elsewhere (the CPU, where
``scaled_matmul`` has no lowering) XLA computes the same sums, one FP8 dot
per 32-wide slice of K (:func:`fp8jax.kernels.block_gemm.xla_block_matmul`);
nothing is dequantized before a GEMM (docs/design.md#mxfp8-for-blackwell).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.kernels.block_gemm import xla_block_matmul
from fp8jax.ops import _partitioning
from fp8jax.ops.fine_config import FineDotConfig
from fp8jax.ops.fine_quantize import quantize_tiles
from fp8jax.ops.residuals import saved_as_bits
from fp8jax.recipes import MXFP8Scaling

BLOCK = MXFP8Scaling.BLOCK
# The compute capability whose GPUs multiply MX blocks in FP8 (Blackwell).
BLACKWELL = 10


def check_devices(devices=None, advice: str = "Use fp8jax.BlockScaling() on Hopper.") -> None:
    """Raises ValueError for a GPU among ``devices`` (this process's) older than Blackwell.

    ``advice``: the message's last sentence, what to use instead.
    """
    for device in jax.local_devices() if devices is None else devices:
        capability = getattr(device, "compute_capability", None)
        if device.platform != "gpu" or capability is None:
            continue
        if int(str(capability).split(".")[0]) < BLACKWELL:
            raise ValueError(
                f"MXFP8Scaling needs a GPU of compute capability {BLACKWELL}.0 or later "
                f"(Blackwell) for its block-scaled FP8 GEMMs; {device.device_kind} has "
                f"{capability}, where XLA would dequantize the operands and multiply in BF16. "
                + advice
            )


def _blocks(x, fmt):
    """``x`` (B, R, C) in MX blocks of 32 along C, its power-of-two f32 scales: an Fp8Array."""
    return quantize_tiles(x, fmt, BLOCK, 0, power_of_two=True).fp8


def _gemm(qa, qb, sa, sb, out_dtype) -> jax.Array:
    """``qa (B, M, K) . qb (B, N, K)^T``, each 32 of K scaled by its blocks' ``scale_inv``."""

    def gpu(qa, qb, sa, sb):
        e8m0 = jnp.float8_e8m0fnu  # exact: the scales are powers of two in its range
        return jax.nn.scaled_matmul(qa, qb, sa.astype(e8m0), sb.astype(e8m0),
                                    preferred_element_type=out_dtype)  # fmt: skip

    def xla(qa, qb, sa, sb):
        return xla_block_matmul(qa, qb, sa, sb, out_dtype=out_dtype, block=BLOCK)

    return lax.platform_dependent(qa, qb, sa, sb, cuda=gpu, default=xla)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def mx_dot(a, b, config: FineDotConfig):
    """``a (B, M, K) . b (B, N, K)^T`` -> (B, M, N) in MX blocks, FP8 both ways."""
    return _mx_dot_fwd(a, b, config)[0]


def _mx_dot_fwd(a, b, config: FineDotConfig):
    check_devices()
    fmt = config.recipe.formats.forward
    qa, qb = _blocks(a, fmt), _blocks(b, fmt)
    y = _gemm(qa.data, qb.data, qa.scale_inv, qb.scale_inv, config.out_dtype)
    # For the backward: a along M (the weight gradient), b along N (the input gradient).
    return y, (_blocks(jnp.swapaxes(a, 1, 2), fmt), _blocks(jnp.swapaxes(b, 1, 2), fmt))


def _mx_dot_bwd(config: FineDotConfig, residuals, g):
    a_t, b_t = residuals
    fmt = config.recipe.formats.backward
    qg, qg_t = _blocks(g, fmt), _blocks(jnp.swapaxes(g, 1, 2), fmt)
    d_a = _gemm(qg.data, b_t.data, qg.scale_inv, b_t.scale_inv, config.a_dtype)  # contracts N
    d_b = _gemm(qg_t.data, a_t.data, qg_t.scale_inv, a_t.scale_inv, config.b_dtype)  # contracts M
    return _partitioning.match_cotangents((d_a, d_b), None, config.inputs)[:2]


mx_dot.defvjp(*saved_as_bits(_mx_dot_fwd, _mx_dot_bwd))

"""FP8 dots in Pallas Triton kernels on Hopper's FP8 tensor cores (wgmma), not on f16 ones.

Triton picks Hopper's FP8 ``wgmma`` for a ``tt.dot`` of two FP8 operands with an
f32 result only when the dot's ``maxNumImpreciseAcc`` is at least 32: the
number of products the tensor core may sum at its own (reduced) precision
before the sum is promoted to f32. Triton's own frontend sets it to 2**30 on
Hopper; Pallas's lowering of ``dot_general`` leaves it at 0, and Triton then
falls back to Ampere's ``mma.sync``, converting every FP8 element to f16 in
registers first (seen in the PTX of a deviceless H200 compile: ``cvt.rn.f16x2.e4m3x2``
and ``mma.sync...f16``; with the attribute, ``wgmma...e4m3.e4m3``).

:func:`install` wraps Pallas's lowering rule so that a dot of two FP8
operands with an f32 result gets Triton's Hopper default. The block-scaled
GEMM (:mod:`fp8jax.kernels.block_gemm`) is what makes this exact enough: each
dot covers 128 elements of K, and its result is added to an f32 accumulator
outside the tensor core, DeepSeek-V3's promotion every 128 of K
(docs/design.md#fine-grained-scaling). The rule is global to the process;
it changes only dots that Pallas would otherwise run on f16 tensor cores.
"""

from __future__ import annotations

import functools
import warnings

import jax.numpy as jnp
from jax import lax

# Triton's default on Hopper (its CUDA backend's max_num_imprecise_acc_default).
MAX_NUM_IMPRECISE_ACC = 1 << 30


def _is_fp8(aval) -> bool:
    dtype = jnp.dtype(aval.dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1


@functools.cache
def install() -> bool:
    """Wraps Pallas Triton's dot_general lowering once; False (with a warning) where it cannot."""
    try:
        from jax._src.lib.mlir import ir
        from jax._src.pallas.triton import lowering
    except ImportError:
        return _cannot("this JAX has no Pallas Triton lowering module")
    rules = getattr(lowering, "triton_lowering_rules", None)
    if not isinstance(rules, dict) or lax.dot_general_p not in rules:
        return _cannot("Pallas Triton's lowering rules are not where fp8jax looks for them")
    original = rules[lax.dot_general_p]

    def lower_dot(ctx, a, b, **params):
        out = original(ctx, a, b, **params)
        owner = getattr(out, "owner", None)
        if (
            all(_is_fp8(aval) for aval in ctx.avals_in)
            and jnp.dtype(ctx.avals_out[0].dtype) == jnp.float32
            and getattr(owner, "name", None) == "tt.dot"
        ):
            i32 = ir.IntegerType.get_signless(32)
            owner.attributes["maxNumImpreciseAcc"] = ir.IntegerAttr.get(i32, MAX_NUM_IMPRECISE_ACC)
        return out

    rules[lax.dot_general_p] = lower_dot
    return True


def _cannot(why: str) -> bool:
    warnings.warn(
        f"fp8jax: {why}, so the block-scaled GEMM kernel's FP8 dots run on f16 tensor cores "
        "(fp8jax.kernels.triton_fp8_dot).",
        RuntimeWarning,
        stacklevel=3,
    )
    return False

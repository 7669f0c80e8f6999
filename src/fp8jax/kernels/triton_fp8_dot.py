"""FP8 dots in Pallas Triton kernels on Hopper's FP8 tensor cores (wgmma), not on f16 ones.

Triton picks Hopper's FP8 ``wgmma`` for a ``tt.dot`` of two FP8 operands with an
f32 result only when the dot's ``maxNumImpreciseAcc`` is at least 32: the
number of products the tensor core may sum at its own (reduced) precision
before the sum is promoted to f32. Triton's own frontend sets it to 2**30 on
Hopper; Pallas's lowering of ``dot_general`` leaves it at 0, and Triton then
falls back to Ampere's ``mma.sync``, converting every FP8 element to f16 in
registers first (seen in the PTX of a deviceless H200 compile: ``cvt.rn.f16x2.e4m3x2``
and ``mma.sync...f16``; with the attribute, ``wgmma...e4m3.e4m3``).

Two entry points, both installed by :func:`install`:

* A dot of two FP8 operands with an f32 result (``lax.dot_general`` in a
  kernel) gets Triton's Hopper default. Each such dot starts from a zero
  accumulator, so this serves a kernel that scales each dot's result before
  adding it, as the block-scaled GEMM (:mod:`fp8jax.kernels.block_gemm`) does
  every 128 of K: DeepSeek-V3's promotion of the accumulator to f32
  (docs/design.md#fine-grained-scaling).
* :func:`accumulate` (``acc + a . b^T``) for a main loop that sums plain
  products. Triton folds ``acc + dot(a, b, 0)`` into one dot that
  accumulates on the tensor core only while ``maxNumImpreciseAcc`` is 0 (its
  ``CombineDotAddFPattern``), so after the first change every step of such
  a loop would wait for its MMA and add the result with CUDA cores.
  :func:`accumulate` emits the one dot with ``acc`` as its accumulator, as
  Triton's own ``tl.dot(a, b, acc)`` does (docs/design.md#grouped-expert-gemms).

The rules are global to the process; they change only dots that Pallas would
otherwise run on f16 tensor cores, and a primitive only fp8jax's kernels bind.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import mlir

# Triton's default on Hopper (its CUDA backend's max_num_imprecise_acc_default).
MAX_NUM_IMPRECISE_ACC = 1 << 30

_CONTRACT_MINOR = (((1,), (1,)), ((), ()))


def _is_fp8(aval) -> bool:
    dtype = jnp.dtype(aval.dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1


def _accumulate_reference(acc, a, b):
    return acc + lax.dot_general(a, b, _CONTRACT_MINOR, preferred_element_type=acc.dtype)


def _accumulate_abstract(acc, a, b):
    ranks_ok = a.ndim == 2 and b.ndim == 2
    if not ranks_ok or a.shape[1] != b.shape[1] or acc.shape != (a.shape[0], b.shape[0]):
        raise ValueError(
            f"accumulate takes acc [m, n], a [m, k] and b [n, k]; got {acc.shape}, "
            f"{a.shape} and {b.shape}"
        )
    if acc.dtype != jnp.float32 or a.dtype != b.dtype or not _is_fp8(a):
        raise ValueError(
            "accumulate takes an f32 accumulator and two FP8 operands of one type; got "
            f"{acc.dtype}, {a.dtype} and {b.dtype}"
        )
    return jax.core.ShapedArray(acc.shape, acc.dtype)


accumulate_p = jex_core.Primitive("fp8jax_fp8_dot_accumulate")
accumulate_p.def_impl(_accumulate_reference)
accumulate_p.def_abstract_eval(_accumulate_abstract)
mlir.register_lowering(accumulate_p, mlir.lower_fun(_accumulate_reference, multiple_results=False))


def accumulate(acc: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """``acc + a . b^T`` in f32 for FP8 ``a [m, k]`` and ``b [n, k]`` of one type.

    In a Pallas Triton kernel this is one FP8 ``wgmma`` chain that accumulates
    into ``acc`` on the tensor cores; elsewhere (interpret mode, XLA) the same
    sum. Where :func:`install` cannot reach Pallas's lowering rules it is
    ``acc + dot`` (f16 tensor cores, with the warning :func:`install` gives).
    """
    if not install():
        return _accumulate_reference(acc, a, b)
    return accumulate_p.bind(acc, a, b)


@functools.cache
def install() -> bool:
    """Adds fp8jax's rules to Pallas Triton's lowering once; False (with a warning) if it cannot."""
    try:
        from jax._src.lib.mlir import ir
        from jax._src.lib.triton import dialect as tt_dialect
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

    def lower_accumulate(ctx, acc, a, b):
        # Triton's dot reads b as [k, n]: the transpose is a layout change in
        # shared memory, not a pass over the data.
        b_kn = tt_dialect.trans(b, (1, 0))
        return tt_dialect.dot(a, b_kn, acc, max_num_imprecise_acc=MAX_NUM_IMPRECISE_ACC)

    rules[lax.dot_general_p] = lower_dot
    rules[accumulate_p] = lower_accumulate
    return True


def _cannot(why: str) -> bool:
    warnings.warn(
        f"fp8jax: {why}, so the Pallas GEMM kernels' FP8 dots run on f16 tensor cores "
        "(fp8jax.kernels.triton_fp8_dot).",
        RuntimeWarning,
        stacklevel=3,
    )
    return False

"""FP8 residuals that survive ``jax.checkpoint``: saved as their bytes.

A checkpoint policy that saves a floating residual makes JAX round it with
``reduce_precision(x, *finfo(dtype))``, which follows IEEE semantics: for
``float8_e4m3fn``, which has no infinities and reaches 448, every value above
240 becomes Inf or NaN (docs/design.md#activation-checkpointing). Integers
are left alone, so the ops' ``custom_vjp`` residuals hold each FP8 array as
``uint8`` bits of the same width (a free bitcast) and turn them back in the
backward.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8jax.formats import is_fp8


@functools.partial(jax.tree_util.register_dataclass, data_fields=["bits"], meta_fields=["dtype"])
@dataclasses.dataclass(frozen=True)
class Fp8Bits:
    """An FP8 array as ``uint8`` bits, and the FP8 dtype they came from."""

    bits: jax.Array
    dtype: np.dtype


@jax.custom_jvp
def _differentiated_once(x):
    """``x``, refusing to be differentiated: see :func:`_refuse_second_order`."""
    return x


@_differentiated_once.defjvp
def _refuse_second_order(primals, tangents):
    # Reached only where the forward itself is differentiated (jax.grad of a
    # gradient): a plain jax.grad runs the forward without tangents, and JAX
    # skips this rule where every tangent is zero. The bits below carry no
    # tangent, so the terms through the FP8 residuals would be dropped and
    # the second derivative silently wrong (off by 80-90% in a small dense).
    del primals, tangents
    raise TypeError(
        "fp8jax's FP8 ops are differentiable once: a gradient of their gradient (jax.grad "
        "of jax.grad, jax.hessian, jax.jacfwd of jax.grad) would miss the terms through "
        "their FP8 residuals. Differentiate the FP8 op once, or use its high-precision "
        "equivalent (jnp.dot, jnp.einsum) for higher derivatives."
    )


def _to_bits(leaf):
    if getattr(leaf, "dtype", None) is not None and is_fp8(leaf.dtype):
        leaf = _differentiated_once(leaf)
        return Fp8Bits(lax.bitcast_convert_type(leaf, jnp.uint8), jnp.dtype(leaf.dtype))
    return leaf


def _from_bits(leaf):
    if isinstance(leaf, Fp8Bits):
        return lax.bitcast_convert_type(leaf.bits, leaf.dtype)
    return leaf


def as_bits(residuals):
    """``residuals`` with every FP8 array as :class:`Fp8Bits`."""
    return jax.tree.map(_to_bits, residuals)


def from_bits(residuals):
    """The inverse of :func:`as_bits`."""
    return jax.tree.map(_from_bits, residuals, is_leaf=lambda leaf: isinstance(leaf, Fp8Bits))


def saved_as_bits(fwd, bwd):
    """``(fwd, bwd)`` for ``custom_vjp.defvjp`` whose FP8 residuals travel as bits.

    ``bwd``'s residuals are its second-to-last argument (after any
    ``nondiff_argnums``), as ``custom_vjp`` passes them.
    """

    @functools.wraps(fwd)
    def fwd_bits(*args):
        out, residuals = fwd(*args)
        return out, as_bits(residuals)

    @functools.wraps(bwd)
    def bwd_bits(*args):
        *static, residuals, cotangent = args
        return bwd(*static, from_bits(residuals), cotangent)

    return fwd_bits, bwd_bits

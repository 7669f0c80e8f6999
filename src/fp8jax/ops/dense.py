"""FP8 dense layer: ``x . kernel + bias``, an FP8 dot_general with a bias.

The bias is an input of the dot's custom_vjp: its gradient comes out of the
pass that quantizes the output gradient
(docs/design.md#the-bias-gradient-in-the-gradients-quantize-pass).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from fp8jax.ops import dimensions
from fp8jax.ops.dot_general import dot_with_bias
from fp8jax.ops.gemm import check_bias
from fp8jax.ops.split import make_split
from fp8jax.quantize import check_high_precision
from fp8jax.recipes import Recipe
from fp8jax.scaling import DotScaleState


def dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    contracting_dims=((-1,), (0,)),
    *,
    recipe: Recipe | None = None,
    state: DotScaleState | None = None,
    split: Sequence[int] | None = None,
    split_axis: int = -2,
    preferred_element_type=None,
) -> jax.Array:
    """FP8 dense layer: ``x . kernel + bias`` with FP8 GEMMs forward and backward.

    Args:
      x: activations, any rank, float32/bfloat16/float16.
      kernel: weights; the contracted axes come first by default.
      bias: optional, shaped like the kernel's non-contracted axes.
      contracting_dims: ``(x_axes, kernel_axes)`` to contract.
      recipe: CurrentScaling (default) or DelayedScaling.
      state: DelayedScaling state from ``fp8jax.init_state(recipe)``.
      split, split_axis: return the output as a tuple of pieces of these
        sizes along that feature axis, as ``fp8jax.layernorm_dense`` does (a
        fused QKV projection: the backward casts the pieces' gradients
        without writing their sum; :mod:`fp8jax.ops.split`).
      preferred_element_type: output dtype; defaults to what
        ``lax.dot_general(x, kernel)`` returns, the wider of the two dtypes
        (float16 x float32 is float32). Pass ``x.dtype`` to compute in the
        activations' dtype from float32 parameters, as the Flax modules do.

    Returns:
      ``x``'s batch axes followed by the kernel's free axes (a tuple of
      pieces with ``split``).

    Example:
      >>> import jax, jax.numpy as jnp, fp8jax
      >>> x = jax.random.normal(jax.random.key(0), (2, 8, 64), jnp.bfloat16)
      >>> w = jax.random.normal(jax.random.key(1), (64, 32), jnp.float32) * 0.1
      >>> fp8jax.dense(x, w, jnp.zeros((32,))).dtype
      dtype('float32')
      >>> fp8jax.dense(x, w, jnp.zeros((32,)), preferred_element_type=x.dtype).dtype
      dtype(bfloat16)
    """
    check_high_precision("x", x)
    check_high_precision("kernel", kernel)
    dims = dimensions.normalize((contracting_dims, ((), ())), x.shape, kernel.shape)
    free = [d for i, d in enumerate(kernel.shape) if i not in dims[0][1]]
    check_bias(bias, tuple(free))
    batch = [d for i, d in enumerate(x.shape) if i not in dims[0][0]]
    pieces = make_split(split, split_axis, (*batch, *free), len(free))
    return dot_with_bias(x, kernel, bias, dims, recipe, state, preferred_element_type, pieces)

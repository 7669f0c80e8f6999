"""``layernorm_dense`` and ``layernorm_mlp`` under RowwiseScaling and BlockScaling: composed.

The norm runs in XLA (f32, differentiated by JAX) and feeds the
fine-grained GEMMs of :mod:`fp8jax.ops.fine_grained`; the activation of the
MLP runs between them the same way. These are not fused into one
custom_vjp as the per-tensor recipes' ops are (docs/design.md#fine-grained-scaling):
the normalized input and the activation reach HBM in high precision once
each before their FP8 casts, and the norm's backward is JAX's.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from fp8jax import activations as activations_
from fp8jax.ops import fine_grained
from fp8jax.ops.norm import NormConfig, normalize


def _contract_last(ndim: int):
    return (((ndim - 1,), (0,)), ((), ()))


def layernorm_dense(x, gamma, beta, kernel, bias, norm: NormConfig, recipe, *, split=None,
                    return_normalized=False, return_residual=False):  # fmt: skip
    """:func:`fp8jax.layernorm_dense` (checked arguments) as a norm, then a fine-grained dense."""
    normed = normalize(x, gamma, beta, norm)[0]
    y = fine_grained.dot(normed, kernel, bias, _contract_last(x.ndim), recipe, x.dtype, split)
    if return_normalized:
        return y, normed.astype(x.dtype)
    return (y, x) if return_residual else y


def layernorm_mlp(x, gamma, beta, kernel_1, kernel_2, bias_1, bias_2, norm: NormConfig, recipe,
                  activations, *, return_residual=False):  # fmt: skip
    """:func:`fp8jax.layernorm_mlp` (checked arguments): norm, dense, activation, dense."""
    normed = normalize(x, gamma, beta, norm)[0]
    pre = fine_grained.dot(normed, kernel_1, bias_1, _contract_last(x.ndim), recipe, x.dtype)
    pre32 = pre.astype(jnp.float32)  # (..., len(activations), ffn)
    h = activations_.REGISTRY[activations[0]].xla(lax.index_in_dim(pre32, 0, -2, False))
    for i, name in enumerate(activations[1:], start=1):
        h = h * activations_.REGISTRY[name].xla(lax.index_in_dim(pre32, i, -2, False))
    y = fine_grained.dot(h.astype(x.dtype), kernel_2, bias_2, _contract_last(x.ndim), recipe,
                         x.dtype)  # fmt: skip
    return (y, x) if return_residual else y

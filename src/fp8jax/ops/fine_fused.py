"""``layernorm_dense`` and ``layernorm_mlp`` under RowwiseScaling and BlockScaling: composed.

The norm (:func:`fp8jax.ops.norm.norm`) and the activation run in XLA and
feed the fine-grained GEMMs of :mod:`fp8jax.ops.fine_grained`: not fused
into one custom_vjp as the per-tensor recipes' ops are
(docs/design.md#fine-grained-scaling). Both compute in f32 and hand on
``x.dtype``, and their backwards keep only ``x.dtype`` tensors: the norm's
input and row statistics, the activation's input. Written as plain f32
autodiff, the TE-config layer's MLP kept its f32 pre-activation for the
backward and wrote its gradient in f32, and the f32 normalized input made
the input-gradient GEMM write f32 (docs/design.md#the-fine-grained-fused-ops).
"""

from __future__ import annotations

import jax

from fp8jax.activations import gated
from fp8jax.ops import fine_grained
from fp8jax.ops.norm import NormConfig, norm


def _contract_last(ndim: int):
    return (((ndim - 1,), (0,)), ((), ()))


def layernorm_dense(x, gamma, beta, kernel, bias, norm_config: NormConfig, recipe, *, split=None,
                    return_normalized=False, return_residual=False):  # fmt: skip
    """:func:`fp8jax.layernorm_dense` (checked arguments) as a norm, then a fine-grained dense."""
    normed = norm(x, gamma, beta, norm_config)
    y = fine_grained.dot(normed, kernel, bias, _contract_last(x.ndim), recipe, x.dtype, split)
    if return_normalized:
        return y, normed
    return (y, x) if return_residual else y


def _activation(pre, activations):
    """:func:`gated` of ``pre`` (..., len(activations), ffn), in ``pre.dtype``."""
    return gated(pre, activations).astype(pre.dtype)


def layernorm_mlp(x, gamma, beta, kernel_1, kernel_2, bias_1, bias_2, norm_config: NormConfig,
                  recipe, activations, *, return_residual=False):  # fmt: skip
    """:func:`fp8jax.layernorm_mlp` (checked arguments): norm, dense, activation, dense."""
    normed = norm(x, gamma, beta, norm_config)
    pre = fine_grained.dot(normed, kernel_1, bias_1, _contract_last(x.ndim), recipe, x.dtype)
    # Recomputed in the backward from pre, so that only pre is kept.
    h = jax.checkpoint(_activation, static_argnums=(1,))(pre, tuple(activations))
    y = fine_grained.dot(h, kernel_2, bias_2, _contract_last(x.ndim), recipe, x.dtype)
    return (y, x) if return_residual else y

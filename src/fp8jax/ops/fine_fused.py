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
from fp8jax.ops import dimensions, fine_grained
from fp8jax.ops.norm import NormConfig, norm


def layernorm_dense(x, gamma, beta, kernel, bias, norm_config: NormConfig, recipe, *, split=None,
                    return_normalized=False, return_residual=False):  # fmt: skip
    """:func:`fp8jax.layernorm_dense` (checked arguments) as a norm, then a fine-grained dense."""
    normed = norm(x, gamma, beta, norm_config)
    dims = dimensions.contract_last(x.ndim)
    y = fine_grained.dot(normed, kernel, bias, dims, recipe, x.dtype, split)
    if return_normalized:
        return y, normed
    return (y, x) if return_residual else y


def layernorm_mlp(x, gamma, beta, kernel_1, kernel_2, bias_1, bias_2, norm_config: NormConfig,
                  recipe, activations, *, return_residual=False):  # fmt: skip
    """:func:`fp8jax.layernorm_mlp` (checked arguments): norm, dense, activation, dense."""
    normed = norm(x, gamma, beta, norm_config)
    dims = dimensions.contract_last(x.ndim)
    pre = fine_grained.dot(normed, kernel_1, bias_1, dims, recipe, x.dtype)
    # Recomputed in the backward from pre, so that only pre is kept.
    h = jax.checkpoint(gated, static_argnums=(1, 2, 3))(pre, tuple(activations), -2, pre.dtype)
    y = fine_grained.dot(h, kernel_2, bias_2, dims, recipe, x.dtype)
    return (y, x) if return_residual else y

"""An MoE block's routed experts on one device's tokens: routing, the permutations, the GEMMs.

Shared by the one-device block (:func:`fp8jax.flax._moe.moe`) and the
expert-parallel one (:mod:`fp8jax.flax._expert_parallel`), which runs the
experts on the rows each device receives.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import fp8jax
from fp8jax import activations as activations_
from fp8jax.ops import ragged_dot as ragged_dot_ops

# The gate's activation, by the names LayerNormMLP takes (fp8jax.activations),
# so that "gelu" is the same function in a dense and an MoE feed-forward.
ACTIVATIONS = {name: a.xla for name, a in activations_.REGISTRY.items() if name != "linear"}


def route(x2: jax.Array, router: jax.Array, top_k: int, gating: str, axes: tuple[str, ...] = ()):
    """``(gates [t, k], experts [t, k], aux_loss)`` for tokens ``x2 [t, hidden]``, in f32.

    ``axes``: inside ``shard_map``, the mesh axes splitting the tokens (each
    device holding as many); the loss then counts all of them.
    """
    logits = jnp.dot(x2.astype(jnp.float32), router.astype(jnp.float32))
    num_experts = router.shape[-1]
    if gating == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    gates, experts = lax.top_k(probs, top_k)
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    counts = jnp.zeros((num_experts,), jnp.float32).at[experts.reshape(-1)].add(1.0)
    # No tokens, no imbalance: max(., 1) makes the loss 0 there, not 0 / 0.
    mean_probs = jnp.sum(probs, axis=0) / max(probs.shape[0], 1)
    if axes:  # expert parallelism: the statistics of every device's tokens
        counts, mean_probs = lax.pmean(counts, axes), lax.pmean(mean_probs, axes)
    fraction = counts / max(experts.size, 1)
    aux_loss = num_experts * jnp.sum(fraction * mean_probs)
    return gates, experts, aux_loss


def _gemm(fp8: bool, recipe):
    if fp8:
        return lambda a, b, sizes: fp8jax.ragged_dot(a, b, sizes, recipe=recipe)
    return lambda a, b, sizes: lax.ragged_dot(a, b.astype(a.dtype), sizes)


def gated(h: jax.Array, activation: str, dtype) -> jax.Array:
    """``act(gate) * up`` of ``h [rows, 2, ffn]`` (gate, then up), computed in f32."""
    return activations_.gated(h, (activation, "linear"), axis=1).astype(dtype)


def experts_ffn(xs, sizes, wi, wo, activation: str, fp8: bool, recipe):
    """Gated experts on rows sorted by expert: ``act(xs . wi_gate) * (xs . wi_up) . wo``.

    ``wi [e, hidden, 2, ffn]`` (gate, then up), ``wo [e, ffn, hidden]``.
    """
    gemm = _gemm(fp8, recipe)
    e, hidden, _, ffn = wi.shape
    h = gemm(xs, wi.reshape(e, hidden, 2 * ffn), sizes).reshape(-1, 2, ffn)
    return gemm(gated(h, activation, xs.dtype), wo, sizes)


def routed_experts(x2, order, top_k: int, sizes, wi, wo, activation: str, fp8: bool, recipe):
    """The gated experts' outputs for every (token, slot) pair, in slot order: ``[t * top_k, h]``.

    ``order`` sorts the slots by expert (``sizes`` per expert). In FP8 the
    grouped GEMMs read the tokens' rows and write the slots' rows by index
    (:func:`fp8jax.ops.ragged_dot.permuted_ragged_dot`): the tokens are
    quantized before they are repeated and no permuted copy is written
    (docs/design.md#grouped-expert-gemms). Otherwise the rows are gathered
    into expert order and back (:func:`dispatch`, :func:`combine`).
    """
    e, hidden, _, ffn = wi.shape
    if not fp8:
        inverse = ragged_dot_ops.inverse_permutation(order)
        xs = dispatch(x2, order, inverse, top_k)
        return combine(experts_ffn(xs, sizes, wi, wo, activation, fp8, recipe), order, inverse)
    gemm = functools.partial(ragged_dot_ops.permuted_ragged_dot, recipe=recipe)
    h = gemm(x2, wi.reshape(e, hidden, 2 * ffn), sizes, lhs_slots=order, repeats=top_k)
    return gemm(gated(h.reshape(-1, 2, ffn), activation, x2.dtype), wo, sizes, out_slots=order)


# The permutations to expert order and back, with the backward passes written as
# gathers: JAX transposes a gather into a scatter-add (atomic adds into a zeroed
# buffer, in the array's dtype), though each row here has a known set of sources.


def _no_cotangent(index: jax.Array) -> np.ndarray:
    return np.zeros(index.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def dispatch(x2, order, inverse, top_k: int):
    """``x2 [t, hidden]``'s rows for the slots in expert order: ``x2[order // top_k]``.

    ``order`` sorts the ``t * top_k`` (token, slot) pairs by expert and
    ``inverse`` is its inverse permutation. A token's gradient is the sum of
    its ``top_k`` slots' gradients (in f32), gathered by ``inverse``.
    """
    return jnp.take(x2, order // top_k, axis=0)


def _dispatch_fwd(x2, order, inverse, top_k):
    return dispatch(x2, order, inverse, top_k), (order, inverse)


def _dispatch_bwd(top_k, residuals, g):
    order, inverse = residuals
    per_slot = jnp.take(g, inverse, axis=0).astype(jnp.float32)
    dx2 = jnp.sum(per_slot.reshape(-1, top_k, g.shape[-1]), axis=1).astype(g.dtype)
    return dx2, _no_cotangent(order), _no_cotangent(inverse)


dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def combine(ys, order, inverse):
    """The expert-ordered rows ``ys`` back in (token, slot) order: ``ys[inverse]``.

    A permutation, so its gradient is the gather by ``order``.
    """
    return jnp.take(ys, inverse, axis=0)


def _combine_fwd(ys, order, inverse):
    return combine(ys, order, inverse), (order, inverse)


def _combine_bwd(residuals, g):
    order, inverse = residuals
    return jnp.take(g, order, axis=0), _no_cotangent(order), _no_cotangent(inverse)


combine.defvjp(_combine_fwd, _combine_bwd)

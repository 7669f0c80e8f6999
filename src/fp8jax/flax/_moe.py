"""The Mixture-of-Experts block's math, shared by the Linen and NNX modules.

Router (high precision) -> top-k -> tokens sorted by expert (argsort) ->
gated experts on :func:`fp8jax.ragged_dot` (FP8 GEMMs, one scale per
expert) -> back to token order, weighted by the gates -> plus optional
shared experts (an FP8 gated MLP on :func:`fp8jax.dense`).

No token is dropped: every token reaches its ``top_k`` experts whatever the
load, because the grouped GEMMs take any group sizes (no capacity, no
padding to one). The auxiliary load-balancing loss is Switch Transformer's:
``num_experts * sum_e f_e * p_e``, ``f_e`` the fraction of routed slots that
go to expert ``e`` and ``p_e`` its mean gate probability; 1 when balanced.

Expert parallelism (experts split over a mesh axis, tokens exchanged with
``ragged_all_to_all``) is :mod:`fp8jax.flax._expert_parallel`; :func:`moe`
takes it where the mesh in context asks for it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import fp8jax
from fp8jax import activations as activations_
from fp8jax.flax import _common
from fp8jax.ops import ragged_dot as ragged_dot_ops

GATINGS = ("softmax", "sigmoid")
# The gate's activation, by the names LayerNormMLP takes (fp8jax.activations),
# so that "gelu" is the same function in a dense and an MoE feed-forward.
ACTIVATIONS = {name: a.xla for name, a in activations_.REGISTRY.items() if name != "linear"}
EXPERT = "expert"  # the logical axis name of the experts


def check(owner: str, num_experts, top_k, ffn, gating, activation, shared_experts) -> None:
    """Raises for bad MoE settings, naming the argument, the expected and the given."""
    _common.positive_int(owner, "num_experts", num_experts)
    _common.positive_int(owner, "top_k", top_k)
    _common.positive_int(owner, "ffn", ffn)
    if top_k > num_experts:
        raise ValueError(f"{owner}.top_k must be <= num_experts={num_experts}, got {top_k}.")
    if gating not in GATINGS:
        raise ValueError(f"{owner}.gating must be one of {GATINGS}, got {gating!r}.")
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"{owner}.activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}."
        )
    if not isinstance(shared_experts, int) or shared_experts < 0:
        raise ValueError(f"{owner}.shared_experts must be an int >= 0, got {shared_experts!r}.")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A TransformerLayer's feed-forward as a Mixture of Experts: ``moe=MoEConfig(8, 2)``.

    The layer then runs a norm and an ``MoEBlock`` where it runs LayerNormMLP
    otherwise: each expert ``intermediate_dim`` wide, gated by the layer's
    ``activations`` (``(act, "linear")``), in the layer's dtypes and recipe.

    Attributes:
      num_experts, top_k, gating, shared_experts: as in ``MoEBlock``.
      fp8: the experts' GEMMs in FP8; False runs them with ``lax.ragged_dot``
        in the compute dtype (a baseline), the attention staying FP8.
    """

    num_experts: int
    top_k: int
    _: dataclasses.KW_ONLY
    gating: str = "softmax"
    shared_experts: int = 0
    fp8: bool = True


def block_settings(owner: str, moe, intermediate_dim: int, activations, recipe) -> dict:
    """The ``MoEBlock`` arguments a layer's ``moe=`` stands for; raises for what cannot run.

    ``owner`` is the layer; its ``intermediate_dim`` and ``activations`` are checked already.
    """
    if not isinstance(moe, MoEConfig):
        raise ValueError(f"{owner}: moe must be None or an MoEConfig, got {moe!r}.")
    acts = tuple(activations)
    if len(acts) != 2 or acts[1] != "linear" or acts[0] not in ACTIVATIONS:
        gated = tuple((name, "linear") for name in ACTIVATIONS)
        raise ValueError(
            f"{owner}: activations must be one of {gated} with moe= (each expert is a gated "
            f"MLP), got {activations!r}."
        )
    check(f"{owner}.moe", moe.num_experts, moe.top_k, intermediate_dim, moe.gating, acts[0],
          moe.shared_experts)  # fmt: skip
    if moe.fp8 and _common.is_delayed(recipe):
        raise ValueError(
            f"{owner}: moe= runs the experts on fp8jax.ragged_dot, which takes CurrentScaling "
            f"only, got recipe={recipe!r}; pass another recipe, or MoEConfig(..., fp8=False)."
        )
    return {**dataclasses.asdict(moe), "ffn": intermediate_dim, "activation": acts[0]}


def expert_init(init):
    """``init`` applied to each expert's ``shape[1:]`` matrix (its own fan-in)."""

    def wrapped(key, shape, dtype=jnp.float32):
        keys = jax.random.split(key, shape[0])
        return jax.vmap(lambda k: init(k, shape[1:], dtype))(keys)

    return wrapped


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
    mean_probs = jnp.mean(probs, axis=0)
    if axes:  # expert parallelism: the statistics of every device's tokens
        counts, mean_probs = lax.pmean(counts, axes), lax.pmean(mean_probs, axes)
    fraction = counts / experts.size
    aux_loss = num_experts * jnp.sum(fraction * mean_probs)
    return gates, experts, aux_loss


def _gemm(fp8: bool, recipe):
    if fp8:
        return lambda a, b, sizes: fp8jax.ragged_dot(a, b, sizes, recipe=recipe)
    return lambda a, b, sizes: lax.ragged_dot(a, b.astype(a.dtype), sizes)


def _gated(h: jax.Array, activation: str, dtype) -> jax.Array:
    """``act(gate) * up`` of ``h [rows, 2 * ffn]`` (gate, then up), computed in f32."""
    h = h.reshape(h.shape[0], 2, -1)
    return (ACTIVATIONS[activation](h[:, 0].astype(jnp.float32)) * h[:, 1].astype(jnp.float32)
            ).astype(dtype)  # fmt: skip


def experts_ffn(xs, sizes, wi, wo, activation: str, fp8: bool, recipe):
    """Gated experts on rows sorted by expert: ``act(xs . wi_gate) * (xs . wi_up) . wo``.

    ``wi [e, hidden, 2, ffn]`` (gate, then up), ``wo [e, ffn, hidden]``.
    """
    gemm = _gemm(fp8, recipe)
    e, hidden, _, ffn = wi.shape
    h = gemm(xs, wi.reshape(e, hidden, 2 * ffn), sizes)
    return gemm(_gated(h, activation, xs.dtype), wo, sizes)


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
        inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
        xs = dispatch(x2, order, inverse, top_k)
        return combine(experts_ffn(xs, sizes, wi, wo, activation, fp8, recipe), order, inverse)
    gemm = functools.partial(ragged_dot_ops.permuted_ragged_dot, recipe=recipe)
    h = gemm(x2, wi.reshape(e, hidden, 2 * ffn), sizes, lhs_slots=order, repeats=top_k)
    return gemm(_gated(h, activation, x2.dtype), wo, sizes, out_slots=order)


def shared_ffn(x2, wi, wo, activation: str, fp8: bool, recipe):
    """The shared experts as one gated MLP: ``wi [hidden, 2, width]``, ``wo [width, hidden]``."""
    if fp8:
        h = fp8jax.dense(x2, wi, contracting_dims=((1,), (0,)), recipe=recipe)
    else:
        h = jnp.einsum("th,hcf->tcf", x2, wi.astype(x2.dtype))
    a = _gated(h, activation, x2.dtype)
    return fp8jax.dense(a, wo, recipe=recipe) if fp8 else a @ wo.astype(a.dtype)


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


def moe(x, router, wi, wo, shared_wi, shared_wo, *, top_k: int, gating: str, activation: str,
        fp8: bool, recipe):  # fmt: skip
    """The block on ``x [..., hidden]``: ``(y, aux_loss)``, ``y`` shaped and typed like ``x``.

    Expert-parallel (:mod:`fp8jax.flax._expert_parallel`) where the mesh and
    rules in context split the experts over a mesh axis.
    """
    from fp8jax.flax import _expert_parallel

    shape, hidden = x.shape, x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if (where := _expert_parallel.layout()) is not None:
        y, aux_loss = _expert_parallel.routed(
            x2, router, wi, wo, where, top_k=top_k, gating=gating, activation=activation,
            fp8=fp8, recipe=recipe,
        )  # fmt: skip
        if shared_wi is not None:
            y = y + shared_ffn(x2, shared_wi, shared_wo, activation, fp8, recipe).astype(x.dtype)
        return y.reshape(shape), aux_loss
    gates, experts, aux_loss = route(x2, router, top_k, gating)
    flat = experts.reshape(-1)
    # Sort the (token, slot) pairs by expert; stable, so each expert's tokens
    # keep their order.
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros((router.shape[-1],), jnp.int32).at[flat].add(1)
    ys = routed_experts(x2, order, top_k, sizes, wi, wo, activation, fp8, recipe)
    per_slot = ys.reshape(-1, top_k, hidden)
    y = jnp.einsum("tkh,tk->th", per_slot.astype(jnp.float32), gates).astype(x.dtype)
    if shared_wi is not None:
        y = y + shared_ffn(x2, shared_wi, shared_wo, activation, fp8, recipe).astype(x.dtype)
    return y.reshape(shape), aux_loss

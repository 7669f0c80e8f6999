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

The routed experts on one device's tokens (routing, the permutations, the
grouped GEMMs) are :mod:`fp8jax.flax._routed_experts`. Expert parallelism
(experts split over a mesh axis, tokens exchanged with ``ragged_all_to_all``)
is :mod:`fp8jax.flax._expert_parallel`; :func:`moe` takes it where the mesh
in context asks for it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import fp8jax
from fp8jax.flax import _common, _expert_parallel
from fp8jax.flax._routed_experts import ACTIVATIONS, gated, route, routed_experts
from fp8jax.ops import ragged_dot as ragged_dot_ops

GATINGS = ("softmax", "sigmoid")
EXPERT = "expert"  # the logical axis name of the experts


def check(owner: str, num_experts, top_k, ffn, gating, activation, shared_experts, fp8=False,
          recipe=None) -> None:  # fmt: skip
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
    if fp8:
        ragged_dot_ops.check_recipe(owner, recipe)


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
          moe.shared_experts, moe.fp8, recipe)  # fmt: skip
    return {**dataclasses.asdict(moe), "ffn": intermediate_dim, "activation": acts[0]}


def expert_init(init):
    """``init`` applied to each expert's ``shape[1:]`` matrix (its own fan-in)."""

    def wrapped(key, shape, dtype=jnp.float32):
        keys = jax.random.split(key, shape[0])
        return jax.vmap(lambda k: init(k, shape[1:], dtype))(keys)

    return wrapped


def shared_ffn(x2, wi, wo, activation: str, fp8: bool, recipe):
    """The shared experts as one gated MLP: ``wi [hidden, 2, width]``, ``wo [width, hidden]``."""
    if fp8:
        h = fp8jax.dense(x2, wi, contracting_dims=((1,), (0,)), recipe=recipe)
    else:
        h = jnp.einsum("th,hcf->tcf", x2, wi.astype(x2.dtype))
    a = gated(h.reshape(-1, 2, wi.shape[-1]), activation, x2.dtype)
    return fp8jax.dense(a, wo, recipe=recipe) if fp8 else a @ wo.astype(a.dtype)


def moe(x, router, wi, wo, shared_wi, shared_wo, *, top_k: int, gating: str, activation: str,
        fp8: bool, recipe):  # fmt: skip
    """The block on ``x [..., hidden]``: ``(y, aux_loss)``, ``y`` shaped and typed like ``x``.

    Expert-parallel (:mod:`fp8jax.flax._expert_parallel`) where the mesh and
    rules in context split the experts over a mesh axis.
    """
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

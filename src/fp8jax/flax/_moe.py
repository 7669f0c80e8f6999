"""The MoE block, shared by the Linen and NNX modules: settings, sharding, shared experts.

The routed experts are the plain-JAX op :func:`fp8jax.moe_mlp`
(:mod:`fp8jax.ops.moe`: router logits -> top-k -> sorted by expert -> gated
experts on FP8 grouped GEMMs -> combined; dropless, with Switch
Transformer's load-balancing loss). The shared experts are one FP8 gated MLP
on :func:`fp8jax.dense`. Under a mesh, :func:`moe` picks the layout:
expert parallelism (experts split over a mesh axis, tokens exchanged with
``ragged_all_to_all``) or local routing (data parallelism and FSDP: each
device routes its own tokens), both :mod:`fp8jax.flax._expert_parallel`.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np

import fp8jax
from fp8jax.flax import _common, _expert_parallel
from fp8jax.ops import moe as moe_ops
from fp8jax.ops import ragged_dot as ragged_dot_ops

GATINGS = moe_ops.GATINGS
ACTIVATIONS = moe_ops.ACTIVATIONS
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
    # NumPy ints too, as for the other counts (_common.positive_int).
    if (
        isinstance(shared_experts, bool)
        or not isinstance(shared_experts, numbers.Integral)
        or shared_experts < 0
    ):
        raise ValueError(f"{owner}.shared_experts must be an int >= 0, got {shared_experts!r}.")
    if not isinstance(fp8, bool | np.bool_):  # a config's "false" would run FP8
        raise TypeError(f"{owner}.fp8 must be a bool, got {fp8!r}.")
    if fp8:
        ragged_dot_ops.check_recipe(owner, recipe)


def check_capacity(owner: str, capacity_factor) -> None:
    """Raises unless ``capacity_factor`` is None or a finite number > 0."""
    moe_ops.check_capacity_factor(owner, capacity_factor)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A TransformerLayer's feed-forward as a Mixture of Experts: ``moe=MoEConfig(8, 2)``.

    The layer then runs a norm and an ``MoEBlock`` where it runs LayerNormMLP
    otherwise: each expert ``intermediate_dim`` wide, gated by the layer's
    ``activations`` (``(act, "linear")``), in the layer's dtypes and recipe.

    Attributes:
      num_experts, top_k, gating, shared_experts, capacity_factor: as in ``MoEBlock``.
      fp8: the experts' GEMMs in FP8; False runs them with
        ``fp8jax.kernels.bf16_grouped.ragged_dot`` in the compute dtype (a
        baseline), the attention staying FP8.
    """

    num_experts: int
    top_k: int
    _: dataclasses.KW_ONLY
    gating: str = "softmax"
    shared_experts: int = 0
    fp8: bool = True
    capacity_factor: float | None = None


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
    check_capacity(f"{owner}.moe", moe.capacity_factor)
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
    a = moe_ops.gated(h.reshape(-1, 2, wi.shape[-1]), activation, x2.dtype)
    return fp8jax.dense(a, wo, recipe=recipe) if fp8 else a @ wo.astype(a.dtype)


def moe(x, router, wi, wo, shared_wi, shared_wo, *, top_k: int, gating: str, activation: str,
        fp8: bool, recipe, capacity_factor: float | None = None):  # fmt: skip
    """The block on ``x [..., hidden]``: ``(y, stats)``, ``y`` shaped and typed like ``x``.

    ``stats``: :class:`fp8jax.ops.moe.MoEStats`. Expert-parallel
    (:mod:`fp8jax.flax._expert_parallel`) where the mesh and rules in context
    split the experts over a mesh axis; with every device routing its own
    tokens where they split only the tokens (data parallelism, FSDP).
    """
    # The settings take NumPy ints (_common.positive_int); every path below a static int.
    top_k = int(top_k)
    shape, hidden = x.shape, x.shape[-1]
    x2 = x.reshape(-1, hidden)
    settings = dict(top_k=top_k, gating=gating, activation=activation, fp8=fp8, recipe=recipe,
                    capacity_factor=capacity_factor)  # fmt: skip
    if (where := _expert_parallel.layout()) is not None:
        y, stats = _expert_parallel.routed(x2, router, wi, wo, where, **settings)
    elif (here := _expert_parallel.local_layout(x2, wi)) is not None:
        y, stats = _expert_parallel.local(x2, router, wi, wo, here, **settings)
    else:
        logits = jnp.dot(x2.astype(jnp.float32), router.astype(jnp.float32))
        y, stats = moe_ops.moe_mlp(x2, logits, wi, wo, **settings)
    if shared_wi is not None:
        y = y + shared_ffn(x2, shared_wi, shared_wo, activation, fp8, recipe).astype(x.dtype)
    return y.reshape(shape), stats

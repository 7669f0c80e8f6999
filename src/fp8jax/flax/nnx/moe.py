"""NNX MoEBlock: a Mixture-of-Experts feed-forward block on FP8 grouped GEMMs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from fp8jax.flax import _common, _moe
from fp8jax.flax._common import ACT, EMBED, MLP
from fp8jax.flax.nnx._base import param, value_of
from fp8jax.flax.nnx.dense import default_kernel_init
from fp8jax.recipes import Recipe


class AuxLoss(nnx.Variable):
    """The last call's auxiliary load-balancing loss (not a parameter)."""


class ExpertLoad(nnx.Variable):
    """The last call's share of the routed slots per expert, or dropped (not a parameter)."""


class MoEBlock(nnx.Module):
    """Router, top-k, experts on ``fp8jax.ragged_dot``, shared experts; the NNX twin of Linen's.

    Dropless unless a capacity_factor is given. The call returns the output;
    the auxiliary load-balancing loss of the call is in ``self.aux_loss``
    (an :class:`AuxLoss` variable; 1 when balanced), each expert's share of
    the routed slots in ``self.expert_load`` and the share dropped by a
    capacity in ``self.dropped`` (both :class:`ExpertLoad`). Expert parallelism
    (``ShardingConfig(ep=...)``) as in the Linen block.

    Args:
      in_features: the hidden size.
      num_experts, top_k, ffn, gating, activation, shared_experts, fp8, capacity_factor:
        as in :class:`fp8jax.flax.linen.MoEBlock`.
      dtype, param_dtype, kernel_init, recipe, rngs: as in DenseGeneral.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from fp8jax.flax import nnx as fnnx
      >>> block = fnnx.MoEBlock(32, num_experts=4, top_k=2, ffn=64, rngs=nnx.Rngs(0))
      >>> block(jnp.ones((2, 8, 32))).shape
      (2, 8, 32)
    """

    def __init__(
        self,
        in_features: int,
        *,
        num_experts: int,
        top_k: int,
        ffn: int,
        gating: str = "softmax",
        activation: str = "silu",
        shared_experts: int = 0,
        fp8: bool = True,
        capacity_factor: float | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init=default_kernel_init,
        recipe: Recipe | None = None,
        rngs: nnx.Rngs,
    ):
        owner = type(self).__name__
        hidden = _common.positive_int(owner, "in_features", in_features)
        _moe.check(owner, num_experts, top_k, ffn, gating, activation, shared_experts, fp8, recipe)
        _moe.check_capacity(owner, capacity_factor)
        e, pd = num_experts, param_dtype
        init = _common.fan_in_init(kernel_init, 1)
        per_expert = _moe.expert_init(init)
        self.router = param(init, rngs, (hidden, e), pd, (EMBED, None))
        self.wi = param(per_expert, rngs, (e, hidden, 2, ffn), pd, (_moe.EXPERT, EMBED, ACT, MLP))
        self.wo = param(per_expert, rngs, (e, ffn, hidden), pd, (_moe.EXPERT, MLP, EMBED))
        width = shared_experts * ffn
        self.shared_wi = param(init, rngs, (hidden, 2, width), pd, (EMBED, ACT, MLP),
                               enabled=shared_experts > 0)  # fmt: skip
        self.shared_wo = param(init, rngs, (width, hidden), pd, (MLP, EMBED),
                               enabled=shared_experts > 0)  # fmt: skip
        self.aux_loss = AuxLoss(jnp.zeros((), jnp.float32))
        self.expert_load = ExpertLoad(jnp.zeros((e,), jnp.float32))
        self.dropped = ExpertLoad(jnp.zeros((), jnp.float32))
        self.capacity_factor = capacity_factor
        self.in_features, self.top_k, self.gating = hidden, top_k, gating
        self.activation, self.fp8, self.dtype, self.recipe = activation, fp8, dtype, recipe

    def __call__(self, x: jax.Array) -> jax.Array:
        _common.in_features(type(self).__name__, x, (-1,), (self.in_features,))
        x = x.astype(self.dtype or x.dtype)
        y, stats = _moe.moe(
            x, self.router[...], self.wi[...], self.wo[...], value_of(self.shared_wi),
            value_of(self.shared_wo), top_k=self.top_k, gating=self.gating,
            activation=self.activation, fp8=self.fp8, recipe=self.recipe,
            capacity_factor=self.capacity_factor,
        )  # fmt: skip
        self.aux_loss.set_value(stats.aux_loss)
        self.expert_load.set_value(stats.expert_load)
        self.dropped.set_value(stats.dropped)
        return y

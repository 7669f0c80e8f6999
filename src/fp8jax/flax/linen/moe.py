"""Linen MoEBlock: a Mixture-of-Experts feed-forward block on FP8 grouped GEMMs."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fp8jax.flax import _common, _moe
from fp8jax.flax._common import ACT, EMBED, MLP
from fp8jax.flax.linen._base import param
from fp8jax.flax.linen.dense import default_kernel_init
from fp8jax.recipes import Recipe


class MoEBlock(nn.Module):
    """Router, top-k, experts on ``fp8jax.ragged_dot``, optional shared experts.

    By default no token is dropped (no capacity factor): the grouped GEMMs take any
    number of tokens per expert. The math is :func:`fp8jax.moe_mlp`. The
    auxiliary load-balancing loss (1 when balanced) is sown as
    ``"aux_loss"`` in the ``"intermediates"`` collection (add it to the
    training loss with a coefficient; 0.01 is common), each expert's share
    of the routed slots as ``"expert_load"`` in ``"moe_stats"`` (where that
    collection is mutable).

    Under data parallelism and FSDP (no expert axis) each device routes its
    own tokens and runs every expert on them; FSDP-split weights are
    gathered in FP8 (:func:`fp8jax.flax._expert_parallel.local`).

    Parameters: ``router`` ``(hidden, num_experts)`` (used in f32),
    ``wi`` ``(num_experts, hidden, 2, ffn)`` (gate, up), ``wo``
    ``(num_experts, ffn, hidden)``; with shared experts ``shared_wi``
    ``(hidden, 2, shared_experts * ffn)`` and ``shared_wo``.

    Expert parallelism: under :func:`fp8jax.sharding.use_mesh` with
    ``ShardingConfig(ep=...)`` and a mesh whose ``ep`` axis has size > 1,
    ``wi`` and ``wo`` are split along their expert axis over it (logical name
    ``"expert"``) and the block sends each token's rows to its experts'
    devices and back with ``ragged_all_to_all`` (no token dropped), giving the
    values of one device (:mod:`fp8jax.flax._expert_parallel`,
    docs/design.md#grouped-expert-gemms). ``num_experts`` and the tokens must
    divide over the devices; a mesh that also splits the expert weights
    otherwise (``fsdp``, ``tp`` of size > 1) raises.

    Attributes:
      num_experts, top_k: experts, and experts per token.
      ffn: each expert's inner width (and each shared expert's).
      gating: ``"softmax"`` (Mixtral) or ``"sigmoid"`` (DeepSeek-V3); the
        top-k gates are normalized to sum to 1.
      activation: the gate's activation, by LayerNormMLP's names: ``"silu"``
        (SwiGLU), ``"gelu"`` (GeGLU, erf's gelu), ``"gelu_tanh"`` or ``"relu"``.
      shared_experts: how many always-on experts, run as one gated MLP.
      fp8: FP8 GEMMs (fp8jax.ragged_dot, fp8jax.dense); False runs the same
        block in the input's dtype (a BF16 baseline) on
        ``fp8jax.kernels.bf16_grouped.ragged_dot``.
      capacity_factor: None (dropless), or a number > 0: each expert takes at
        most ``ceil(capacity_factor * tokens * top_k / num_experts)`` slots,
        the first in token order (:func:`fp8jax.moe_mlp`); under expert
        parallelism it bounds each device's receive buffer. The share
        dropped is sown as ``"dropped"`` in ``"moe_stats"``.
      dtype, param_dtype, kernel_init, recipe: as in DenseGeneral
        (CurrentScaling or BlockScaling: ragged_dot keeps no delayed-scaling state).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from fp8jax.flax import linen as fnn
      >>> block = fnn.MoEBlock(num_experts=4, top_k=2, ffn=64)
      >>> x = jnp.ones((2, 8, 32))
      >>> variables = block.init(jax.random.key(0), x)
      >>> block.apply(variables, x).shape
      (2, 8, 32)
    """

    num_experts: int
    top_k: int
    ffn: int
    _: dataclasses.KW_ONLY
    gating: str = "softmax"
    activation: str = "silu"
    shared_experts: int = 0
    fp8: bool = True
    capacity_factor: float | None = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = default_kernel_init
    recipe: Recipe | None = None

    def __post_init__(self):
        _moe.check(type(self).__name__, self.num_experts, self.top_k, self.ffn, self.gating,
                   self.activation, self.shared_experts, self.fp8, self.recipe)  # fmt: skip
        _moe.check_capacity(type(self).__name__, self.capacity_factor)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        _common.rank(type(self).__name__, x, at_least=1)  # rank 1: one token, as in NNX
        x = x.astype(self.dtype or x.dtype)
        hidden, e, ffn, pd = x.shape[-1], self.num_experts, self.ffn, self.param_dtype
        init = _common.fan_in_init(self.kernel_init, 1)
        router = param(self, "router", init, (hidden, e), pd, (EMBED, None))
        per_expert = _moe.expert_init(_common.fan_in_init(self.kernel_init, 1))
        wi = param(self, "wi", per_expert, (e, hidden, 2, ffn), pd, (_moe.EXPERT, EMBED, ACT, MLP))
        wo = param(self, "wo", per_expert, (e, ffn, hidden), pd, (_moe.EXPERT, MLP, EMBED))
        shared_wi = shared_wo = None
        if self.shared_experts:
            width = self.shared_experts * ffn
            shared_wi = param(self, "shared_wi", init, (hidden, 2, width), pd, (EMBED, ACT, MLP))
            shared_wo = param(self, "shared_wo", init, (width, hidden), pd, (MLP, EMBED))
        y, stats = _moe.moe(
            x, router, wi, wo, shared_wi, shared_wo, top_k=self.top_k, gating=self.gating,
            activation=self.activation, fp8=self.fp8, recipe=self.recipe,
            capacity_factor=self.capacity_factor,
        )  # fmt: skip
        self.sow("intermediates", "aux_loss", stats.aux_loss)
        # Its own collection: code that sums "intermediates" as losses stays right.
        self.sow("moe_stats", "expert_load", stats.expert_load)
        self.sow("moe_stats", "dropped", stats.dropped)
        return y

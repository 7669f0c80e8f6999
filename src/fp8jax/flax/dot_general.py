"""An FP8 ``dot_general`` for existing Flax models: ``nn.Dense(dot_general=fp8_dot_general)``.

Flax's ``Dense``, ``DenseGeneral``, ``MultiHeadDotProductAttention``
(``qkv_dot_general``, ``out_dot_general``) and ``nnx.Linear`` /
``nnx.LinearGeneral`` take a ``dot_general`` callable. Passing this one makes
their GEMMs FP8 in forward and backward without touching anything else.

Only the stateless recipes work here (:class:`~fp8jax.CurrentScaling` and the
fine-grained ones): a callable passed to a Flax module has nowhere to keep
delayed-scaling state. For DelayedScaling use the
modules of :mod:`fp8jax.flax.linen` or :mod:`fp8jax.flax.nnx`.
"""

from __future__ import annotations

import dataclasses

from fp8jax.ops.dot_general import dot_general as _fp8_dot_general
from fp8jax.recipes import (
    FINE_RECIPES,
    BlockScaling,
    CurrentScaling,
    MXFP8Scaling,
    RowwiseScaling,
)

_STATELESS = (CurrentScaling, *FINE_RECIPES)  # the recipes that keep no scale state


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8DotGeneral:
    """A ``lax.dot_general``-compatible callable that runs FP8 GEMMs.

    Attributes:
      recipe: a :class:`~fp8jax.CurrentScaling` (the default), or the
        stateless :class:`~fp8jax.RowwiseScaling`, :class:`~fp8jax.BlockScaling`
        or :class:`~fp8jax.MXFP8Scaling`.
        Its precisions set the accumulation; the ``precision`` Flax passes is ignored.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> from fp8jax.flax import Fp8DotGeneral
      >>> layer = nn.Dense(16, dot_general=Fp8DotGeneral())
      >>> x = jnp.ones((4, 32))
      >>> layer.apply(layer.init(jax.random.key(0), x), x).shape
      (4, 16)
    """

    recipe: CurrentScaling | RowwiseScaling | BlockScaling | MXFP8Scaling = dataclasses.field(
        default_factory=CurrentScaling
    )

    def __post_init__(self):
        if not isinstance(self.recipe, _STATELESS):
            raise TypeError(
                "Fp8DotGeneral.recipe must be fp8jax.CurrentScaling(...) (or the stateless "
                "RowwiseScaling(...), BlockScaling(...), MXFP8Scaling(...)): a dot_general "
                f"callable cannot carry scale state, got {self.recipe!r}. For DelayedScaling "
                "use the modules in fp8jax.flax.linen or fp8jax.flax.nnx."
            )

    def __call__(
        self,
        lhs,
        rhs,
        dimension_numbers,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
    ):
        """Same arguments as ``lax.dot_general``; ``precision`` is ignored (see recipe)."""
        del precision  # The recipe's per-GEMM precisions apply (fast accumulation forward).
        if out_sharding is not None:
            raise NotImplementedError(
                "Fp8DotGeneral does not take out_sharding; shard the inputs instead, "
                f"got out_sharding={out_sharding!r}."
            )
        return _fp8_dot_general(
            lhs,
            rhs,
            dimension_numbers,
            recipe=self.recipe,
            preferred_element_type=preferred_element_type,
        )


fp8_dot_general = Fp8DotGeneral()
"""The FP8 ``dot_general`` with the default CurrentScaling recipe."""

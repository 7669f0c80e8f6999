"""The routed-experts feed-forward of a Mixture-of-Experts layer as one plain-JAX op.

Router logits -> top-k -> the ``(token, slot)`` pairs sorted by expert
(argsort) -> gated experts on FP8 grouped GEMMs (:func:`fp8jax.ragged_dot`,
one scale per expert) -> back to token order, weighted by the gates.

By default no token is dropped: every token reaches its ``top_k`` experts
whatever the load, because the grouped GEMMs take any group sizes (no
capacity, no padding). With a ``capacity_factor`` each expert takes at most
``capacity = ceil(capacity_factor * tokens * top_k / experts)`` slots, the
first in token order (a token's slots in rank order); a dropped slot adds
nothing to its token's output (its gate is not renormalized). Under expert
parallelism this bounds each device's receive buffer
(:mod:`fp8jax.flax._expert_parallel`). The auxiliary load-balancing loss is Switch Transformer's:
``num_experts * sum_e f_e * p_e``, ``f_e`` the share of routed slots that go
to expert ``e`` and ``p_e`` its mean gate probability; 1 when balanced.

Inside ``shard_map`` over the mesh axes splitting the tokens
(``token_axes``), each device routes and sorts its own tokens and runs
every expert on its own rows: no token row leaves the device. The routing
statistics and every per-tensor amax are then reduced over those axes, so
values equal one device's. ``gather_axes`` names the mesh axes splitting
the experts' hidden axis (FSDP): each device quantizes its shard of the
weights (the per-expert amax max-reduced over them), all-gathers the FP8
copies, and reduce-scatters their gradient (:func:`fp8jax.ragged_dot`'s
``RaggedConfig.rhs_gather``). :mod:`fp8jax.flax` enters that ``shard_map``
for its MoE blocks under data parallelism and FSDP.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8jax import activations
from fp8jax.kernels import bf16_grouped
from fp8jax.ops import ragged_dot as ragged_dot_ops
from fp8jax.quantize import check_high_precision

GATINGS = ("softmax", "sigmoid")
# The experts' gate activations: every registered one but "linear" (a gated pair (act, "linear")).
ACTIVATIONS = tuple(a for a in activations.NAMES if a != "linear")


class MoEStats(NamedTuple):
    """What one routed-experts call reports, over every device's tokens (f32).

    Attributes:
      aux_loss: the load-balancing loss (1 when balanced); add it to the loss times a weight.
      expert_load: ``[num_experts]``, each expert's share of the routed slots (sums to 1;
        0 everywhere without tokens), counted before any capacity drops them. The
        load balance is ``max / mean``, i.e. ``num_experts * max(expert_load)``.
      dropped: the share of slots dropped by the capacity (0 without one).
    """

    aux_loss: jax.Array
    expert_load: jax.Array
    dropped: jax.Array


def route(logits: jax.Array, top_k: int, gating: str, axes: tuple[str, ...] = ()):
    """``(gates [t, k], experts [t, k], stats)`` from router ``logits [t, e]``, in f32.

    ``axes``: inside ``shard_map``, the mesh axes splitting the tokens (each
    device holding as many); the statistics then count all of them.
    """
    logits = logits.astype(jnp.float32)
    num_experts = logits.shape[-1]
    if gating == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
    else:
        # sigmoid / sum(sigmoid), as a softmax of log-sigmoids: the sigmoids of
        # logits below about -88 are subnormal or 0 in f32, and their quotient
        # lost its digits there, or was 0 / 0 (NaN) where all were.
        probs = jax.nn.softmax(jax.nn.log_sigmoid(logits), axis=-1)
    gates, experts = lax.top_k(probs, top_k)
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    counts = jnp.zeros((num_experts,), jnp.float32).at[experts.reshape(-1)].add(1.0)
    # No tokens, no imbalance: max(., 1) makes the loss 0 there, not 0 / 0.
    mean_probs = jnp.sum(probs, axis=0) / max(probs.shape[0], 1)
    if axes:  # the statistics of every device's tokens
        counts, mean_probs = lax.pmean(counts, axes), lax.pmean(mean_probs, axes)
    load = counts / max(experts.size, 1)
    aux_loss = num_experts * jnp.sum(load * mean_probs)
    return gates, experts, MoEStats(aux_loss, load, jnp.zeros((), jnp.float32))


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float | None):
    """Each expert's slots for ``tokens`` tokens (all devices' that share the experts), or None."""
    if capacity_factor is None:
        return None
    # At most ``tokens``: a token's experts are distinct, so no expert gets more
    # slots and a larger capacity drops nothing; unbounded, a large factor overflowed
    # int32 against the slots' ranks (or math.ceil, at inf).
    return max(1, math.ceil(min(capacity_factor * tokens * top_k / num_experts, tokens)))


def sort_by_expert(flat: jax.Array, num_experts: int, cap: int | None = None,
                   axes: tuple[str, ...] = ()):  # fmt: skip
    """``(order, sizes, dropped)``: the slots ``flat [m]`` (their experts) sorted by expert.

    ``order`` sorts the slots by expert, stably (each expert's slots in slot
    order), ``sizes [e]`` counts them. With a capacity ``cap``, each
    expert's first ``cap`` slots come first, sorted, and its others after
    every kept one (the grouped GEMMs skip rows past ``sum(sizes)``);
    ``sizes`` counts the kept. ``axes``: inside ``shard_map``, the mesh axes
    splitting the tokens in order; the capacity then counts the slots of
    the devices before this one first, as one device holding all tokens
    would. ``dropped``: the share of slots dropped, over all of them (f32).
    """
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    if cap is None:
        return order, sizes, jnp.zeros((), jnp.float32)
    before = jnp.zeros_like(sizes)
    if axes:  # the slots each expert got on the devices before this one
        everyone = lax.all_gather(sizes, axes)  # [devices, e], in device order
        me = lax.axis_index(axes)
        earlier = jnp.arange(everyone.shape[0])[:, None] < me
        before = jnp.sum(jnp.where(earlier, everyone, 0), axis=0)
    sorted_experts = flat[order]
    starts = jnp.cumsum(sizes) - sizes
    rank = jnp.arange(flat.size, dtype=jnp.int32) - starts[sorted_experts]
    keep = before[sorted_experts] + rank < cap
    order = order[jnp.argsort(jnp.where(keep, sorted_experts, num_experts), stable=True)]
    kept = jnp.clip(cap - before, 0, sizes).astype(jnp.int32)
    dropped = (flat.size - jnp.sum(kept)).astype(jnp.float32) / max(flat.size, 1)
    if axes:
        dropped = lax.pmean(dropped, axes)
    return order, kept, dropped


def gated(h: jax.Array, activation: str, dtype) -> jax.Array:
    """``act(gate) * up`` of ``h [rows, 2, ffn]`` (gate, then up), computed in f32."""
    return activations.gated(h, (activation, "linear"), axis=1).astype(dtype)


def _gemm(fp8: bool, recipe):
    if fp8:
        return lambda a, b, sizes: ragged_dot_ops.ragged_dot(a, b, sizes, recipe=recipe)
    # The BF16 baseline on JAX's Mosaic GPU grouped GEMMs where they run: XLA's GPU
    # lax.ragged_dot does every group's FLOPs (docs/design.md#grouped-expert-gemms).
    return lambda a, b, sizes: bf16_grouped.ragged_dot(a, b.astype(a.dtype), sizes)


def experts_ffn(xs, sizes, wi, wo, activation: str, fp8: bool, recipe):
    """Gated experts on rows sorted by expert: ``act(xs . wi_gate) * (xs . wi_up) . wo``.

    ``wi [e, hidden, 2, ffn]`` (gate, then up), ``wo [e, ffn, hidden]``.
    """
    gemm = _gemm(fp8, recipe)
    e, hidden, _, ffn = wi.shape
    h = gemm(xs, wi.reshape(e, hidden, 2 * ffn), sizes).reshape(xs.shape[0], 2, ffn)
    return gemm(gated(h, activation, xs.dtype), wo, sizes)


def routed_experts(x2, order, top_k: int, sizes, wi, wo, activation: str, fp8: bool, recipe,
                   gather_axes: tuple[str, ...] = ()):  # fmt: skip
    """The gated experts' outputs for every (token, slot) pair, in slot order: ``[t * top_k, h]``.

    ``order`` sorts the slots by expert (``sizes`` per expert). In FP8 the
    grouped GEMMs read the tokens' rows and write the slots' rows by index
    (:func:`fp8jax.ops.ragged_dot.permuted_ragged_dot`): the tokens are
    quantized before they are repeated and no permuted copy is written
    (docs/design.md#grouped-expert-gemms). Otherwise the rows are gathered
    into expert order and back (:func:`dispatch`, :func:`combine`).
    ``gather_axes``: see the module docstring (``wi``, ``wo`` are then each
    device's shard along their hidden axis).
    """
    e, _, _, ffn = wi.shape
    if not fp8:
        inverse = ragged_dot_ops.inverse_permutation(order)
        xs = dispatch(x2, order, inverse, top_k)
        return combine(experts_ffn(xs, sizes, wi, wo, activation, fp8, recipe), order, inverse)
    gemm = functools.partial(ragged_dot_ops.sharded_permuted_ragged_dot, recipe=recipe)
    h = gemm(x2, wi.reshape(e, wi.shape[1], 2 * ffn), sizes, lhs_slots=order, repeats=top_k,
             rhs_gather=(1, gather_axes))  # fmt: skip
    a = gated(h.reshape(h.shape[0], 2, ffn), activation, x2.dtype)
    return gemm(a, wo, sizes, out_slots=order, rhs_gather=(2, gather_axes))


def check_capacity_factor(owner: str, capacity_factor) -> None:
    """Raises unless ``capacity_factor`` is None or a finite number > 0."""
    if capacity_factor is None:
        return
    # numbers.Real: NumPy floats too (np.float32 is no float subclass).
    if (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real)
            or not 0 < capacity_factor < math.inf):  # fmt: skip
        raise ValueError(
            f"{owner}: capacity_factor must be None (dropless) or a finite number > 0 "
            f"(1.25 is common), got {capacity_factor!r}."
        )


def _check(x, logits, wi, wo, top_k, gating, activation, fp8, recipe, gather_axes) -> None:
    """Raises for bad operands or settings, naming the argument, the expected and the given."""
    # Here, not in the grouped GEMMs, whose errors name their own lhs and rhs.
    for name, operand in (("x", x), ("wi", wi), ("wo", wo)):
        check_high_precision(f"fp8jax.moe_mlp: {name}", operand)
    if x.ndim != 2:
        raise ValueError(f"fp8jax.moe_mlp: x must be 2-D [tokens, hidden], got shape {x.shape}.")
    t, hidden = x.shape
    if gather_axes:  # wi and wo hold this device's shard of the hidden axis
        hidden //= lax.axis_size(gather_axes)
    if wi.ndim != 4 or wi.shape[1] != hidden or wi.shape[2] != 2:
        raise ValueError(
            f"fp8jax.moe_mlp: wi must be [experts, hidden={hidden}, 2, ffn] (gate, then up), "
            f"got shape {wi.shape}."
        )
    e, _, _, ffn = wi.shape
    if wo.shape != (e, ffn, hidden):
        raise ValueError(
            f"fp8jax.moe_mlp: wo must be [experts, ffn, hidden] = {(e, ffn, hidden)} to match "
            f"wi {wi.shape}, got shape {wo.shape}."
        )
    if logits.shape != (t, e) or not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(
            f"fp8jax.moe_mlp: logits must be float [tokens, experts] = {(t, e)}, got "
            f"{logits.dtype} {logits.shape}."
        )
    # numbers.Integral: NumPy ints too, as the Flax blocks' settings take them.
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or not 1 <= top_k <= e:
        raise ValueError(f"fp8jax.moe_mlp: top_k must be an int in [1, {e}], got {top_k!r}.")
    if gating not in GATINGS:
        raise ValueError(f"fp8jax.moe_mlp: gating must be one of {GATINGS}, got {gating!r}.")
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"fp8jax.moe_mlp: activation must be one of {ACTIVATIONS}, got {activation!r}."
        )
    if not isinstance(fp8, bool | np.bool_):  # a config's "false" would run FP8
        raise TypeError(f"fp8jax.moe_mlp: fp8 must be a bool, got {fp8!r}.")
    if fp8:
        ragged_dot_ops.check_recipe("fp8jax.moe_mlp", recipe)


def moe_mlp(
    x: jax.Array,
    logits: jax.Array,
    wi: jax.Array,
    wo: jax.Array,
    *,
    top_k: int,
    gating: str = "softmax",
    activation: str = "silu",
    fp8: bool = True,
    recipe=None,
    capacity_factor: float | None = None,
    token_axes: tuple[str, ...] = (),
    gather_axes: tuple[str, ...] = (),
) -> tuple[jax.Array, MoEStats]:
    """The routed experts of an MoE layer: each token through its ``top_k`` gated experts.

    Each token's ``top_k`` experts are those of its largest router
    probabilities (``softmax`` of ``logits``, or ``sigmoid`` normalized); its
    output is their gated MLPs' outputs weighted by those probabilities
    (renormalized over the ``top_k``). The experts run on FP8 grouped GEMMs
    (:func:`fp8jax.ragged_dot`), or in ``x``'s dtype with
    :func:`fp8jax.kernels.bf16_grouped.ragged_dot` (Mosaic GPU kernels on
    GPUs, ``lax.ragged_dot`` elsewhere) when ``fp8`` is False. Dropless by default: every
    slot is computed.

    Args:
      x: ``[tokens, hidden]`` high-precision tokens.
      logits: ``[tokens, experts]`` router logits (computed in f32 here).
      wi: ``[experts, hidden, 2, ffn]``: each expert's gate and up projections.
      wo: ``[experts, ffn, hidden]``: each expert's down projection.
      top_k: experts per token, in ``[1, experts]``.
      gating: ``"softmax"`` or ``"sigmoid"``.
      activation: the gate's activation, a name from :mod:`fp8jax.activations`
        (``"silu"``: SwiGLU experts).
      fp8: FP8 expert GEMMs; False runs them in ``x.dtype`` (a baseline).
      recipe: :class:`~fp8jax.CurrentScaling` (the default) or
        :class:`~fp8jax.BlockScaling` (DeepSeek-V3's 1x128 tiles and 128x128
        expert weight blocks); the recipes the expert GEMMs take.
      capacity_factor: None (dropless), or a number > 0: each expert takes at
        most ``ceil(capacity_factor * tokens * top_k / experts)`` slots, the
        first in token order, counting every device's tokens (``token_axes``).
      token_axes: inside ``shard_map``, the mesh axes splitting the tokens;
        the statistics and the amaxes then cover every device's tokens.
      gather_axes: inside ``shard_map``, the mesh axes splitting ``wi``'s and
        ``wo``'s hidden axis (FSDP); the weights are all-gathered in FP8.

    Returns:
      ``(y, stats)``: ``y [tokens, hidden]`` in ``x.dtype``, and the
      :class:`MoEStats` (load-balancing loss, each expert's share of the
      slots, the share dropped).

    Raises:
      TypeError: for an ``x``, ``wi`` or ``wo`` that is not a high-precision float array.
      ValueError: for wrong shapes, a bad ``top_k``, gating, activation or
        capacity factor, or a recipe other than CurrentScaling or BlockScaling.

    Example:
      >>> import jax, jax.numpy as jnp, fp8jax
      >>> k = jax.random.split(jax.random.key(0), 4)
      >>> x = jax.random.normal(k[0], (16, 64))
      >>> router = jax.random.normal(k[1], (64, 4))
      >>> wi = jax.random.normal(k[2], (4, 64, 2, 32)) / 8
      >>> wo = jax.random.normal(k[3], (4, 32, 64)) / 6
      >>> y, stats = fp8jax.moe_mlp(x, x @ router, wi, wo, top_k=2)
      >>> y.shape, stats.expert_load.shape, float(stats.expert_load.sum())
      ((16, 64), (4,), 1.0)
    """
    _check(x, logits, wi, wo, top_k, gating, activation, fp8, recipe, gather_axes)
    top_k = int(top_k)  # a static int: permuted_ragged_dot's repeats and the jit keys
    if fp8:
        recipe = ragged_dot_ops.check_recipe("fp8jax.moe_mlp", recipe)
        if token_axes:
            recipe = ragged_dot_ops.reduced_over(recipe, token_axes)
    check_capacity_factor("fp8jax.moe_mlp", capacity_factor)
    gates, experts, stats = route(logits, top_k, gating, token_axes)
    tokens = x.shape[0] * (lax.axis_size(token_axes) if token_axes else 1)
    cap = capacity(tokens, top_k, wi.shape[0], capacity_factor)
    order, sizes, dropped = sort_by_expert(experts.reshape(-1), wi.shape[0], cap, token_axes)
    stats = stats._replace(dropped=dropped)
    ys = routed_experts(x, order, top_k, sizes, wi, wo, activation, fp8, recipe, gather_axes)
    if cap is not None:
        # A dropped slot's output is 0 already; masking it also zeroes its
        # gradient, so the gradient's FP8 scale (its amax) covers the kept
        # slots only, as where the dropped ones are never sent (expert parallelism).
        kept = ragged_dot_ops.inverse_permutation(order) < jnp.sum(sizes)
        ys = jnp.where(kept[:, None], ys, jnp.zeros((), ys.dtype))
    per_slot = ys.reshape(x.shape[0], top_k, x.shape[-1])  # not -1: hidden or ffn may be 0
    y = jnp.einsum("tkh,tk->th", per_slot.astype(jnp.float32), gates).astype(x.dtype)
    return y, stats


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
    dx2 = jnp.sum(per_slot.reshape(g.shape[0] // top_k, top_k, g.shape[-1]), axis=1).astype(g.dtype)
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

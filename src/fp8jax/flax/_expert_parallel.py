"""Expert parallelism for the MoE block: experts split over a mesh axis, tokens sent to them.

Under :func:`fp8jax.sharding.use_mesh` with a :class:`~fp8jax.sharding.ShardingConfig`
whose ``ep`` axis has size > 1, the experts' weights (``wi [e, hidden, 2, ffn]``,
``wo [e, ffn, hidden]``) are split along the expert axis over that mesh axis,
and the tokens over it and the other batch axes. :func:`moe` then runs the
routed experts inside ``jax.shard_map`` over the mesh, each device:

1. routes its own tokens (the router is replicated) and sorts its
   ``(token, slot)`` pairs by expert, as the single-device block does, so
   that the rows for each destination device (the owner of a contiguous range
   of ``e / ep`` experts) lie together;
2. exchanges the per-expert counts with an ``all_to_all`` and derives from
   them the :class:`Plan`: where each destination's rows start and how many
   there are, where they land on the receiver, and how many rows it receives
   from each peer;
3. sends the rows with ``lax.ragged_all_to_all`` (no capacity, no token
   dropped) and runs its experts on the received rows in local-expert order
   with :func:`fp8jax.ops.moe.routed_experts` (FP8 grouped GEMMs that read
   and write the rows by index, so the re-sort writes no copy);
4. sends the outputs back by the reverse exchange, and weights each token's
   slots by its gates.

The receive buffer has a static size, the worst case: every token of every
peer routed to this device's experts, ``ep * tokens_per_device * min(top_k,
e / ep)`` rows (a token's ``top_k`` experts are distinct, so it sends at most
``min(top_k, e / ep)`` rows to one device). Rows past those received are
zeros; the grouped GEMMs skip them (group sizes), but they are quantized,
re-sorted and held in memory: with balanced routing the buffer is
``ep * min(top_k, e / ep) / top_k`` times the rows actually received. With
a ``capacity_factor`` (:func:`fp8jax.moe_mlp`'s rule over the tokens of the
expert axis' devices, in device order) each expert takes at most
``capacity`` rows, so the buffer is ``e / ep * capacity`` rows: the
capacity factor times the balanced share (:func:`receive_rows`); the
senders keep the slots the rule keeps (each device's place in an expert's
order comes from an ``all_gather`` of the per-expert counts).

The exchange has its own ``custom_vjp`` (:func:`exchange`): its backward is the
same exchange with the plan reversed (:meth:`Plan.reversed`), which the
forward also runs to bring the outputs back, so the tests check both with
the same offset arithmetic. (JAX 0.10.2 has a transpose rule for
``ragged_all_to_all``; it re-derives the offsets with two more
``all_to_all``\\ s per call, and is not used here.)

XLA:CPU cannot run ``ragged_all_to_all`` ("HLO opcode `ragged-all-to-all` is
not supported by XLA:CPU ThunkEmitter"), so the exchange is chosen by platform
(``lax.platform_dependent``): CUDA gets ``ragged_all_to_all``; elsewhere an
exact emulation on ``lax.all_to_all`` takes the same plan, sends every peer
a buffer of the worst-case chunk (``tokens_per_device * min(top_k, e / ep)``
rows) and places the received rows at the same offsets. It moves ``ep``
times the receive buffer (every device sends it whole), which is fine for
tests on CPU devices and is never compiled for GPUs.

FP8 scales: inside ``shard_map`` each device sees only its rows, so the
recipe's ``amax_reduction_axes`` is extended with the token axes: every
per-tensor amax (activations and gradients) is max-reduced over the devices
and equals the single-device block's. Each expert's weights are whole on
one device, so their per-expert scales are the same too.

What the mesh may split: the expert axis and other batch axes of size > 1
whose devices hold whole experts (``dp``; ``fsdp`` only when it is the expert
axis itself). An axis that splits the expert weights otherwise (``fsdp`` on
their hidden axis, ``tp`` on their ffn axis) or splits no tokens (``tp``,
``sp``) raises: the weights would be gathered in high precision, or the
tokens replicated, and neither is implemented.

docs/design.md#grouped-expert-gemms has the costs and what is not measured:
no multi-GPU run exists.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from fp8jax.axes import ACT, BATCH, EMBED, EXPERT, MLP
from fp8jax.ops import moe as moe_ops
from fp8jax.ops import ragged_dot as ragged_dot_ops


class Layout(NamedTuple):
    """Where the expert-parallel block runs: the expert axis and the axes splitting tokens."""

    expert_axis: str
    token_axes: tuple[str, ...]  # every mesh axis of size > 1, the expert axis among them


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def layout(owner: str = "MoEBlock") -> Layout | None:
    """The expert-parallel layout of the mesh and logical rules in context, or None.

    None (the single-device block) without a mesh or rules, or where the
    ``"expert"`` name maps to no mesh axis of size > 1. Raises where it maps
    to one but the mesh also splits what expert parallelism here does not
    handle (see the module docstring), naming the axis and why.
    """
    from flax.core import spmd

    from fp8jax import sharding

    rules = spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return None
    sizes = dict(mesh.shape)
    kinds = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    split = {a for a, s in sizes.items() if s > 1}

    def spec(names):
        return [_axes(e) for e in sharding.logical_spec(names, rules=rules, mesh=mesh)]

    expert = [a for a in spec((EXPERT,))[0] if a in split]
    if not expert:
        return None
    if len(expert) > 1:
        raise ValueError(
            f"{owner}: expert parallelism takes one mesh axis, but the logical axis "
            f"{EXPERT!r} maps to {tuple(expert)} (sizes {[sizes[a] for a in expert]})."
        )
    axis = expert[0]
    manual = sorted(a for a in split if kinds[a] == AxisType.Manual)
    if manual:
        raise ValueError(
            f"{owner}: expert parallelism over {axis!r} runs its own shard_map over the mesh, "
            f"but mesh axes {manual} are manual here (inside shard_map); call the block "
            "outside shard_map."
        )
    explicit = sorted(a for a in split if kinds[a] == AxisType.Explicit)
    if explicit:
        raise ValueError(
            f"{owner}: expert parallelism takes AxisType.Auto mesh axes, got Explicit "
            f"{explicit}; build the mesh with fp8jax.sharding.make_mesh's default axis_types."
        )
    tokens = tuple(a for a in spec((BATCH,))[0] if a in split)
    if axis not in tokens:
        raise ValueError(
            f"{owner}: the expert axis {axis!r} must also split the tokens (the logical "
            f"{BATCH!r} axis), which map to {tokens}; ShardingConfig(ep=...) does so."
        )
    weights = {a for entry in spec((EXPERT, EMBED, ACT, MLP)) for a in entry if a in split}
    for a in sorted(split - {axis}):
        if a in weights:
            raise ValueError(
                f"{owner}: expert parallelism over {axis!r} with mesh axis {a!r} "
                f"(size {sizes[a]}) also splitting the expert weights (fsdp on their hidden "
                "axis, tp on their ffn axis) is not implemented: they would be gathered in "
                f"high precision; give {a!r} size 1, or make it the expert axis."
            )
        if a not in tokens:
            raise ValueError(
                f"{owner}: expert parallelism over {axis!r} with mesh axis {a!r} "
                f"(size {sizes[a]}), which does not split the tokens (tp, sp), is not "
                f"implemented; give {a!r} size 1."
            )
    return Layout(axis, tokens)


class LocalLayout(NamedTuple):
    """Local routing under data parallelism and FSDP: the token axes, the weights' hidden axes."""

    token_axes: tuple[str, ...]  # every mesh axis of size > 1 splits the tokens
    gather_axes: tuple[str, ...]  # those splitting the experts' hidden axis (FSDP)
    explicit: bool  # the axes are Explicit: local() reshards into and out of its shard_map


def local_layout(x2, wi) -> LocalLayout | None:
    """Where each device can route its own tokens and run every expert on them, or None.

    Under a mesh and rules in context whose axes of size > 1 are all ``Auto``
    or all ``Explicit`` and all split the tokens (``dp``, ``fsdp``; no expert axis, see
    :func:`layout`), with the experts whole along their expert and ffn axes
    and ``fsdp`` at most on their hidden axis; the tokens and the hidden
    size divisible by the devices. Otherwise None: the block runs on the
    global arrays, as XLA partitions them.
    """
    from flax.core import spmd

    from fp8jax import sharding

    rules = spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return None
    sizes = dict(mesh.shape)
    split = {a for a, n in sizes.items() if n > 1}
    kinds = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    types = {kinds[a] for a in split}
    if types not in ({AxisType.Auto}, {AxisType.Explicit}):
        return None

    def spec(names):
        return [tuple(a for a in _axes(e) if a in split)
                for e in sharding.logical_spec(names, rules=rules, mesh=mesh)]  # fmt: skip

    (tokens,) = spec((BATCH,))
    experts, hidden, act, ffn = spec((EXPERT, EMBED, ACT, MLP))
    (_, _, hidden_o) = spec((EXPERT, MLP, EMBED))
    if set(tokens) != split or experts or act or ffn or hidden != hidden_o:
        return None
    if not set(hidden) <= set(tokens) or x2.shape[0] % math.prod(sizes[a] for a in tokens):
        return None
    if wi.shape[1] % math.prod(sizes[a] for a in hidden):
        return None
    return LocalLayout(tokens, hidden, types == {AxisType.Explicit})


def local(x2, router, wi, wo, where: LocalLayout, *, top_k: int, gating: str, activation: str,
          fp8: bool, recipe, capacity_factor: float | None = None):  # fmt: skip
    """The routed experts with every device routing its own tokens: ``(y [t, hidden], stats)``.

    One ``shard_map`` over the token axes: each device routes its rows,
    sorts its ``(token, slot)`` pairs by expert and runs every expert on
    them (:func:`fp8jax.moe_mlp`); no token row crosses devices. FSDP-split
    weights enter as each device's shard and are gathered in FP8 inside;
    BF16 experts (``fp8`` False) take them whole (gathered in their dtype,
    as a BF16 layer's are).
    """
    tokens, hidden, explicit = where
    gather = hidden if fp8 else ()

    def run(x2, router, wi, wo):
        logits = jnp.dot(x2.astype(jnp.float32), router.astype(jnp.float32))
        return moe_ops.moe_mlp(x2, logits, wi, wo, top_k=top_k, gating=gating,
                               activation=activation, fp8=fp8, recipe=recipe,
                               capacity_factor=capacity_factor, token_axes=tokens,
                               gather_axes=gather)  # fmt: skip

    on = gather or None
    rows = P(tokens, None)
    specs = (rows, P(), P(None, on, None, None), P(None, None, on))
    operands = (x2, router, wi, wo)
    if explicit:
        # Explicit axes type every array's sharding, and shard_map takes its
        # inputs only as typed: the tokens are split over the token axes (a
        # no-op where data parallelism has split them already) and the result
        # goes back to the tokens' own sharding.
        operands = tuple(jax.sharding.reshard(a, s) for a, s in zip(operands, specs, strict=True))
    y, stats = jax.shard_map(
        run, in_specs=specs, out_specs=(rows, P()),
        # As in routed(): the kernels' outputs are not typed by the manual axes;
        # JAX then sums the replicated inputs' cotangents (router, the weights
        # over the axes that do not split them) itself.
        check_vma=False,
    )(*operands)  # fmt: skip
    if explicit:
        y = jax.sharding.reshard(y, jax.typeof(x2).sharding.spec)
    return y, stats


class Plan(NamedTuple):
    """One ragged exchange over the expert axis, each field ``[ep]`` int32 (one per peer).

    This device sends ``x[send_offsets[d]:][:send_sizes[d]]`` to peer ``d``,
    where the rows land at ``remote_offsets[d]``; it receives
    ``recv_sizes[s]`` rows from peer ``s`` at ``recv_offsets[s]``, which sat at
    ``remote_send_offsets[s]`` there. The first four (with ``recv_sizes``) are
    ``ragged_all_to_all``'s arguments; the other two make the reverse.
    """

    send_offsets: jax.Array
    send_sizes: jax.Array
    remote_offsets: jax.Array
    recv_offsets: jax.Array
    recv_sizes: jax.Array
    remote_send_offsets: jax.Array

    def reversed(self) -> Plan:
        """The exchange that sends every received row back to where it came from."""
        return Plan(self.recv_offsets, self.recv_sizes, self.remote_send_offsets,
                    self.send_offsets, self.send_sizes, self.remote_offsets)  # fmt: skip


def _exclusive_cumsum(v: jax.Array) -> jax.Array:
    return jnp.cumsum(v) - v


def _swap(v: jax.Array, axis: str) -> jax.Array:
    """Each peer's ``v[this device]``: row ``d`` of the result is peer ``d``'s ``v[me]``."""
    return lax.all_to_all(v, axis, 0, 0, tiled=True)


def plan(expert_sizes: jax.Array, axis: str, peers: int) -> tuple[Plan, jax.Array]:
    """The plan for rows sorted by expert, and the rows received per ``[peer, local expert]``.

    ``expert_sizes [e]``: this device's rows per (global) expert; peer ``d``
    owns experts ``d * e / peers`` to ``(d + 1) * e / peers - 1``.
    """
    per_peer = expert_sizes.reshape(peers, -1)  # [destination, its local expert]
    received = _swap(per_peer, axis)  # [source, my local expert]
    send_sizes = jnp.sum(per_peer, axis=1)
    recv_sizes = jnp.sum(received, axis=1)
    send_offsets = _exclusive_cumsum(send_sizes)
    recv_offsets = _exclusive_cumsum(recv_sizes)  # peers' chunks back to back, in peer order
    exchange_plan = Plan(send_offsets, send_sizes, _swap(recv_offsets, axis), recv_offsets,
                         recv_sizes, _swap(send_offsets, axis))  # fmt: skip
    return exchange_plan, received


def _ragged(x, out, p: Plan, axis: str, chunk: int):
    del chunk
    return lax.ragged_all_to_all(x, out, p.send_offsets, p.send_sizes, p.remote_offsets,
                                 p.recv_sizes, axis_name=axis)  # fmt: skip


def _emulated(x, out, p: Plan, axis: str, chunk: int):
    """``ragged_all_to_all`` on ``lax.all_to_all``: every peer gets ``chunk`` rows, some padding.

    Exact for chunks of at most ``chunk`` rows; costs ``peers * chunk`` rows
    sent and received per device whatever the counts.
    """
    i = jnp.arange(chunk, dtype=jnp.int32)[None, :]
    rows = p.send_offsets[:, None] + i  # [peer, chunk]
    sent = jnp.take(x, rows, axis=0, mode="fill", fill_value=0)
    sent = jnp.where((i < p.send_sizes[:, None])[..., None], sent, jnp.zeros((), x.dtype))
    got = _swap(sent, axis)  # [source, chunk, hidden]
    at = _swap(p.remote_offsets, axis)[:, None] + i  # where each source's rows go here
    at = jnp.where(i < p.recv_sizes[:, None], at, out.shape[0])  # out of bounds: dropped
    return out.at[at.reshape(-1)].set(got.reshape(-1, x.shape[-1]), mode="drop")


def _send(x, p: Plan, rows: int, axis: str, chunk: int):
    out = jnp.zeros((rows, x.shape[-1]), x.dtype)
    return lax.platform_dependent(
        x, out, p, cuda=functools.partial(_ragged, axis=axis, chunk=chunk),
        default=functools.partial(_emulated, axis=axis, chunk=chunk),
    )  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def exchange(x, p: Plan, rows: int, axis: str, chunk: int):
    """``x``'s rows sent by plan ``p`` over ``axis``: ``[rows, hidden]``, zeros where none landed.

    ``chunk``: the most rows one device sends another (the emulation's
    buffer per peer). The gradient is the reverse exchange of the output's.
    """
    return _send(x, p, rows, axis, chunk)


def _exchange_fwd(x, p, rows, axis, chunk):
    return _send(x, p, rows, axis, chunk), (p, x.shape[0])


def _exchange_bwd(rows, axis, chunk, residuals, g):
    p, x_rows = residuals
    no_cotangent = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), p)
    return _send(g, p.reversed(), x_rows, axis, chunk), no_cotangent


exchange.defvjp(_exchange_fwd, _exchange_bwd)


def _local_order(received: jax.Array, rows: int):
    """The permutation sorting the receive buffer by local expert, and the local group sizes.

    ``received [peers, local experts]``: the buffer holds each peer's rows
    back to back, each peer's sorted by expert; rows past them sort last.
    """
    segments = received.reshape(-1)
    ends = jnp.cumsum(segments)
    segment = jnp.searchsorted(ends, jnp.arange(rows, dtype=ends.dtype), side="right")
    local = received.shape[1]
    key = jnp.where(segment < segments.size, segment % local, local)
    order = jnp.argsort(key, stable=True)  # stable: peer order, then each peer's token order
    return order.astype(jnp.int32), jnp.sum(received, axis=0).astype(jnp.int32)


def _check(owner, where: Layout, x2, wi) -> None:
    sizes = dict(jax.sharding.get_abstract_mesh().shape)
    peers = sizes[where.expert_axis]
    devices = math.prod(sizes[a] for a in where.token_axes)
    if wi.shape[0] % peers:
        raise ValueError(
            f"{owner}: num_experts must be divisible by the expert-parallel axis "
            f"{where.expert_axis!r} (size {peers}), got num_experts={wi.shape[0]}."
        )
    if x2.shape[0] % devices:
        raise ValueError(
            f"{owner}: the tokens (all axes but the last of x) must be divisible by the "
            f"{devices} devices of the token axes {where.token_axes} under expert "
            f"parallelism, got {x2.shape[0]} tokens."
        )


def receive_rows(tokens: int, peers: int, experts_here: int, top_k: int, cap: int | None) -> int:
    """The receive buffer's rows on each device: the worst case, or the capacity's bound.

    ``tokens``: each device's. Dropless, every token of every peer may send
    ``min(top_k, experts_here)`` rows here; with a capacity ``cap`` per
    expert, each local expert takes at most ``cap`` rows in all.
    """
    worst = peers * tokens * min(top_k, experts_here)
    return worst if cap is None else min(worst, experts_here * cap)


def routed(x2, router, wi, wo, where: Layout, *, top_k: int, gating: str, activation: str,
           fp8: bool, recipe, capacity_factor: float | None = None,
           owner: str = "MoEBlock"):  # fmt: skip
    """The routed experts on tokens ``x2 [t, hidden]``, expert-parallel: ``(y [t, hidden], stats)``.

    ``y`` is the gate-weighted sum of each token's experts, in ``x2.dtype``;
    ``stats`` (:class:`fp8jax.ops.moe.MoEStats`) over all tokens (as without a mesh).
    """
    _check(owner, where, x2, wi)
    axis, tokens = where
    peers = dict(jax.sharding.get_abstract_mesh().shape)[axis]
    if fp8:
        recipe = ragged_dot_ops.reduced_over(ragged_dot_ops.check_recipe(owner, recipe), tokens)

    def local(x2, router, wi, wo):
        t, hidden = x2.shape
        experts_here = wi.shape[0]
        # The capacity counts the tokens of the devices that share these experts
        # (the expert axis), in device order: one device's rule on their tokens.
        cap = moe_ops.capacity(t * peers, top_k, router.shape[-1], capacity_factor)
        rows = receive_rows(t, peers, experts_here, top_k, cap)
        chunk = min(t * min(top_k, experts_here), rows)  # the most rows one device sends another
        logits = jnp.dot(x2.astype(jnp.float32), router.astype(jnp.float32))
        gates, experts, stats = moe_ops.route(logits, top_k, gating, axes=tokens)
        # Sorted by expert, each expert's kept slots first (capacity): the plan
        # sends only those, so at most ``rows`` arrive.
        order, expert_sizes, dropped = moe_ops.sort_by_expert(
            experts.reshape(-1), router.shape[-1], cap, (axis,)
        )
        stats = stats._replace(dropped=lax.pmean(dropped, tokens))
        inverse = ragged_dot_ops.inverse_permutation(order)
        exchange_plan, received = plan(expert_sizes, axis, peers)
        xs = moe_ops.dispatch(x2, order, inverse, top_k)
        buffer = exchange(xs, exchange_plan, rows, axis, chunk)
        local_order, sizes = _local_order(received, rows)
        # The received rows to local-expert order and back: in FP8 the grouped
        # GEMMs read and write them by index (no re-sorted copies).
        ys = moe_ops.routed_experts(buffer, local_order, 1, sizes, wi, wo, activation, fp8, recipe)
        back = exchange(ys, exchange_plan.reversed(), t * top_k, axis, chunk)
        per_slot = moe_ops.combine(back, order, inverse).reshape(-1, top_k, hidden)
        y = jnp.einsum("tkh,tk->th", per_slot.astype(jnp.float32), gates).astype(x2.dtype)
        return y, stats

    rows = P(tokens, None)
    return jax.shard_map(
        local, in_specs=(rows, P(), P(axis), P(axis)), out_specs=(rows, P()),
        # The grouped GEMMs' Pallas kernels do not type their outputs by the manual
        # axes they vary along; JAX then sums replicated inputs' cotangents itself.
        check_vma=False,
    )(x2, router, wi, wo)  # fmt: skip

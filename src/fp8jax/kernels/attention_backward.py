"""FP8 flash attention's backward in Mosaic GPU: dK and dV per key block, dQ per query block.

Both kernels recompute the scores from the forward's FP8 operands on the
FP8 tensor cores (``s = (q8 . k8ᵀ) * q_scale * k_scale``, base-2 units,
:mod:`fp8jax.kernels.attention`) and P from the saved base-2 logsumexp,
then take every gradient product on BF16 tensor cores with f32 sums:
dP = dO Vᵀ, dV = Pᵀ dO, dS = P (dP - delta) * scale, dK = dSᵀ Q and
dQ = dS K, with P and dS rounded to BF16 (16 bits where FP8's error
dominates, SageAttention's finding). Q, K and V enter those products
dequantized to BF16, so the gradients are straight-through.

:func:`xla_backward` is the twin: the same products and roundings in XLA,
one key block a loop step. The kernels split the work as FlashAttention-2's
backward without atomics: one kernel per 128 keys of a kv head walks every
query block of its query heads (GQA's group adds into dK and dV in
registers), another per 128 queries walks the key blocks. Each has two
compute warpgroups of 64 rows and a memory warpgroup streaming the other
side's blocks by TMA, as the forward does. A Bᵀ operand comes K-major
from shared memory; 16-bit ``wgmma`` also takes MN-major B, which dV, dK
and dQ use (dO, Q, K as stored), and takes its A operand (P, dS) from
registers. Every kernel fits its registers without spilling at head_dim 64
and 128 (the deviceless ptxas report, tests/kernels/test_attention_kernel.py).

A fused build (``BackwardConfig(fused=True)``) drops the dQ kernel, which
recomputed the scores and dP: the dK/dV kernel takes dQ's products from
the dS it holds and adds them into an f32 dQ by TMA reduce-add, the atomics
FlashAttention-2 avoided.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.kernels import attention as fwd
from fp8jax.kernels import dispatch

STEP_ROWS = 64  # rows of the streamed side a step: keeps S, dP and two accumulators in registers
# Under causality, the steps a CTA's 128 rows meet the diagonal in.
DIAGONAL_STEPS = fwd.CTA_ROWS // STEP_ROWS
STAGES = 2
DKV_KERNEL = "fp8jax_attention_dkv"
DQ_KERNEL = "fp8jax_attention_dq"
BF16 = jnp.bfloat16
MAX_STAGES = 3  # at head_dim 128 a fourth slot of each streamed block overflows shared memory


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """How the backward kernels are built; no field changes their products or f32 steps.

    Frozen and hashable: part of ``jit``'s cache key, as
    :class:`fp8jax.kernels.attention.ForwardConfig` is.

    Attributes:
      stages: the streamed side's 64-row blocks (Q, dO and their vectors for
        dK and dV; K, V for dQ) in flight in shared memory: a block's loads
        have ``stages - 1`` steps to land.
      paired: a step's independent products are issued together and waited
        for once (FlashAttention-3's backward): the scores and dP, whose
        operands arrive together, and in the dK/dV kernel dV and dK. Two
        waits a step instead of four (three for dQ's two): the tensor cores'
        queue does not drain between them. The same products and sums.
      fused: the dK/dV kernel also takes dQ's share of its keys, and the dQ
        kernel, which recomputed the scores and dP for it, is not launched.
        After a step's dV and dK, both warpgroups store their dSᵀ halves to
        shared memory, and each takes one half of dQ's columns for the step's
        64 queries over the CTA's 128 keys (dS from shared memory, MN-major,
        by K as loaded into dK's buffer, which the epilogue reuses): 32 f32
        registers a thread, allocated when Sᵀ and dPᵀ are dead. The product
        goes to shared memory and is added into an f32 dQ in global memory
        (zeros, aliased in and out) by a TMA reduce-add; XLA scales and
        rounds it to BF16. The same products; dQ's f32 sum over the key
        blocks runs in the order the CTAs' reduce-adds land in, not one
        fixed order. Within the default's 232 registers without spilling at
        head_dim 64 and 128; shared memory at 128 is 217,280 bytes (the
        default's dK/dV kernel 168,096 of the H200's 232,448), which leaves
        the profiler room for about 35 steps a CTA, and with ``stages=3``
        it overflows (258,296). With ``paired`` ptxas spills 28 bytes at 128.
    """

    stages: int = STAGES
    paired: bool = False
    fused: bool = False

    def __post_init__(self):
        if isinstance(self.stages, bool) or not isinstance(self.stages, int):
            raise TypeError(f"BackwardConfig(stages=...) must be an int, got {self.stages!r}.")
        if not 2 <= self.stages <= MAX_STAGES:
            raise ValueError(
                f"BackwardConfig(stages=...) must be in [2, {MAX_STAGES}], got {self.stages}."
            )
        if not isinstance(self.paired, bool):
            raise TypeError(f"BackwardConfig(paired=...) must be a bool, got {self.paired!r}.")
        if not isinstance(self.fused, bool):
            raise TypeError(f"BackwardConfig(fused=...) must be a bool, got {self.fused!r}.")


DEFAULT_CONFIG = BackwardConfig()


def backward(q8, k8, q_scale, k_scale, q, k, v, do, lse2, delta, *, causal: bool, scale: float,
             config: BackwardConfig = DEFAULT_CONFIG):  # fmt: skip
    """``(dq, dk, dv)`` in BF16: the kernels on NVIDIA GPUs, else :func:`xla_backward`.

    ``q8``, ``k8``, ``q_scale``, ``k_scale``: the forward kernel's operands;
    ``q``, ``k``, ``v``: dequantized, BF16; ``do``: the output gradient
    (BF16); ``lse2``, ``delta`` (B, H, Tq) f32: base-2 logsumexp and
    ``rowsum(dO * O)``. ``config``: how the kernels are built
    (:class:`BackwardConfig`); XLA ignores it.
    """
    operands = (q8, k8, q_scale, k_scale, q, k, v, do, lse2, delta)
    xla = functools.partial(xla_backward, causal=causal, scale=scale)
    placement = dispatch.decide(lambda shards: fwd.fits_shards(q8.shape, k8.shape, shards))
    if not placement.kernel:
        return xla(*operands)
    pallas = functools.partial(mosaic_backward, causal=causal, scale=scale, stages=config.stages,
                               paired=config.paired, fused=config.fused)  # fmt: skip
    layouts = ("rows", "rows", "rows")  # all lead with the batch, split by data parallelism
    return dispatch.on_each_device(
        pallas, xla, operands, len(operands), layouts, placement.row_axes
    )


def _grouped(x, kv_heads: int):
    """(B, T, H, ...) -> (B, Hkv, G, T, ...): each kv head's group of query heads."""
    batch, t, heads = x.shape[:3]
    x = x.reshape(batch, t, kv_heads, heads // kv_heads, *x.shape[3:])
    return jnp.moveaxis(x, 1, 3)


def xla_backward(q8, k8, q_scale, k_scale, q, k, v, do, lse2, delta, *, causal, scale):
    """The kernels' products and roundings in XLA, one 128-key block a loop step."""
    batch, tq, heads, d = q8.shape
    kv_heads, tk = k8.shape[2], k8.shape[1]
    block = fwd.BLOCK
    blocks = tk // block

    def per_query(x):  # (B, H, Tq) -> (B, Hkv, G, Tq, 1)
        return _grouped(jnp.swapaxes(x, 1, 2), kv_heads)[..., None]

    def blocked(x):  # (B, Tk, Hkv, ...) -> (blocks, B, Hkv, BLOCK, ...)
        x = x.reshape(batch, blocks, block, kv_heads, *x.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)

    qg, q8g, dog = _grouped(q, kv_heads), _grouped(q8, kv_heads), _grouped(do, kv_heads)
    qs, lse, dl = per_query(q_scale), per_query(lse2), per_query(delta)
    # K's scale is one a block (expanded per key): its first entry, (blocks, B, Hkv, 1).
    ks_blocks = blocked(k_scale.swapaxes(1, 2)[..., None])[..., :1, 0]
    rows = lax.broadcasted_iota(jnp.int32, (tq, block), 0)
    cols = lax.broadcasted_iota(jnp.int32, (tq, block), 1)

    def dot(spec, a, b):
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)

    def step(dq, xs):
        j, kb8, ksb, kb, vb = xs
        c = qs * ksb[:, :, None, None, :]  # (B, Hkv, G, Tq, 1)
        p = jnp.exp2(dot("bhgqd,bhkd->bhgqk", q8g, kb8) * c - lse)
        if causal:
            p = jnp.where(rows >= cols + j * block, p, 0.0)
        dv = dot("bhgqk,bhgqd->bhkd", p.astype(BF16), dog)
        dp = dot("bhgqd,bhkd->bhgqk", dog, vb)
        ds = (p * (dp - dl)).astype(BF16)  # softmax's scale applied to dQ and dK's sums
        dq = dq + dot("bhgqk,bhkd->bhgqd", ds, kb)
        dk = dot("bhgqk,bhgqd->bhkd", ds, qg)
        return dq, (dk, dv)

    dq0 = jnp.zeros((batch, kv_heads, heads // kv_heads, tq, d), jnp.float32)
    xs = (jnp.arange(blocks, dtype=jnp.int32), blocked(k8), ks_blocks, blocked(k), blocked(v))
    dq, (dk, dv) = lax.scan(step, dq0, xs)
    dq = jnp.moveaxis(dq, 3, 1).reshape(batch, tq, heads, d) * scale

    def unblocked(x):  # (blocks, B, Hkv, BLOCK, D) -> (B, Tk, Hkv, D)
        return jnp.moveaxis(jnp.moveaxis(x, 3, 2), 0, 1).reshape(batch, tk, kv_heads, d)

    return dq.astype(BF16), (unblocked(dk) * scale).astype(BF16), unblocked(dv).astype(BF16)


def _helpers(interpreted: bool):
    """Loads, layouts and products that the interpreter runs as plain values (see the forward)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    def load(ref, layout):
        return ref[...] if interpreted else fwd.load_whole(plgpu, ref, layout)

    def laid_out(x, layout):
        return x if interpreted else plgpu.layout_cast(x, layout)

    def iota(shape, axis):
        if interpreted:
            return lax.broadcasted_iota(jnp.int32, shape, axis)
        return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)

    def mma_t(a_smem, bt_smem, shape):
        """``a . btᵀ`` into a fresh f32 accumulator (both K-major)."""
        if interpreted:
            return lax.dot_general(a_smem[...], bt_smem[...], (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)  # fmt: skip

        def product(ref):
            plgpu.wgmma(ref, a_smem, plgpu.transpose_ref(bt_smem, (1, 0)))
            return ref[...]

        return pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))

    def mma_add(acc, a, b_smem):
        """``acc + a . b`` with ``b`` stored (K, N): 16-bit wgmma takes it MN-major.

        ``a``: a 16-bit value in the accumulator's layout, which is ``wgmma``'s
        register operand layout at 16 bits: no trip through shared memory.
        """
        if interpreted:
            return acc + jnp.dot(a, b_smem[...], preferred_element_type=jnp.float32)

        def product(ref):
            plgpu.wgmma(ref, a, b_smem)

        return pl.run_state(product)(plgpu.ACC.init(acc))

    def mma_t_both(first, second, shape):
        """:func:`mma_t` of two ``(a_smem, bt_smem)`` pairs, issued together, waited for once."""
        if interpreted:
            return mma_t(*first, shape), mma_t(*second, shape)

        def products(*refs):
            for ref, (a_smem, bt_smem) in zip(refs, (first, second), strict=True):
                plgpu.wgmma(ref, a_smem, plgpu.transpose_ref(bt_smem, (1, 0)))
            first_ref, second_ref = refs
            # Waiting for no MMA in flight is waiting for both: the second read waits for none.
            return first_ref[...], plgpu.wgmma_accumulator_load(second_ref, wait_n=None)

        return pl.run_scoped(products, *[plgpu.ACC(shape, jnp.float32)] * 2)

    def mma_add_both(first, second):
        """:func:`mma_add` of two ``(acc, a, b_smem)`` terms, issued together, waited for once."""
        if interpreted:
            return mma_add(*first), mma_add(*second)

        def products(refs):
            for ref, (_, a, b_smem) in zip(refs, (first, second), strict=True):
                plgpu.wgmma(ref, a, b_smem)

        return pl.run_state(products)(tuple(plgpu.ACC.init(acc) for acc, _, _ in (first, second)))

    def mma_tn(terms, shape):
        """``Σ aᵀ . b`` over ``(at_smem, b_smem)`` terms into a fresh f32 accumulator.

        ``at_smem`` stores A transposed (K, M): 16-bit wgmma reads it MN-major
        from shared memory, as it reads ``b_smem`` (K, N).
        """
        if interpreted:
            dims = (((0,), (0,)), ((), ()))
            products = [lax.dot_general(at[...], b[...], dims, preferred_element_type=jnp.float32)
                        for at, b in terms]  # fmt: skip
            return functools.reduce(jnp.add, products)

        def product(ref):
            for at_smem, b_smem in terms:
                plgpu.wgmma(ref, plgpu.transpose_ref(at_smem, (1, 0)), b_smem)
            return ref[...]

        return pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))

    return pl, plgpu, load, laid_out, iota, mma_t, mma_add, mma_t_both, mma_add_both, mma_tn


def _smem(plgpu, shape, dtype, columns=None):
    """Swizzled for rows of ``columns`` (the last dimension unless given): its tiles."""
    columns = shape[-1] if columns is None else columns
    return plgpu.SMEM(shape, dtype, transforms=fwd._smem_transforms(plgpu, columns, dtype))


def _stream(plgpu, pl, steps, stages, sources, rings, loaded, done, interpreted):
    """The memory warpgroup: step ``t``'s blocks of every source into slot ``t % stages``."""

    @pl.loop(0, steps)
    def _step(t):
        slot = lax.rem(t, jnp.array(stages, t.dtype))

        @pl.when(t >= stages)  # the slot's previous blocks are consumed by both warpgroups
        def _wait():
            with jax.named_scope("wait_free"):
                plgpu.barrier_wait(done.at[slot])

        with jax.named_scope("load"):
            for i, (source, ring) in enumerate(zip(sources, rings, strict=True)):
                plgpu.copy_gmem_to_smem(source(t), ring.at[slot], loaded[i].at[slot])

    if not interpreted:
        # On the GPU the compute warpgroups outlive this one and nothing waits
        # for their last releases; waiting anyway kept the barriers' addresses
        # live through the compute warpgroups' code, where ptxas spilled them.
        return

    @pl.loop(lax.max(steps - stages, 0), steps)  # every barrier phase observed (interpreter)
    def _drain(t):
        plgpu.barrier_wait(done.at[lax.rem(t, jnp.array(stages, t.dtype))])


def _dkv_kernel(q8_ref, k8_ref, qs_ref, ks_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                *refs, causal, scale, group, stages, paired, fused, interpreted):  # fmt: skip
    pl, plgpu, load, laid_out, iota, mma_t, mma_add, mma_t_both, mma_add_both, mma_tn = _helpers(
        interpreted
    )
    dq_ref, *refs = refs if fused else (None, *refs)
    (dk_ref, dv_ref, k8_w, v_w, ks_w, dk_w, q8_r, q_r, do_r, qs_r, lse_r, dl_r, *rest) = refs
    ds_s, dq_s, own, loaded, done, ds_barriers = rest if fused else (None, None, *rest, None)
    d = q8_ref.shape[-1]
    n_rows = q8_ref.shape[1] // STEP_ROWS
    batch, kv_head, tile = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("k")
    wg = lax.axis_index("wg")
    # Under causality, query rows before the CTA's first key see none of its keys.
    first = tile * (fwd.CTA_ROWS // STEP_ROWS) if causal else 0
    per_head = n_rows - first
    steps = group * per_head

    def rows_of(t):
        head = kv_head * group + t // per_head
        return head, pl.ds((first + t % per_head) * STEP_ROWS, STEP_ROWS)

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        base = tile * fwd.CTA_ROWS + wg * fwd.WG_ROWS
        keys = pl.ds(base, fwd.WG_ROWS)
        plgpu.copy_gmem_to_smem(k8_ref.at[batch, keys, kv_head], k8_w.at[wg], own.at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[batch, keys, kv_head], v_w.at[wg], own.at[2 + wg])
        plgpu.copy_gmem_to_smem(ks_ref.at[batch, kv_head, keys], ks_w.at[wg], own.at[4 + wg])
        for i in (0, 2, 4):
            plgpu.barrier_wait(own.at[i + wg])
        if fused:  # dQ's B operand: both warpgroups' keys, in dK's buffer until the epilogue
            plgpu.copy_gmem_to_smem(k_ref.at[batch, keys, kv_head], dk_w.at[wg], own.at[6 + wg])
            for i in (6, 7):
                plgpu.barrier_wait(own.at[i])
        shape = (fwd.WG_ROWS, STEP_ROWS)
        column = plgpu.Layout.WGMMA.reduce(0)
        zeros = laid_out(jnp.zeros((fwd.WG_ROWS, d), jnp.float32), plgpu.Layout.WGMMA)

        def step(t, carry, masked):
            dk, dv = carry
            slot = lax.rem(t, jnp.array(stages, t.dtype))
            with jax.named_scope("wait"):
                for ring in loaded:
                    plgpu.barrier_wait(ring.at[slot])
            scores = (k8_w.at[wg], q8_r.at[slot])
            dp_operands = (v_w.at[wg], do_r.at[slot])
            with jax.named_scope("scores"):
                # Sᵀ: this warpgroup's keys by the step's queries, raw; scaled and
                # exponentiated in one FMA and one ex2 a score (docs/design.md#fp8-attention).
                if paired:
                    st, dpt = mma_t_both(scores, dp_operands, shape)
                else:
                    st = mma_t(*scores, shape)
                # The keys' one block scale, read as a vector along the queries
                # (columns; read each step, as 16 registers held it spills), joins
                # each query's scale in one factor a column.
                c = load(qs_r.at[slot], column) * load(ks_w.at[wg], column)
                lse = load(lse_r.at[slot], column)
                pt = jnp.exp2(st * lax.broadcast_in_dim(c, shape, [1])
                              - lax.broadcast_in_dim(lse, shape, [1]))  # fmt: skip
                if masked:
                    _, rows = rows_of(t)
                    query = iota(shape, 1) + rows.start
                    pt = jnp.where(query >= iota(shape, 0) + base, pt, 0.0)
            with jax.named_scope("dp"):
                if not paired:
                    dpt = mma_t(*dp_operands, shape)
                dst = pt * (dpt - lax.broadcast_in_dim(load(dl_r.at[slot], column), shape, [1]))
            # Pᵀ and dSᵀ enter wgmma from registers: 16-bit A operands share
            # the accumulator's layout, and no shared-memory round trip or
            # fence stands between the softmax and the products.
            wgmma_layout = plgpu.Layout.WGMMA
            with jax.named_scope("dv_dk"):
                dv_term = (dv, laid_out(pt.astype(BF16), wgmma_layout), do_r.at[slot])
                ds16 = laid_out(dst.astype(BF16), wgmma_layout)
                dk_term = (dk, ds16, q_r.at[slot])
                if paired:
                    dv, dk = mma_add_both(dv_term, dk_term)
                else:
                    dv, dk = mma_add(*dv_term), mma_add(*dk_term)
            plgpu.barrier_arrive(done.at[slot])
            if fused:
                with jax.named_scope("dq"):
                    dq_share(t, ds16)
            return dk, dv

        def dq_share(t, ds16):
            """The step's queries' dQ over the CTA's keys, this warpgroup's half of its columns,
            added into ``dq_ref``; ``ds16``: this warpgroup's dSᵀ, its keys by the queries.

            Each step ends when both warpgroups' products have read dS and K,
            which the next step and the epilogue rewrite; the staging buffer is
            rewritten once the previous reduce-add has read it.
            """
            stored, read = ds_barriers.at[0], ds_barriers.at[1]
            # Indices that LLVM cannot see through: the shared-memory addresses
            # and wgmma descriptors made from them are computed in the step, not
            # hoisted out of the loop, where ptxas spilled them at head_dim 128
            # (120-208 bytes a thread).
            zero, own = lax.optimization_barrier((jnp.zeros((), wg.dtype), wg))
            columns = pl.ds(own * (d // 2), d // 2)
            ds_s[own] = ds16
            plgpu.commit_smem()
            plgpu.barrier_arrive(stored)
            plgpu.barrier_wait(stored)
            terms = [(ds_s.at[zero + j], dk_w.at[zero + j, :, columns]) for j in range(2)]
            dq = mma_tn(terms, (STEP_ROWS, d // 2))
            plgpu.barrier_arrive(read)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            dq_s[own] = dq
            plgpu.commit_smem()
            head, rows = rows_of(t)
            target = dq_ref.at[batch, rows, head, columns]
            if interpreted:  # Mosaic GPU's interpreter has no TMA reduction
                target[...] = target[...] + dq_s[own]
            else:
                plgpu.copy_smem_to_gmem(dq_s.at[own], target, reduction_op="add")
            plgpu.barrier_wait(read)

        # Every step masked under causality: splitting off the diagonal's steps
        # (each head's first two) spilled registers at d 128 (12-36 bytes).
        dk, dv = lax.fori_loop(0, steps, functools.partial(step, masked=causal), (zeros, zeros))
        with jax.named_scope("epilogue"):
            dk_w[wg] = (dk * scale).astype(BF16)  # softmax's scale once, not a score at a time
            v_w[wg] = dv.astype(BF16)  # V's buffer is free now: shared memory is short at D 128
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dk_w.at[wg], dk_ref.at[batch, keys, kv_head])
            plgpu.copy_smem_to_gmem(v_w.at[wg], dv_ref.at[batch, keys, kv_head])
            plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def rows_source(ref):
            def source(t):
                head, rows = rows_of(t)
                return ref.at[batch, rows, head]

            return source

        def vector_source(ref):
            def source(t):
                head, rows = rows_of(t)
                return ref.at[batch, head, rows]

            return source

        sources = [*map(rows_source, (q8_ref, q_ref, do_ref)),
                   *map(vector_source, (qs_ref, lse_ref, delta_ref))]  # fmt: skip
        rings = [q8_r, q_r, do_r, qs_r, lse_r, dl_r]
        _stream(plgpu, pl, steps, stages, sources, rings, loaded, done, interpreted)


def _dq_kernel(q8_ref, k8_ref, qs_ref, ks_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
               dq_ref, *scoped, causal, scale, group, stages, paired, interpreted):  # fmt: skip
    del q_ref
    pl, plgpu, load, laid_out, iota, mma_t, mma_add, mma_t_both, *_ = _helpers(interpreted)
    (q8_w, do_w, qs_w, lse_w, dl_w, dq_w, k8_r, k_r, v_r, ks_r, own, loaded, done) = scoped
    d = q8_ref.shape[-1]
    batch, head, tile = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q")
    kv_head = lax.div(head, jnp.array(group, head.dtype))
    wg = lax.axis_index("wg")
    n_keys = k8_ref.shape[1] // STEP_ROWS
    # Under causality the CTA's queries see the keys up to its last row.
    steps = (tile + 1) * (fwd.CTA_ROWS // STEP_ROWS) if causal else n_keys

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        base = tile * fwd.CTA_ROWS + wg * fwd.WG_ROWS
        rows = pl.ds(base, fwd.WG_ROWS)
        own_sources = [(q8_ref.at[batch, rows, head], q8_w), (do_ref.at[batch, rows, head], do_w),
                       (qs_ref.at[batch, head, rows], qs_w), (lse_ref.at[batch, head, rows], lse_w),
                       (delta_ref.at[batch, head, rows], dl_w)]  # fmt: skip
        for i, (source, buffer) in enumerate(own_sources):
            plgpu.copy_gmem_to_smem(source, buffer.at[wg], own.at[2 * i + wg])
        for i in range(len(own_sources)):
            plgpu.barrier_wait(own.at[2 * i + wg])
        row = plgpu.Layout.WGMMA.reduce(1)
        shape = (fwd.WG_ROWS, STEP_ROWS)
        qs = load(qs_w.at[wg], row)
        lse = lax.broadcast_in_dim(load(lse_w.at[wg], row), shape, [0])
        delta = lax.broadcast_in_dim(load(dl_w.at[wg], row), shape, [0])

        def step(t, dq, masked):
            slot = lax.rem(t, jnp.array(stages, t.dtype))
            with jax.named_scope("wait"):
                for ring in loaded:
                    plgpu.barrier_wait(ring.at[slot])
            with jax.named_scope("scores"):
                # The step's keys share one scale: read along the rows, it joins
                # each query's in one factor a row, and one FMA a score scales it.
                c = qs * load(ks_r.at[slot], row)
                scores, dp_operands = (q8_w.at[wg], k8_r.at[slot]), (do_w.at[wg], v_r.at[slot])
                if paired:
                    s, dp = mma_t_both(scores, dp_operands, shape)
                else:
                    s = mma_t(*scores, shape)
                p = jnp.exp2(s * lax.broadcast_in_dim(c, shape, [0]) - lse)
                if masked:
                    key = iota(shape, 1) + t * STEP_ROWS
                    p = jnp.where(iota(shape, 0) + base >= key, p, 0.0)
            with jax.named_scope("dp"):
                if not paired:
                    dp = mma_t(*dp_operands, shape)
                ds = laid_out((p * (dp - delta)).astype(BF16), plgpu.Layout.WGMMA)
            with jax.named_scope("dq"):
                dq = mma_add(dq, ds, k_r.at[slot])
            plgpu.barrier_arrive(done.at[slot])
            return dq

        zeros = laid_out(jnp.zeros((fwd.WG_ROWS, d), jnp.float32), plgpu.Layout.WGMMA)
        # Under causality only the last steps (the CTA's own keys) meet the diagonal.
        diagonal = lax.max(steps - DIAGONAL_STEPS, 0) if causal else steps
        dq = lax.fori_loop(0, diagonal, functools.partial(step, masked=False), zeros)
        dq = lax.fori_loop(diagonal, steps, functools.partial(step, masked=True), dq)
        with jax.named_scope("epilogue"):
            dq_w[wg] = (dq * scale).astype(BF16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dq_w.at[wg], dq_ref.at[batch, rows, head])
            plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def source(ref, vector=False):
            def at(t):
                keys = pl.ds(t * STEP_ROWS, STEP_ROWS)
                return ref.at[batch, kv_head, keys] if vector else ref.at[batch, keys, kv_head]

            return at

        sources = [source(k8_ref), source(k_ref), source(v_ref), source(ks_ref, vector=True)]
        rings = [k8_r, k_r, v_r, ks_r]
        _stream(plgpu, pl, steps, stages, sources, rings, loaded, done, interpreted)


def mosaic_backward(q8, k8, q_scale, k_scale, q, k, v, do, lse2, delta, *, causal, scale,
                    stages=STAGES, paired=False, fused=False, interpret=None,
                    profile_dir: str | None = None):  # fmt: skip
    """The two kernels: dK, dV (one CTA per 128 keys of a kv head), then dQ (per 128 queries).

    ``fused``: the dK/dV kernel adds dQ's shares into an f32 dQ and the dQ
    kernel is not launched (:class:`BackwardConfig`); its named regions add
    ``dq``, and its shared memory leaves the profiler less room (about 35
    steps a CTA at head_dim 128).
    ``profile_dir``: as :func:`fp8jax.kernels.attention.mosaic_forward`'s: each
    kernel's named regions (``wait``, ``scores``, ``dp``, ``dv_dk`` or ``dq``,
    ``epilogue``; ``wait_free`` and ``load`` in the memory warpgroup) traced by
    Mosaic GPU's profiler, whose buffer shares shared memory with the kernel's:
    at head_dim 128 it fits up to about 100 steps a CTA (sequences of 2048 at
    three query heads a kv head).
    """
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    batch, tq, heads, d = q8.shape
    tk, kv_heads = k8.shape[1], k8.shape[2]
    group = heads // kv_heads
    rows, step = fwd.WG_ROWS, STEP_ROWS
    f8 = fwd.FP8
    operands = (q8, k8, q_scale, k_scale, q, k, v, do, lse2, delta)
    options = dict(causal=causal, scale=scale, group=group, stages=stages, paired=paired,
                   interpreted=interpret is not None)  # fmt: skip

    def launch(body, name, grid, grid_names, out_type, scratch, barriers, steps, initial=None):
        """The kernel's outputs; ``initial``: their values before it runs (arrays), when the
        kernel adds into them, else the outputs are ``out_type``'s, written by the kernel."""

        def entry(*refs):
            pl.run_scoped(lambda *scoped: body(*refs, *scoped), *scratch, *barriers,
                          collective_axes="wg")  # fmt: skip

        params = dict(compiler_params=plgpu.CompilerParams(
            approx_math=True, **fwd.profiling(profile_dir, steps, per_step=8)),
            interpret=interpret)  # fmt: skip
        mesh = dict(grid=grid, grid_names=grid_names, num_threads=3, thread_name="wg",
                    kernel_name=name)  # fmt: skip
        if initial is None:
            return plgpu.kernel(entry, out_type=out_type, **mesh, **params)(*operands)

        # Outputs that start as given are refs aliased in and out: run_state's,
        # mapped over the mesh by core_map, which keeps the kernel's name (a Ref
        # operand of plgpu.kernel does not pass its custom_vmap, and pl.kernel's
        # aliasing of one renames the kernel).
        def stateful(refs):
            @pl.core_map(plgpu.Mesh(**mesh), name=name, **params)
            def _kernel():
                entry(*refs)

        return pl.run_state(stateful)((*operands, *initial))[len(operands) :]

    kv_struct = jax.ShapeDtypeStruct(k8.shape, BF16)
    # Fused, dK's buffer also holds K, whose halves of columns are dQ's B operands.
    dk_buffer = _smem(plgpu, (2, rows, d), BF16, d // 2 if fused else d)
    scratch = [_smem(plgpu, (2, rows, d), f8), _smem(plgpu, (2, rows, d), BF16),
               plgpu.SMEM((2, rows), jnp.float32), dk_buffer,
               _smem(plgpu, (stages, step, d), f8), _smem(plgpu, (stages, step, d), BF16),
               _smem(plgpu, (stages, step, d), BF16),
               *[plgpu.SMEM((stages, step), jnp.float32)] * 3]  # fmt: skip
    barriers = [plgpu.Barrier(num_barriers=8 if fused else 6),
                [plgpu.Barrier(num_barriers=stages)] * 6,
                plgpu.Barrier(num_arrivals=2, num_barriers=stages)]  # fmt: skip
    dkv = functools.partial(
        launch, functools.partial(_dkv_kernel, fused=fused, **options), DKV_KERNEL,
        (kv_heads, tk // fwd.CTA_ROWS, batch), ("heads", "k", "batch"), (kv_struct, kv_struct),
    )  # fmt: skip
    if fused:
        # dSᵀ by warpgroup (keys by queries), swizzled as K's column halves: the
        # product's two shared-memory operands share a swizzle. dQ's staging.
        scratch += [_smem(plgpu, (2, rows, step), BF16, d // 2),
                    _smem(plgpu, (2, step, d // 2), jnp.float32)]  # fmt: skip
        barriers.append(plgpu.Barrier(num_arrivals=2, num_barriers=2))  # dS stored, dS read
        initial = (jnp.zeros(q8.shape, jnp.float32), *[jnp.zeros(k8.shape, BF16)] * 2)
        dq_sum, dk, dv = dkv(scratch, barriers, group * tq // step, initial)
        dq = (dq_sum * scale).astype(BF16)
        return dispatch.varying_like((dq, dk, dv), operands)
    dk, dv = dkv(scratch, barriers, group * tq // step)
    (dq,) = launch(
        functools.partial(_dq_kernel, **options), DQ_KERNEL,
        (heads, tq // fwd.CTA_ROWS, batch), ("heads", "q", "batch"),
        (jax.ShapeDtypeStruct(q8.shape, BF16),),
        [_smem(plgpu, (2, rows, d), f8), _smem(plgpu, (2, rows, d), BF16),
         *[plgpu.SMEM((2, rows), jnp.float32)] * 3, _smem(plgpu, (2, rows, d), BF16),
         _smem(plgpu, (stages, step, d), f8), _smem(plgpu, (stages, step, d), BF16),
         _smem(plgpu, (stages, step, d), BF16), plgpu.SMEM((stages, step), jnp.float32)],
        [plgpu.Barrier(num_barriers=10), [plgpu.Barrier(num_barriers=stages)] * 4,
         plgpu.Barrier(num_arrivals=2, num_barriers=stages)],
        tk // step,
    )  # fmt: skip
    return dispatch.varying_like((dq, dk, dv), operands)

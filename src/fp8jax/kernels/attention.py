"""FP8 flash attention's forward: QKᵀ and PV on E4M3 tensor cores, online softmax in f32.

Operands arrive quantized (:mod:`fp8jax.ops.attention` does it): ``q8``
(B, Tq, H, D) and ``k8`` (B, Tk, Hkv, D) in E4M3 with one scale per
:data:`BLOCK` rows and head, and V transposed, ``vt8`` (B, Hkv, D, Tk),
because Hopper's FP8 ``wgmma`` takes both operands K-major: for PV the
contraction runs over keys, so keys must be V's minor axis. The scales go
in expanded so that the kernel loads them as vectors, never as scalars:
``q_scale`` (B, H, Tq) per query row (it also carries softmax's scale and
log2(e), so the scores come out in base-2 units), ``k_scale`` (B, Hkv, Tk)
per key and ``v_scale`` (B, Hkv, Tk // BLOCK, D) per block of keys along
the head dimension (divided by :data:`P_SCALE`).

Per block of :data:`BLOCK` keys, a query row's scores
``s = (q8 . k8ᵀ) * q_scale * k_scale`` (masked under causality) update the
running max ``m`` and sum ``l``; ``p = exp2(s - m)`` lies in [0, 1] and is
quantized as ``p * P_SCALE`` to E4M3 before the PV product, whose fresh
f32 result is added, scaled by the block's ``v_scale``, to the accumulator
rescaled by ``exp2(m_old - m)``. The output is ``acc / l`` and the saved
residual the base-2 logsumexp ``m + log2(l)``. No Tq x Tk array exists:
the XLA twin (:func:`xla_forward`, the CPU's path and the kernel's test
reference) walks the same key blocks in a loop with the same operations.

The Mosaic GPU kernel (:func:`mosaic_forward`) follows FlashAttention-3's
warp specialization: per CTA, 128 query rows of one head, two compute
warpgroups of 64 rows each and a memory warpgroup streaming K, Vᵀ and their
scales through a ring of shared-memory slots by TMA. P goes through shared
memory to the PV ``wgmma`` (8 KiB a warpgroup): the FP8 accumulator layout
differs from the FP8 register-operand layout, and one path serves both the
GPU and the interpreter, which reads ``wgmma`` operands from shared memory.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.kernels import dispatch

BLOCK = 128  # rows (queries or keys) that share one scale, and keys a kernel step
WG_ROWS = 64  # query rows per compute warpgroup: wgmma's M
CTA_ROWS = 2 * WG_ROWS  # one Q scale block a CTA
# P in [0, 1] times 2**8: 1 maps to 256 < 448 (E4M3's largest), exactly, being a
# power of two; values down to 2**-14 stay normal (3 mantissa bits) and down
# to 2**-17 subnormal, where unscaled E4M3 would flush everything below 2**-9.
P_SCALE = 256.0
LOG2E = math.log2(math.e)
STAGES = 2  # key blocks in flight in shared memory
HEAD_DIMS = (64, 128)
KERNEL_NAME = "fp8jax_attention_fwd"
FP8 = jnp.float8_e4m3fn


def fits(q_shape, k_shape) -> bool:
    """Whether the kernel takes these shapes: whole blocks of queries and keys, D 64 or 128."""
    (_, tq, _, d), (_, tk, _, _) = q_shape, k_shape
    return d in HEAD_DIMS and tq % CTA_ROWS == 0 and tk % BLOCK == 0


def forward(q8, k8, vt8, q_scale, k_scale, v_scale, *, causal: bool):
    """``(out bf16 (B, Tq, H, D), lse2 f32 (B, H, Tq))``: the kernel on NVIDIA GPUs, else XLA."""
    placement = dispatch.decide(lambda shards: fits_shards(q8.shape, k8.shape, shards))
    xla = functools.partial(xla_forward, causal=causal)
    operands = (q8, k8, vt8, q_scale, k_scale, v_scale)
    if not placement.kernel:
        return xla(*operands)
    pallas = functools.partial(mosaic_forward, causal=causal)
    # Every operand and result leads with the batch, which data parallelism splits.
    return dispatch.on_each_device(
        pallas, xla, operands, len(operands), ("rows", "rows"), placement.row_axes
    )


def fits_shards(q_shape, k_shape, shards: int) -> bool:
    """:func:`fits`, on each device's share of the batch when ``shards`` devices split it."""
    return q_shape[0] % shards == 0 and fits(q_shape, k_shape)


def xla_forward(q8, k8, vt8, q_scale, k_scale, v_scale, *, causal: bool):
    """The kernel's arithmetic in XLA, one key block a loop step: the twin and the reference."""
    batch, tq, heads, d = q8.shape
    kv_heads, tk = k8.shape[2], k8.shape[1]
    group = heads // kv_heads
    blocks = tk // BLOCK
    # (B, Hkv, G, Tq, D): each kv head with its group of query heads.
    q = jnp.transpose(q8.reshape(batch, tq, kv_heads, group, d), (0, 2, 3, 1, 4))
    qs = q_scale.reshape(batch, kv_heads, group, tq, 1)
    k_blocks = jnp.transpose(k8.reshape(batch, blocks, BLOCK, kv_heads, d), (1, 0, 3, 2, 4))
    ks_blocks = jnp.transpose(k_scale.reshape(batch, kv_heads, blocks, BLOCK), (2, 0, 1, 3))
    vt_blocks = jnp.moveaxis(vt8.reshape(batch, kv_heads, d, blocks, BLOCK), 3, 0)
    vs_blocks = jnp.moveaxis(v_scale, 2, 0)  # (blocks, B, Hkv, D)
    rows = lax.broadcasted_iota(jnp.int32, (tq, BLOCK), 0)
    cols = lax.broadcasted_iota(jnp.int32, (tq, BLOCK), 1)

    def step(carry, xs):
        acc, m, l = carry
        j, kb, ksb, vtb, vsb = xs
        s = jnp.einsum("bhgqd,bhkd->bhgqk", q, kb, preferred_element_type=jnp.float32)
        s = s * qs * ksb[:, :, None, None, :]
        if causal:
            s = jnp.where(rows >= cols + j * BLOCK, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[..., None])
        l = l * alpha + jnp.sum(p, axis=-1)
        p8 = (p * P_SCALE).astype(FP8)
        pv = jnp.einsum("bhgqk,bhdk->bhgqd", p8, vtb, preferred_element_type=jnp.float32)
        acc = acc * alpha[..., None] + pv * vsb[:, :, None, None, :]
        return (acc, m_new, l), None

    init = (
        jnp.zeros((batch, kv_heads, group, tq, d), jnp.float32),
        jnp.full((batch, kv_heads, group, tq), -jnp.inf, jnp.float32),
        jnp.zeros((batch, kv_heads, group, tq), jnp.float32),
    )
    xs = (jnp.arange(blocks, dtype=jnp.int32), k_blocks, ks_blocks, vt_blocks, vs_blocks)
    (acc, m, l), _ = lax.scan(step, init, xs)
    out = acc / l[..., None]
    out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(batch, tq, heads, d)
    lse2 = (m + jnp.log2(l)).reshape(batch, heads, tq)
    return out.astype(jnp.bfloat16), lse2


def _smem_transforms(plgpu, columns: int, dtype) -> tuple:
    """Shared-memory tiling and swizzle for rows of ``columns`` elements of ``dtype``."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(columns * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _kernel(q_ref, k_ref, vt_ref, qs_ref, ks_ref, vs_ref, out_ref, lse_ref, scoped, *,
            causal: bool, stages: int, group: int, interpreted: bool):  # fmt: skip
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    # The interpreter has no rules for layouts (plgpu.load, layout_cast, iota's
    # layout) and needs none: there these are plain loads, values and iotas.
    def load(ref, layout):
        return ref[...] if interpreted else plgpu.load(ref, (), layout=layout)

    def laid_out(x, layout):
        return x if interpreted else plgpu.layout_cast(x, layout)

    def mma(a_smem, bt_smem, shape, issued=lambda: None):
        """``a . btᵀ`` in f32, both operands K-major in shared memory: FP8 wgmma.

        ``issued`` runs between issuing the MMA and waiting for it.
        """
        if interpreted:  # the interpreter's wgmma takes no transposed operand
            issued()
            return lax.dot_general(a_smem[...], bt_smem[...], (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)  # fmt: skip

        def product(ref):
            plgpu.wgmma(ref, a_smem, plgpu.transpose_ref(bt_smem, (1, 0)))
            issued()
            return ref[...]  # waits for the MMA

        return pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))

    def iota(shape, axis):
        if interpreted:
            return lax.broadcasted_iota(jnp.int32, shape, axis)
        return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)

    (q_smem2, p_smem2, o_smem2, qs_smem2, lse_smem2, k_smem, vt_smem, ks_smem, vs_smem), bars = (
        scoped
    )
    q_bars, k_bars, vt_bars, ks_bars, vs_bars, k_done, v_done, turn = bars

    def take_turn():
        # FlashAttention-3's ping-pong: the two compute warpgroups alternate on
        # the tensor cores, one's softmax running under the other's MMAs.
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    d = q_ref.shape[-1]
    kv_blocks = k_ref.shape[1] // BLOCK
    batch, head, q_tile = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q")
    kv_head = lax.div(head, jnp.array(group, head.dtype))
    wg = lax.axis_index("wg")
    # Under causality the CTA's 128 rows are one key block: both warpgroups stop
    # at the diagonal block, and only that block is masked.
    steps = q_tile + 1 if causal else kv_blocks

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        base = q_tile * CTA_ROWS + wg * WG_ROWS
        q_smem, p_smem, o_smem = q_smem2.at[wg], p_smem2.at[wg], o_smem2.at[wg]
        qs_smem, lse_smem = qs_smem2.at[wg], lse_smem2.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(base, WG_ROWS), head], q_smem, q_bars.at[wg])
        plgpu.copy_gmem_to_smem(qs_ref.at[batch, head, pl.ds(base, WG_ROWS)], qs_smem,
                                q_bars.at[2 + wg])  # fmt: skip
        plgpu.barrier_wait(q_bars.at[wg])
        plgpu.barrier_wait(q_bars.at[2 + wg])
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        col_layout = plgpu.Layout.WGMMA.reduce(0)
        qs = load(qs_smem, row_layout)
        carry = (
            laid_out(jnp.zeros((WG_ROWS, d), jnp.float32), plgpu.Layout.WGMMA),
            laid_out(jnp.full((WG_ROWS,), -jnp.inf, jnp.float32), row_layout),
            laid_out(jnp.zeros((WG_ROWS,), jnp.float32), row_layout),
        )

        def kv_step(j, carry, masked: bool):
            acc, m, l = carry
            slot = lax.rem(j, jnp.array(stages, j.dtype))
            plgpu.barrier_wait(k_bars.at[slot])
            plgpu.barrier_wait(ks_bars.at[slot])
            s = mma(q_smem, k_smem.at[slot], (WG_ROWS, BLOCK), issued=take_turn)
            ks = load(ks_smem.at[slot], col_layout)
            shape = (WG_ROWS, BLOCK)
            s = s * lax.broadcast_in_dim(qs, shape, [0]) * lax.broadcast_in_dim(ks, shape, [1])
            plgpu.barrier_arrive(k_done.at[slot])
            if masked:
                s = jnp.where(iota(shape, 0) + base >= iota(shape, 1) + j * BLOCK, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, shape, [0]))
            l = l * alpha + p.sum(axis=1)
            p_smem[...] = (p * P_SCALE).astype(FP8)
            plgpu.commit_smem()
            plgpu.barrier_arrive(turn)  # this softmax is done
            plgpu.barrier_wait(vt_bars.at[slot])
            plgpu.barrier_wait(vs_bars.at[slot])
            plgpu.barrier_wait(turn)  # the tensor cores are this warpgroup's
            pv = mma(p_smem, vt_smem.at[slot], (WG_ROWS, d))
            vs = load(vs_smem.at[slot], col_layout)
            plgpu.barrier_arrive(v_done.at[slot])
            acc = (acc * lax.broadcast_in_dim(alpha, (WG_ROWS, d), [0])
                   + pv * lax.broadcast_in_dim(vs, (WG_ROWS, d), [1]))  # fmt: skip
            return acc, m_new, l

        pl.when(wg == 1)(take_turn)  # warpgroup 0 goes first
        if causal:
            carry = lax.fori_loop(0, steps - 1, functools.partial(kv_step, masked=False), carry)
            acc, m, l = kv_step(steps - 1, carry, masked=True)
        else:
            acc, m, l = lax.fori_loop(0, steps, functools.partial(kv_step, masked=False), carry)
        pl.when(wg == 0)(take_turn)  # as many turns as warpgroup 1
        o_smem[...] = (acc / lax.broadcast_in_dim(l, (WG_ROWS, d), [0])).astype(o_smem.dtype)
        lse_smem[...] = m + jnp.log2(l)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_ref.at[batch, pl.ds(base, WG_ROWS), head])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, pl.ds(base, WG_ROWS)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def load(j, slot):
            keys = pl.ds(j * BLOCK, BLOCK)
            plgpu.copy_gmem_to_smem(k_ref.at[batch, keys, kv_head], k_smem.at[slot],
                                    k_bars.at[slot])  # fmt: skip
            plgpu.copy_gmem_to_smem(ks_ref.at[batch, kv_head, keys], ks_smem.at[slot],
                                    ks_bars.at[slot])  # fmt: skip
            plgpu.copy_gmem_to_smem(vt_ref.at[batch, kv_head, :, keys], vt_smem.at[slot],
                                    vt_bars.at[slot])  # fmt: skip
            plgpu.copy_gmem_to_smem(vs_ref.at[batch, kv_head, j], vs_smem.at[slot],
                                    vs_bars.at[slot])  # fmt: skip

        @pl.loop(0, steps)
        def _step(j):
            slot = lax.rem(j, jnp.array(stages, j.dtype))

            @pl.when(j >= stages)  # the slot's previous block is consumed by both warpgroups
            def _wait():
                plgpu.barrier_wait(k_done.at[slot])
                plgpu.barrier_wait(v_done.at[slot])

            load(j, slot)

        # Observe the last blocks' consumption too, so that every barrier phase is
        # waited for before the CTA's barriers go (the interpreter checks this).
        @pl.loop(lax.max(steps - stages, 0), steps)
        def _drain(j):
            slot = lax.rem(j, jnp.array(stages, j.dtype))
            plgpu.barrier_wait(k_done.at[slot])
            plgpu.barrier_wait(v_done.at[slot])


def mosaic_forward(q8, k8, vt8, q_scale, k_scale, v_scale, *, causal: bool,
                   stages: int = STAGES, interpret=None):  # fmt: skip
    """The kernel: one CTA per (head, 128 query rows, batch element); see the module docstring.

    ``interpret``: a Mosaic GPU interpreter's parameters (tests), or None to compile.
    """
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    batch, tq, heads, d = q8.shape
    kv_heads = k8.shape[2]
    qk = _smem_transforms(plgpu, d, FP8)
    keys = _smem_transforms(plgpu, BLOCK, FP8)
    out_t = _smem_transforms(plgpu, d, jnp.bfloat16)

    def entry(*refs):
        scratch = [
            plgpu.SMEM((2, WG_ROWS, d), FP8, transforms=qk),  # Q
            plgpu.SMEM((2, WG_ROWS, BLOCK), FP8, transforms=keys),  # P
            plgpu.SMEM((2, WG_ROWS, d), jnp.bfloat16, transforms=out_t),  # O
            plgpu.SMEM((2, WG_ROWS), jnp.float32),  # Q's scales
            plgpu.SMEM((2, WG_ROWS), jnp.float32),  # the logsumexp
            plgpu.SMEM((stages, BLOCK, d), FP8, transforms=qk),  # K
            plgpu.SMEM((stages, d, BLOCK), FP8, transforms=keys),  # Vᵀ
            plgpu.SMEM((stages, BLOCK), jnp.float32),  # K's scales
            plgpu.SMEM((stages, d), jnp.float32),  # V's scales
        ]
        barriers = (
            plgpu.Barrier(num_barriers=4),  # Q and its scales, per warpgroup
            *[plgpu.Barrier(num_barriers=stages)] * 4,  # K, Vᵀ, their scales: loaded
            *[plgpu.Barrier(num_arrivals=2, num_barriers=stages)] * 2,  # K, Vᵀ: consumed
            plgpu.Barrier(num_arrivals=2),  # whose turn on the tensor cores
        )
        body = functools.partial(_kernel, causal=causal, stages=stages, group=heads // kv_heads,
                                 interpreted=interpret is not None)  # fmt: skip
        pl.run_scoped(
            lambda *scoped: body(*refs, (scoped[:9], scoped[9:])),
            *scratch,
            *barriers,
            collective_axes="wg",
        )

    out_type = (jax.ShapeDtypeStruct(q8.shape, jnp.bfloat16),
                jax.ShapeDtypeStruct((batch, heads, tq), jnp.float32))  # fmt: skip
    kernel = plgpu.kernel(
        entry,
        out_type=out_type,
        grid=(heads, tq // CTA_ROWS, batch),
        grid_names=("heads", "q", "batch"),
        num_threads=3,  # two compute warpgroups and the memory one
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        kernel_name=KERNEL_NAME,
        interpret=interpret,
    )
    operands = (q8, k8, vt8, q_scale, k_scale, v_scale)
    return dispatch.varying_like(kernel(*operands), operands)

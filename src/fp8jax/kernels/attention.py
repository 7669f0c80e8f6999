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
``s = (q8 . k8ᵀ) * c``, ``c = q_scale * k_scale`` (masked under causality),
update the running max ``m`` and sum ``l``; ``p = exp2(s - m)`` lies in
[0, 1] and is quantized as ``p * P_SCALE`` to E4M3 before the PV product,
whose fresh f32 result is added, scaled by the block's ``v_scale``, to the
accumulator rescaled by ``exp2(m_old - m)``. The output is ``acc / l`` and
the saved residual the base-2 logsumexp ``m + log2(l)``. As FlashAttention-3
does, the max is taken over the raw products (times ``c``, positive, after)
and ``p * P_SCALE = exp2(raw * c - (m - log2(P_SCALE)))`` is one FMA and one
``ex2`` a score, ``l`` summing ``p * P_SCALE`` (divided out, exactly, at the
end): the softmax's f32 work shares the SM with the FP8 MMAs
(docs/design.md#fp8-attention). No Tq x Tk array exists:
the XLA twin (:func:`xla_forward`, the CPU's path and the kernel's test
reference) walks the same key blocks in a loop with the same operations.

The Mosaic GPU kernel (:func:`mosaic_forward`) follows FlashAttention-3's
warp specialization: per CTA, 128 query rows of one head, two compute
warpgroups of 64 rows each and a memory warpgroup streaming K, Vᵀ and their
scales through a ring of shared-memory slots by TMA. By default P goes
through shared memory to the PV ``wgmma`` (8 KiB a warpgroup): the FP8
accumulator layout differs from the FP8 register-operand layout.
:class:`ForwardConfig` builds other pipelines for A/B timing (issue 60):
P as the register operand (its keys relabelled, Vᵀ's permuted to match),
FlashAttention-3's intra-warpgroup overlap, PV accumulated in place, more
stages, no ping-pong. All compute the default's FP8 products and f32 steps
(the interpreter's outputs are bitwise the default's); on the GPU only the
tensor cores' sums may differ (docs/design.md#fp8-attention). One build
changes a value: ``fma_exp2`` takes a share of the exponentials as a cubic
on the FP32 pipes (:mod:`fp8jax.kernels.exp2`), off the MUFU.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.kernels import dispatch
from fp8jax.kernels.exp2 import split_exp2

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
# FP8 wgmma's register A operand holds 4 consecutive keys a thread (PTX's
# 8-bit A fragment), its f32 accumulator 2 (the 32-bit D fragment). Read as
# the A operand in place, the scores' registers give A's key a (within each
# 16) the accumulator's column KEY_ORDER[a]; Vᵀ's keys are stored in that
# order instead, so PV's products pair the same keys (tests model both
# fragments from the PTX documentation).
KEY_ORDER = tuple(8 * u + 2 * c + e for c in range(4) for u in range(2) for e in range(2))


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """How the forward kernel is built; only ``fma_exp2`` changes an f32 step (none a product).

    Frozen and hashable: it reaches the kernel as a static argument, so it is
    part of ``jit``'s cache key (a new value compiles a new kernel).

    Attributes:
      stages: key blocks (K, Vᵀ and their scales) in flight in shared memory.
      overlap: FlashAttention-3's intra-warpgroup pipelining: a warpgroup
        issues block j+1's QKᵀ and block j's PV together, then runs block
        j+1's softmax while PV(j) is on the tensor cores (one more f32 tile
        live in registers: at head_dim 128 ptxas spills 100 to 500 bytes a
        thread, deviceless; none at 64).
      p_registers: P enters the PV ``wgmma`` as its register A operand, not
        through shared memory: the FP8 scores' registers are read in place
        as the operand (:data:`KEY_ORDER`) and Vᵀ's keys are stored permuted
        to match. The products are the same; the tensor cores' summation
        order within a block may differ. Interpreted, P's columns and Vᵀ's
        keys are permuted as values.
      pingpong: the two compute warpgroups take turns on the tensor cores
        (FlashAttention-3's ping-pong): one's softmax runs under the other's
        MMAs. False: the warpgroups run unsynchronized.
      row_scales: V's scale, one value a key block (the op expands it), is
        read as a row vector of its first 64 entries, 2 registers a thread,
        not 32 (d 128) as a column vector; the same multiplies. K's scale is
        always read so: it joins Q's row scale in one factor a row.
      registers: per compute thread (``setmaxnreg``); 240 leaves the memory
        warpgroup 32 (FlashAttention-3's split is 240 and 24).
      pv_in_place: PV accumulates into the output's accumulator on the
        tensor cores (FlashAttention-3's), which is first rescaled by alpha
        times the ratio of the previous and this block's V scales (powers of
        two, so exactly), and times the last block's at the end: no fresh
        f32 tile (64 registers at d 128) and no scaling add a block. The
        f32 steps are the default's; on the GPU the sum across blocks then
        has the tensor cores' accumulation precision, not f32 adds'.
      fma_exp2: of each block's 128 scores a row, how many (its last ones, a
        multiple of 8) take their exp2 as :func:`fp8jax.kernels.exp2.exp2_cubic`
        on the FP32 pipes instead of MUFU's ``ex2``, which at head_dim 128
        needs as many cycles as the block's FP8 products at peak
        (FlashAttention-4's split). The one field that changes an f32 step:
        P's exponentials, by at most 1.02e-4 relatively against E4M3's 2**-4
        rounding of P; the XLA twin (:func:`xla_forward`) takes the same split.
      longest_first: under causality a CTA's work grows with its query tile;
        each batch element's tiles launch last (longest) first, so the short
        ones fill the grid's final wave instead of a few long ones running
        alone (FlashAttention-3's longest-first order). The batch stays the
        grid's slowest axis, so the CTAs in flight share one element's K and
        V in L2. Unmasked, every CTA's work is the same: the order is kept.
    """

    stages: int = STAGES
    overlap: bool = False
    p_registers: bool = False
    pingpong: bool = True
    row_scales: bool = False
    registers: int = 232
    pv_in_place: bool = False
    longest_first: bool = False
    fma_exp2: int = 0

    def __post_init__(self):
        if self.registers not in (232, 240):
            raise ValueError(
                f"ForwardConfig(registers=...) must be 232 or 240, got {self.registers!r}."
            )
        if not 2 <= self.stages <= 4:  # 4 slots of K and Vᵀ at d 128 use 128 KiB of 227
            raise ValueError(f"ForwardConfig(stages=...) must be in [2, 4], got {self.stages}.")
        fma = self.fma_exp2
        if isinstance(fma, bool) or not isinstance(fma, int) or not 0 <= fma <= BLOCK or fma % 8:
            raise ValueError(
                f"ForwardConfig(fma_exp2=...) must be a multiple of 8 in [0, {BLOCK}] (the "
                f"accumulator's 8-column tiles of a {BLOCK}-key block), got {fma!r}."
            )
        for name in (f.name for f in dataclasses.fields(self) if f.type == "bool"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"ForwardConfig({name}=...) must be a bool, got {getattr(self, name)!r}."
                )


DEFAULT_CONFIG = ForwardConfig()


def fits(q_shape, k_shape) -> bool:
    """Whether the kernel takes these shapes: whole blocks of queries and keys, D 64 or 128."""
    (_, tq, _, d), (_, tk, _, _) = q_shape, k_shape
    return d in HEAD_DIMS and tq % CTA_ROWS == 0 and tk % BLOCK == 0


def forward(q8, k8, vt8, q_scale, k_scale, v_scale, *, causal: bool,
            config: ForwardConfig = DEFAULT_CONFIG):  # fmt: skip
    """``(out bf16 (B, Tq, H, D), lse2 f32 (B, H, Tq))``: the kernel on NVIDIA GPUs, else XLA.

    ``config``: how the kernel is built (:class:`ForwardConfig`); XLA takes its
    ``fma_exp2`` (the one field that changes a value) and ignores the rest.
    """
    placement = dispatch.decide(lambda shards: fits_shards(q8.shape, k8.shape, shards))
    xla = functools.partial(xla_forward, causal=causal, fma_exp2=config.fma_exp2)
    operands = (q8, k8, vt8, q_scale, k_scale, v_scale)
    if not placement.kernel:
        return xla(*operands)
    pallas = functools.partial(mosaic_forward, causal=causal, config=config)
    # Every operand and result leads with the batch, which data parallelism splits.
    return dispatch.on_each_device(
        pallas, xla, operands, len(operands), ("rows", "rows"), placement.row_axes
    )


def fits_shards(q_shape, k_shape, shards: int) -> bool:
    """:func:`fits`, on each device's share of the batch when ``shards`` devices split it."""
    return q_shape[0] % shards == 0 and fits(q_shape, k_shape)


def xla_forward(q8, k8, vt8, q_scale, k_scale, v_scale, *, causal: bool, fma_exp2: int = 0):
    """The kernel's arithmetic in XLA, one key block a loop step: the twin and the reference.

    ``fma_exp2``: :class:`ForwardConfig`'s, the scores a block whose exp2 is the cubic.
    """
    batch, tq, heads, d = q8.shape
    kv_heads, tk = k8.shape[2], k8.shape[1]
    group = heads // kv_heads
    blocks = tk // BLOCK
    # (B, Hkv, G, Tq, D): each kv head with its group of query heads.
    q = jnp.transpose(q8.reshape(batch, tq, kv_heads, group, d), (0, 2, 3, 1, 4))
    qs = q_scale.reshape(batch, kv_heads, group, tq, 1)
    k_blocks = jnp.transpose(k8.reshape(batch, blocks, BLOCK, kv_heads, d), (1, 0, 3, 2, 4))
    # K's scale is one a block (expanded per key): its first entry.
    ks_blocks = jnp.moveaxis(k_scale.reshape(batch, kv_heads, blocks, BLOCK)[..., :1], 2, 0)
    vt_blocks = jnp.moveaxis(vt8.reshape(batch, kv_heads, d, blocks, BLOCK), 3, 0)
    vs_blocks = jnp.moveaxis(v_scale, 2, 0)  # (blocks, B, Hkv, D)
    rows = lax.broadcasted_iota(jnp.int32, (tq, BLOCK), 0)
    cols = lax.broadcasted_iota(jnp.int32, (tq, BLOCK), 1)

    def step(carry, xs):
        acc, m, l = carry
        j, kb, ksb, vtb, vsb = xs
        s = jnp.einsum("bhgqd,bhkd->bhgqk", q, kb, preferred_element_type=jnp.float32)
        c = qs * ksb[:, :, None, None, :]  # (B, Hkv, G, Tq, 1)
        if causal:
            s = jnp.where(rows >= cols + j * BLOCK, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1) * c[..., 0])
        alpha = jnp.exp2(m - m_new)
        p = split_exp2(s * c - (m_new - math.log2(P_SCALE))[..., None], fma_exp2)  # p x P_SCALE
        l = l * alpha + jnp.sum(p, axis=-1)
        p8 = p.astype(FP8)
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
    l = l * (1 / P_SCALE)
    out = acc / l[..., None]
    out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(batch, tq, heads, d)
    lse2 = (m + jnp.log2(l)).reshape(batch, heads, tq)
    return out.astype(jnp.bfloat16), lse2


def load_whole(plgpu, ref, layout):
    """``plgpu.load`` of all of ``ref``: jax 0.10 requires the index argument, jax 0.11
    deprecates passing one apart from the ref (a warning: an error under the tests' filters)."""
    idx = inspect.signature(plgpu.load).parameters.get("idx")
    if idx is not None and idx.default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def _smem_transforms(plgpu, columns: int, dtype) -> tuple:
    """Shared-memory tiling and swizzle for rows of ``columns`` elements of ``dtype``."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(columns * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _register_operand(plgpu, p8):
    """E4M3 ``p8`` (64, 128) in the accumulator's layout, read in place as wgmma's A operand.

    Each thread's two 2-key registers of 8-key columns ``2i`` and ``2i + 1``
    become one 4-key register of 16-key column ``i``: no data moves, and the
    operand's key ``16i + a`` is ``p8``'s column ``16i + KEY_ORDER[a]``.
    Mosaic GPU converts no FP8 array from its WGMMA layout to WGMMA_8BIT
    (``to_layout`` raises NotImplementedError: a real relayout needs warp
    shuffles), so the relabelling is written in Mosaic GPU itself.
    """
    import jax.experimental.mosaic.gpu as mgpu
    import numpy as np
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    out_type = plgpu.ShapeDtypeStruct(p8.shape, FP8, layout=plgpu.Layout.WGMMA_8BIT)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,), return_type=out_type)
    def relabel(_, x):
        old = x.registers
        new_shape = mgpu.WGMMA_LAYOUT_8BIT.registers_shape(x.shape)
        # Both layouts: (1, column tiles, 1, 1, row halves, 1, ...), 8 or 16 columns a tile.
        if old.shape[1] != 2 * new_shape[1] or old.shape[2:] != tuple(new_shape[2:]):
            raise NotImplementedError(
                f"P's registers {old.shape} do not pair into WGMMA_8BIT's {new_shape}."
            )
        new = np.empty(new_shape, dtype=object)
        for index in np.ndindex(*new_shape):
            pair = [old[(index[0], 2 * index[1] + h, *index[2:])] for h in (0, 1)]
            new[index] = mgpu_utils.vector_concat(pair)
        return mgpu.FragmentedArray(_registers=new, _layout=mgpu.WGMMA_LAYOUT_8BIT,
                                    _is_signed=None)  # fmt: skip

    return relabel(p8)


def _columns_joined(plgpu, a, b):
    """``a`` (rows, m) and ``b`` (rows, n), both in the WGMMA layout, as one (rows, m + n)
    array: their registers side by side (the layout's second register axis counts
    8-column tiles), no data moved; Mosaic GPU lowers no concatenation."""
    import jax.experimental.mosaic.gpu as mgpu
    import numpy as np

    shape = (a.shape[0], a.shape[1] + b.shape[1])
    out_type = plgpu.ShapeDtypeStruct(shape, a.dtype, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,) * 2, return_type=out_type)
    def join(_, x, y):
        registers = np.concatenate([x.registers, y.registers], axis=1)
        return mgpu.FragmentedArray(_registers=registers, _layout=x.layout, _is_signed=None)

    return join(a, b)


def permuted_keys(x, axis: int = -1):
    """``x`` with its keys along ``axis`` in :data:`KEY_ORDER` within each 16: P's operand's."""
    axis = axis % x.ndim
    n = x.shape[axis]
    split = x.reshape(*x.shape[:axis], n // 16, 2, 4, 2, *x.shape[axis + 1 :])
    # Source key 8u + 2c + e goes to place 4c + 2u + e: swap the (u, c) axes.
    return jnp.swapaxes(split, axis + 1, axis + 2).reshape(x.shape)


def _kernel(q_ref, k_ref, vt_ref, qs_ref, ks_ref, vs_ref, out_ref, lse_ref, scoped, *,
            causal: bool, config: ForwardConfig, group: int, interpreted: bool):  # fmt: skip
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    stages = config.stages

    def region(name):
        """A named region: its start and end in the SM's cycles when the kernel is
        profiled (``mosaic_forward(profile_dir=...)``); nothing otherwise."""

        def decorate(fn):
            @functools.wraps(fn)
            def within(*args, **kwargs):
                with jax.named_scope(name):
                    return fn(*args, **kwargs)

            return within

        return decorate

    # The interpreter has no rules for layouts (plgpu.load, layout_cast, iota's
    # layout) and needs none: there these are plain loads, values and iotas.
    def load(ref, layout):
        return ref[...] if interpreted else load_whole(plgpu, ref, layout)

    def laid_out(x, layout):
        return x if interpreted else plgpu.layout_cast(x, layout)

    def dot_t(a, bt_smem):
        """The interpreter's ``a . btᵀ``, ``a`` a value (its wgmma takes no transposed operand)."""
        return lax.dot_general(a, bt_smem[...], (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)  # fmt: skip

    def mma(a, bt_smem, shape, issued=lambda: None, a_value: bool = False):
        """``a . btᵀ`` in f32 by FP8 wgmma, ``bt`` K-major in shared memory.

        ``a``: a K-major shared-memory ref, or (``a_value``) P's register
        operand (:func:`p_operand`). ``issued`` runs between issuing the MMA
        and waiting for it.
        """
        if interpreted:
            issued()
            return dot_t(a if a_value else a[...], bt_smem)

        def product(ref):
            plgpu.wgmma(ref, a, plgpu.transpose_ref(bt_smem, (1, 0)))
            issued()
            return ref[...]  # waits for the MMA

        return pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))

    def exp2_scores(x):
        """exp2 of a block's scores, ``config.fma_exp2`` of each row's on the FP32 pipes."""
        joined = None if interpreted else functools.partial(_columns_joined, plgpu)
        return split_exp2(x, config.fma_exp2, joined)

    def iota(shape, axis):
        if interpreted:
            return lax.broadcasted_iota(jnp.int32, shape, axis)
        return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)

    (q_smem2, p_smem2, o_smem2, qs_smem2, lse_smem2, k_smem, vt_smem, ks_smem, vs_smem), bars = (
        scoped
    )
    q_bars, k_bars, vt_bars, ks_bars, vs_bars, k_done, v_done, turn = bars

    # FlashAttention-3's ping-pong: the two compute warpgroups alternate on the
    # tensor cores, one's softmax running under the other's MMAs.
    def turn_arrive():
        if config.pingpong:
            plgpu.barrier_arrive(turn)

    @region("turn_wait")
    def turn_wait():
        if config.pingpong:
            plgpu.barrier_wait(turn)

    def take_turn():
        turn_arrive()
        turn_wait()

    d = q_ref.shape[-1]
    kv_blocks = k_ref.shape[1] // BLOCK
    batch, head, q_tile = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q")
    if config.longest_first:  # walked from the last tile
        q_tile = q_ref.shape[1] // CTA_ROWS - 1 - q_tile
    kv_head = lax.div(head, jnp.array(group, head.dtype))
    wg = lax.axis_index("wg")
    # Under causality the CTA's 128 rows are one key block: both warpgroups stop
    # at the diagonal block, and only that block is masked.
    steps = q_tile + 1 if causal else kv_blocks

    def slot_of(j):
        j = jnp.asarray(j, jnp.int32)
        return lax.rem(j, jnp.array(stages, j.dtype))

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(config.registers, action="increase")
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
        shape = (WG_ROWS, BLOCK)
        carry = (
            laid_out(jnp.zeros((WG_ROWS, d), jnp.float32), plgpu.Layout.WGMMA),
            laid_out(jnp.full((WG_ROWS,), -jnp.inf, jnp.float32), row_layout),
            laid_out(jnp.zeros((WG_ROWS,), jnp.float32), row_layout),
        )

        def block_scale(ref, columns):
            """A key block's scale along ``columns``: 2 registers a thread (a row
            vector of its first 64 entries, all equal) or one a column."""
            if config.row_scales:
                return lax.broadcast_in_dim(load(ref.at[pl.ds(0, WG_ROWS)], row_layout),
                                            (WG_ROWS, columns), [0])  # fmt: skip
            return lax.broadcast_in_dim(load(ref, col_layout), (WG_ROWS, columns), [1])

        def scaled(s, j):
            """Block j's raw scores and, per row, their factor to base-2 units (Q's
            row scale times the block's one K scale); K's slot is released."""
            slot = slot_of(j)
            ks = load(ks_smem.at[slot, pl.ds(0, WG_ROWS)], row_layout)  # all entries equal
            plgpu.barrier_arrive(k_done.at[slot])
            return s, qs * ks

        @region("softmax")
        def softmax(s_c, j, m, l, masked: bool):
            """``(p, m_new, alpha, l_new)`` from block j's :func:`scaled` scores, with
            p and l in units of 1 / P_SCALE (docs/design.md#fp8-attention)."""
            s, c = s_c
            if masked:
                s = jnp.where(iota(shape, 0) + base >= iota(shape, 1) + j * BLOCK, s, -jnp.inf)
            # The factor is positive: the row max of the raw scores, scaled, is
            # the scaled scores' max exactly (rounding is monotonic).
            m_new = jnp.maximum(m, s.max(axis=1) * c)
            alpha = jnp.exp2(m - m_new)
            # One FMA a score: the scaling, the max and P_SCALE folded into exp2's argument.
            row = lambda x: lax.broadcast_in_dim(x, shape, [0])  # noqa: E731
            p = exp2_scores(s * row(c) - row(m_new - math.log2(P_SCALE)))
            return p, m_new, alpha, l * alpha + p.sum(axis=1)

        @region("p_operand")
        def p_operand(p8):
            """E4M3 P x 2**8 as the PV MMA's A operand: in shared memory, or registers."""
            if not config.p_registers:
                p_smem[...] = p8
                plgpu.commit_smem()
                return p_smem
            if interpreted:  # the operand's columns as the GPU reads the registers
                return permuted_keys(p8)
            return _register_operand(plgpu, p8)

        def accumulated(acc, pv, alpha, j):
            """The accumulator at the new max plus block j's PV; Vᵀ's slot is released."""
            slot = slot_of(j)
            vs = block_scale(vs_smem.at[slot], d)
            plgpu.barrier_arrive(v_done.at[slot])
            return acc * lax.broadcast_in_dim(alpha, (WG_ROWS, d), [0]) + pv * vs

        def vs_row(j):
            """Block j's V scale as a row vector (all its entries are the block's one)."""
            return load(vs_smem.at[slot_of(j), pl.ds(0, WG_ROWS)], row_layout)

        def rescaled(acc, alpha, vs_prev, vs):
            """pv_in_place: the accumulator at block j's max, in units of its V scale."""
            return acc * lax.broadcast_in_dim(alpha * (vs_prev / vs), (WG_ROWS, d), [0])

        def pv_into(acc, a, vt_smem_slot):
            """``acc + a . vtᵀ``, accumulated by the tensor cores (waits for it)."""
            if interpreted:
                return acc + dot_t(a if config.p_registers else a[...], vt_smem_slot)

            def product(ref):
                plgpu.wgmma(ref, a, plgpu.transpose_ref(vt_smem_slot, (1, 0)))

            return pl.run_state(product)(plgpu.ACC.init(acc))

        @region("wait_k")
        def wait_k(j):
            slot = slot_of(j)
            plgpu.barrier_wait(k_bars.at[slot])
            plgpu.barrier_wait(ks_bars.at[slot])

        @region("wait_v")
        def wait_v(j):
            slot = slot_of(j)
            plgpu.barrier_wait(vt_bars.at[slot])
            plgpu.barrier_wait(vs_bars.at[slot])

        def kv_step(j, carry, masked: bool):
            acc, m, l, *vs_prev = carry
            slot = slot_of(j)
            wait_k(j)
            with jax.named_scope("qk"):  # issued, the turn passed, waited for
                s = scaled(mma(q_smem, k_smem.at[slot], shape, issued=take_turn), j)
            p, m_new, alpha, l = softmax(s, j, m, l, masked)
            a = p_operand(p.astype(FP8))
            turn_arrive()  # this softmax is done
            wait_v(j)
            if config.pv_in_place:
                vs = vs_row(j)
                acc = rescaled(acc, alpha, *vs_prev, vs)
                turn_wait()  # the tensor cores are this warpgroup's
                acc = pv_into(acc, a, vt_smem.at[slot])
                plgpu.barrier_arrive(v_done.at[slot])
                return acc, m_new, l, vs
            turn_wait()  # the tensor cores are this warpgroup's
            with jax.named_scope("pv"):  # issued, waited for, added to the rescaled accumulator
                pv = mma(a, vt_smem.at[slot], (WG_ROWS, d), a_value=config.p_registers)
                return accumulated(acc, pv, alpha, j), m_new, l

        def carried(a):  # a ref cannot be a loop's carry: P's shared memory is implied
            return a if config.p_registers else None

        def operand(carried_a):
            return carried_a if config.p_registers else p_smem

        def overlapped_step(j, carry, masked: bool):
            """QKᵀ(j+1) and PV(j) issued together; softmax(j+1) runs while PV(j) does."""
            if config.pv_in_place:
                return overlapped_in_place(j, carry, masked)
            acc, m, l, alpha, a = carry
            a = operand(a)
            wait_k(j + 1)
            wait_v(j)
            turn_wait()

            def rest(s_next, pv):
                turn_arrive()
                turn_wait()
                p, m_new, alpha_next, l_new = softmax(scaled(s_next(), j + 1), j + 1, m, l, masked)
                p8 = p.astype(FP8)  # 16 registers, not 64, wait for PV(j)
                acc_new = accumulated(acc, pv(), alpha, j)  # PV(j) has read P(j): P(j+1) may go
                a_next = carried(p_operand(p8))
                turn_arrive()
                return acc_new, m_new, l_new, alpha_next, a_next

            k_next, vt = k_smem.at[slot_of(j + 1)], vt_smem.at[slot_of(j)]
            if interpreted:
                s_next = dot_t(q_smem[...], k_next)
                pv = dot_t(a if config.p_registers else a[...], vt)
                return rest(lambda: s_next, lambda: pv)

            def issue(s_ref, pv_ref):
                plgpu.wgmma(s_ref, q_smem, plgpu.transpose_ref(k_next, (1, 0)))
                plgpu.wgmma(pv_ref, a, plgpu.transpose_ref(vt, (1, 0)))
                # QKᵀ(j+1) was committed first: waiting for all but one MMA group waits for it.
                return rest(lambda: plgpu.wgmma_accumulator_load(s_ref, wait_n=1),
                            lambda: pv_ref[...])  # fmt: skip

            return pl.run_scoped(issue, plgpu.ACC(shape, jnp.float32),
                                 plgpu.ACC((WG_ROWS, d), jnp.float32))  # fmt: skip

        def overlapped_in_place(j, carry, masked: bool):
            """overlapped_step with PV(j) accumulating into the (rescaled) accumulator."""
            acc, m, l, alpha, vs_prev, a = carry
            a = operand(a)
            wait_k(j + 1)
            wait_v(j)
            vs = vs_row(j)
            acc = rescaled(acc, alpha, vs_prev, vs)
            turn_wait()
            k_next, vt = k_smem.at[slot_of(j + 1)], vt_smem.at[slot_of(j)]

            def rest(s_next):
                turn_arrive()
                turn_wait()
                p, m_new, alpha_next, l_new = softmax(scaled(s_next, j + 1), j + 1, m, l, masked)
                return m_new, l_new, alpha_next, p.astype(FP8)

            if interpreted:
                s_next = dot_t(q_smem[...], k_next)
                acc = pv_into(acc, a, vt)
                m, l, alpha, p8 = rest(s_next)
            else:

                def issue(refs):
                    acc_ref, s_ref, m_ref, l_ref, alpha_ref, p8_ref = refs
                    plgpu.wgmma(s_ref, q_smem, plgpu.transpose_ref(k_next, (1, 0)))
                    plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(vt, (1, 0)))
                    # QKᵀ(j+1) was committed first: all but one MMA group done is it.
                    outs = rest(plgpu.wgmma_accumulator_load(s_ref, wait_n=1))
                    for ref, value in zip((m_ref, l_ref, alpha_ref, p8_ref), outs, strict=True):
                        ref[...] = value

                zeros = laid_out(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
                p8_init = laid_out(jnp.zeros(shape, FP8), plgpu.Layout.WGMMA)
                acc, _, m, l, alpha, p8 = pl.run_state(issue)(
                    (plgpu.ACC.init(acc), plgpu.ACC.init(zeros), m, l, alpha, p8_init)
                )
            plgpu.barrier_arrive(v_done.at[slot_of(j)])  # PV(j) is done: P(j+1) may go
            a_next = carried(p_operand(p8))
            turn_arrive()
            return acc, m, l, alpha, vs, a_next

        def overlapped(carry):
            acc, m, l, *vs_prev = carry
            zero = jnp.array(0, jnp.int32)
            wait_k(zero)
            # Under causality block 0 is masked: the diagonal when the CTA's
            # rows are the first, else a mask that keeps every score.
            s = scaled(mma(q_smem, k_smem.at[slot_of(zero)], shape, issued=take_turn), zero)
            p, m, alpha, l = softmax(s, zero, m, l, masked=causal)
            a = carried(p_operand(p.astype(FP8)))
            carry = (acc, m, l, alpha, *vs_prev, a)
            turn_arrive()
            plain = functools.partial(overlapped_step, masked=False)
            if causal:
                # Blocks 1 .. steps - 2 unmasked, the diagonal (steps - 1) masked.
                carry = lax.fori_loop(0, lax.max(steps - 2, 0), plain, carry)
                masked = functools.partial(overlapped_step, masked=True)
                carry = lax.fori_loop(lax.max(steps - 2, 0), steps - 1, masked, carry)
            else:
                carry = lax.fori_loop(0, steps - 1, plain, carry)
            acc, m, l, alpha, *vs_prev, a = carry
            a = operand(a)
            last = steps - 1
            wait_v(last)
            if config.pv_in_place:
                vs = vs_row(last)
                acc = rescaled(acc, alpha, *vs_prev, vs)
                turn_wait()
                acc = pv_into(acc, a, vt_smem.at[slot_of(last)])
                plgpu.barrier_arrive(v_done.at[slot_of(last)])
                return acc, m, l, vs
            turn_wait()
            pv = mma(a, vt_smem.at[slot_of(last)], (WG_ROWS, d), a_value=config.p_registers)
            return accumulated(acc, pv, alpha, last), m, l

        if config.pv_in_place:  # the V scale the accumulator's units follow (none yet)
            carry = (*carry, laid_out(jnp.ones((WG_ROWS,), jnp.float32), row_layout))
        pl.when(wg == 1)(take_turn)  # warpgroup 0 goes first
        if config.overlap:
            acc, m, l, *vs_last = overlapped(carry)
        elif causal:
            carry = lax.fori_loop(0, steps - 1, functools.partial(kv_step, masked=False), carry)
            acc, m, l, *vs_last = kv_step(steps - 1, carry, masked=True)
        else:
            acc, m, l, *vs_last = lax.fori_loop(
                0, steps, functools.partial(kv_step, masked=False), carry
            )
        pl.when(wg == 0)(take_turn)  # as many turns as warpgroup 1
        with jax.named_scope("epilogue"):
            if config.pv_in_place:  # back to the values' units, exactly
                acc = acc * lax.broadcast_in_dim(*vs_last, (WG_ROWS, d), [0])
            l = l * (1 / P_SCALE)  # exactly: a power of two
            o = (acc / lax.broadcast_in_dim(l, (WG_ROWS, d), [0])).astype(o_smem.dtype)
            o_smem[...] = o
            lse_smem[...] = m + jnp.log2(l)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out_ref.at[batch, pl.ds(base, WG_ROWS), head])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, pl.ds(base, WG_ROWS)])
            plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        # 2 x 128 compute threads' and 128 memory threads' registers share the SM's 64 Ki.
        plgpu.set_max_registers(min(40, 512 - 2 * config.registers), action="decrease")

        @region("load")
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

            if config.overlap:
                # K's slot is released a step before Vᵀ's (QKᵀ(j+1) runs with
                # PV(j)): the next K need not wait for this PV.
                keys = pl.ds(j * BLOCK, BLOCK)
                pl.when(j >= stages)(lambda: plgpu.barrier_wait(k_done.at[slot]))
                plgpu.copy_gmem_to_smem(k_ref.at[batch, keys, kv_head], k_smem.at[slot],
                                        k_bars.at[slot])  # fmt: skip
                plgpu.copy_gmem_to_smem(ks_ref.at[batch, kv_head, keys], ks_smem.at[slot],
                                        ks_bars.at[slot])  # fmt: skip
                pl.when(j >= stages)(lambda: plgpu.barrier_wait(v_done.at[slot]))
                plgpu.copy_gmem_to_smem(vt_ref.at[batch, kv_head, :, keys], vt_smem.at[slot],
                                        vt_bars.at[slot])  # fmt: skip
                plgpu.copy_gmem_to_smem(vs_ref.at[batch, kv_head, j], vs_smem.at[slot],
                                        vs_bars.at[slot])  # fmt: skip
                return

            @pl.when(j >= stages)  # the slot's previous block is consumed by both warpgroups
            @region("wait_free")
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


def profiling(profile_dir: str | None, steps: int, per_step: int) -> dict:
    """``CompilerParams``' profiler fields: room for the regions a warpgroup opens in
    ``steps`` loop steps, at most ``per_step`` a step (nested ones included), and a few more."""
    if profile_dir is None:
        return {}
    return {"profile_space": per_step * steps + 32, "profile_dir": profile_dir}


def mosaic_forward(q8, k8, vt8, q_scale, k_scale, v_scale, *, causal: bool,
                   config: ForwardConfig = DEFAULT_CONFIG, interpret=None,
                   profile_dir: str | None = None):  # fmt: skip
    """The kernel: one CTA per (head, 128 query rows, batch element); see the module docstring.

    ``config``: how the kernel is built (:class:`ForwardConfig`).
    ``interpret``: a Mosaic GPU interpreter's parameters (tests), or None to compile.
    ``profile_dir``: where Mosaic GPU's on-device profiler writes a Chrome trace of
    each warpgroup's named regions (waits, QKᵀ, softmax, P's operand, PV...) in
    the SM's cycles (bench/attention_profile.py reads them), for the first call
    of a compile (the file is named when the kernel is lowered); None: no
    profiling, and the regions compile to nothing.
    """
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if not isinstance(config, ForwardConfig):
        raise TypeError(f"mosaic_forward: config must be a ForwardConfig, got {config!r}.")
    # Unmasked, every CTA has the same work: the default order.
    config = dataclasses.replace(config, longest_first=config.longest_first and causal)
    stages = config.stages
    if config.p_registers:  # Vᵀ's keys in P's register-operand order
        vt8 = permuted_keys(vt8)
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
        body = functools.partial(_kernel, causal=causal, config=config, group=heads // kv_heads,
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
        compiler_params=plgpu.CompilerParams(
            approx_math=True, **profiling(profile_dir, k8.shape[1] // BLOCK, per_step=16)
        ),
        kernel_name=KERNEL_NAME,
        interpret=interpret,
    )
    operands = (q8, k8, vt8, q_scale, k_scale, v_scale)
    return dispatch.varying_like(kernel(*operands), operands)

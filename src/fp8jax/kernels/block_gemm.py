"""The block-scaled FP8 GEMM: scales applied inside the main loop, every 128 of K.

``y[m, n] = sum_kb sa[m, kb] * sb[n, kb] * sum_{k in kb} a[m, k] * b[n, k]``
for FP8 ``a`` (B, M, K) and ``b`` (B, N, K), both with K minor, and f32
scales per row and 128-long slice of K (``sa`` (B, M, K/128), ``sb``
(B, N, K/128)). The scales vary along K, so no epilogue can apply them:
each slice's product is taken on the FP8 tensor cores, scaled and added to
an f32 accumulator, which is also DeepSeek-V3's promotion of the
accumulator to FP32 every 128 elements (docs/design.md#fine-grained-scaling).

On NVIDIA GPUs this is a Pallas Mosaic GPU kernel, warp specialized as
DeepGEMM's: a memory warpgroup feeds shared memory through TMA while two
compute warpgroups, 64 output rows each, take each slice's product on
Hopper's FP8 tensor cores (``wgmma``) into a fresh accumulator, wait for it
and add it, scaled, to their f32 sum. While one warpgroup scales, the other's
MMA runs. Where ``b`` carries a weight's 128 x 128 block scales, the tile's
columns share one scale a step, so scaling is one multiply-add an element
(docs/design.md#the-block-scaled-gemm-kernel). ``wgmma`` takes FP8 operands
of one type, so operands of two formats (a gradient in E5M2 against a
weight in E4M3, ``fp8jax.HYBRID``) go to XLA's path. How the kernel is
built (scale loads before the MMA, the tile's width by shape, turns
between the warpgroups) is a :class:`KernelConfig`, part of the jit key.
XLA's path, also the CPU's and the reference, computes the same sums: K
reshaped into its 128-wide slices, one batched FP8 dot per slice with f32
output, scaled and summed. It never dequantizes to a wider type before a GEMM. Whether the
kernel runs is :mod:`fp8jax.kernels.dispatch`'s decision.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.kernels import dispatch

BLOCK = 128  # the K slice each scale covers
# Output rows per compute warpgroup (two a CTA), and the tile width that N
# must be a multiple of: at 128 columns the running sum and the fresh
# product take 64 f32 registers a thread each. 64 x 256 (two sums and a
# product, 192) measured slower on the H200
# (docs/design.md#the-block-scaled-gemm-kernel).
TILE_M, TILE_N = 64, 128
CTA_M = 2 * TILE_M
# K slices in flight in shared memory (32 KiB each).
STAGES = 4
# Rows of output tiles walked column by column, so that tiles computed at
# the same time share the weight's tiles in L2.
GROUP_M = 8
# The SMs of an H100 or H200 SXM, for a compile without a GPU to ask
# (the kernel is persistent: one CTA an SM walks the output tiles).
HOPPER_SMS = 132
EPILOGUE_N = 64  # output columns written back per TMA store
KERNEL_NAME = "fp8jax_block_scaled_gemm"
# Output columns a warpgroup's tile may span, by scale form. A weight's block
# scale is one scalar a step only where the tile lies in one 128-wide block;
# per-row scales allow wider tiles, up to the registers two f32 tiles of 64
# rows leave: at 192 columns ptxas spills once the step's 96 scale products
# are computed before the MMA (scales_first), so 192 goes with late scales
# (docs/design.md#the-block-scaled-gemm-kernel).
TILE_NS = {"blocks": (64, 128), "rows": (64, 128, 192)}
SPILLING_TILE_N = 192  # with scales_first and per-row scales
# What a tile costs besides its columns' MMAs (A's slice, the scales, the
# waits), in columns' worth, for the shape table's estimate.
TILE_OVERHEAD_N = 32


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """How the kernel is built; no field changes the sums it computes.

    Frozen and hashable: it reaches the kernel as a static argument, so it is
    part of ``jit``'s cache key (a new value compiles a new kernel).

    Attributes:
      scales_first: each step reads its scales from shared memory before the
        MMA, so their latency overlaps the tensor cores, not the scaling.
      tile_n: output columns per tile; None chooses by shape (:func:`tile_n_for`).
      stages: K slices in flight in shared memory.
      group: rows of output tiles walked column by column (L2 reuse).
      pingpong: a compute warpgroup issues a slice's MMA only once the other
        warpgroup's last MMA has finished, so the tensor cores take them in
        turn and each warpgroup scales while the other's MMA runs. (The turns
        tried before ordered the issues only, and both MMAs still overlapped.)
    """

    scales_first: bool = True
    tile_n: int | None = None
    stages: int = STAGES
    group: int = GROUP_M
    pingpong: bool = False

    def __post_init__(self):
        if self.tile_n is not None and self.tile_n not in TILE_NS["rows"]:
            raise ValueError(
                f"KernelConfig(tile_n=...) must be None or one of {TILE_NS['rows']}, "
                f"got {self.tile_n}."
            )
        if self.scales_first and self.tile_n == SPILLING_TILE_N:
            raise ValueError(
                f"KernelConfig(tile_n={SPILLING_TILE_N}) spills registers with "
                "scales_first=True; pass scales_first=False or a narrower tile_n."
            )
        if not 2 <= self.stages <= 6:
            raise ValueError(f"KernelConfig(stages=...) must be in [2, 6], got {self.stages}.")
        if self.group < 1:
            raise ValueError(f"KernelConfig(group=...) must be >= 1, got {self.group}.")


DEFAULT_CONFIG = KernelConfig()


def tile_n_for(m: int, n: int, b_blocks: bool, sms: int = HOPPER_SMS, batch: int = 1, *,
               scales_first: bool = True) -> int:  # fmt: skip
    """The tile width that finishes ``(batch, m, n)`` soonest on ``sms`` SMs (DeepGEMM's table).

    The kernel is persistent, so its time is about the waves of tiles times a
    tile's time; a tile's time grows with its columns plus a fixed part
    (:data:`TILE_OVERHEAD_N`). Ties go to the wider tile (fewer A reads).
    Widths that spill with ``scales_first`` are left out.
    """
    widths = [w for w in TILE_NS["blocks" if b_blocks else "rows"]
              if n % w == 0 and not (scales_first and w == SPILLING_TILE_N)]  # fmt: skip
    if not widths:
        raise ValueError(f"no tile width of {TILE_NS} divides n={n}; the kernel needs n % 64 == 0.")

    def cost(width):
        tiles = batch * (m // CTA_M) * (n // width)
        return -(-tiles // sms) * (width + TILE_OVERHEAD_N), -width

    return min(widths, key=cost)


def fits(a_shape, b_shape, a_dtype, b_dtype) -> bool:
    """Whether the kernel takes these operands: whole output tiles, K in slices, one FP8 type."""
    (_, m, k), (_, n, _) = a_shape, b_shape
    return a_dtype == b_dtype and m % CTA_M == 0 and n % TILE_N == 0 and k % BLOCK == 0


def block_scaled_matmul(a, b, a_scale_inv, b_scale_inv, out_dtype, *, b_blocks: bool = False,
                        kernel: KernelConfig = DEFAULT_CONFIG) -> jax.Array:  # fmt: skip
    """``a (B, M, K) . b (B, N, K)^T`` with per-(row, K slice) scales, in ``out_dtype``.

    Args:
      a, b: FP8 operands, K a multiple of 128.
      a_scale_inv: f32 (B, M, K // 128); b_scale_inv: f32 (B, N, K // 128), or
        with ``b_blocks`` one per 128 x 128 block of ``b``: (B, N // 128, K // 128).
      out_dtype: the result's dtype; the accumulator is f32.
      b_blocks: ``b_scale_inv`` holds block scales (a weight's). The kernel then
        scales each step's product by one scalar of them: its tile of N is one
        block (docs/design.md#the-block-scaled-gemm-kernel).
    """
    out_dtype = jnp.dtype(out_dtype)
    placement = dispatch.decide(
        lambda shards: shards == 1 and fits(a.shape, b.shape, a.dtype, b.dtype),
        rows_are_tokens=False,
    )
    xla = functools.partial(xla_block_matmul, out_dtype=out_dtype, b_blocks=b_blocks)
    if not placement.kernel:
        return xla(a, b, a_scale_inv, b_scale_inv)
    pallas = functools.partial(mosaic_block_matmul, out_dtype=out_dtype, b_blocks=b_blocks,
                               config=kernel)  # fmt: skip
    return dispatch.on_each_device(pallas, xla, (a, b, a_scale_inv, b_scale_inv), 0, ("rows",))


def expand_blocks(block_scale_inv: jax.Array, block: int) -> jax.Array:
    """Block scales (B, R // block, C // block) as one per row and tile: (B, R, C // block)."""
    return jnp.repeat(block_scale_inv, block, axis=1)


def xla_block_matmul(a, b, a_scale_inv, b_scale_inv, *, out_dtype, b_blocks=False,
                     block=BLOCK) -> jax.Array:  # fmt: skip
    """The same sums in XLA: one FP8 dot per ``block``-wide slice of K (f32 out), scaled, summed.

    ``block``: the slice each scale covers, 128 here; MXFP8's 32 (:mod:`fp8jax.ops.fine_grained`).
    """
    if b_blocks:
        b_scale_inv = expand_blocks(b_scale_inv, block)
    batch, m, k = a.shape
    n, slices = b.shape[1], k // block
    a4 = a.reshape(batch, m, slices, block)
    b4 = b.reshape(batch, n, slices, block)
    # (B, slices, M, N): each slice's exact FP8 product, accumulated in f32.
    partial = lax.dot_general(a4, b4, (((3,), (3,)), ((0, 2), (0, 2))),
                              preferred_element_type=jnp.float32)  # fmt: skip
    sa = jnp.swapaxes(a_scale_inv, 1, 2)[..., :, None]  # (B, slices, M, 1)
    sb = jnp.swapaxes(b_scale_inv, 1, 2)[..., None, :]  # (B, slices, 1, N)
    return jnp.sum(partial * sa * sb, axis=1).astype(out_dtype)


def sm_count() -> int:
    """The SMs of this process's GPU, or :data:`HOPPER_SMS` where it compiles without one."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:  # no GPU backend: a deviceless compile or the CPU
        return HOPPER_SMS
    return getattr(gpus[0], "core_count", None) or HOPPER_SMS


def _tile_transforms(plgpu, columns: int, dtype) -> tuple:
    """Shared-memory tiling and swizzle for rows of ``columns`` elements of ``dtype``."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(columns * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _kernel(a_gmem, b_gmem, sa_gmem, sb_gmem, out_gmem, *done, config: KernelConfig,
            tile_n: int, b_scalar: bool, interpret: bool):  # fmt: skip
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    batch, m, k = a_gmem.shape
    n = b_gmem.shape[1]
    m_tiles, n_tiles, slices = m // CTA_M, n // tile_n, k // BLOCK
    operand = _tile_transforms(plgpu, BLOCK, a_gmem.dtype)
    shape = (TILE_M, tile_n)

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(slices,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((CTA_M, BLOCK), lambda s: (0, s), transforms=operand),
                plgpu.BlockSpec((tile_n, BLOCK), lambda s: (0, s), transforms=operand),
                plgpu.BlockSpec((1, CTA_M), lambda s: (s, 0)),  # a's scales, this slice
                plgpu.BlockSpec((1, tile_n), lambda s: (s, 0)),  # b's
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=config.stages,
            compute_context=context,
        )

    def ignore(*_, **__):
        return None

    operands = (a_gmem.at[0], b_gmem.at[0], sa_gmem.at[0], sb_gmem.at[0])
    out_transforms = _tile_transforms(plgpu, EPILOGUE_N, out_gmem.dtype)

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(ignore, ignore).get_allocations(*operands),
        # Per warpgroup, two slots: one is written while the other is stored.
        out_smem=plgpu.SMEM((2, 2, TILE_M, EPILOGUE_N), out_gmem.dtype, transforms=out_transforms),
        collective_axes="wg",
    )
    def _scope(allocations, out_smem):
        wg = lax.axis_index("wg")
        rows = pl.ds(wg * TILE_M, TILE_M)  # this warpgroup's rows of the CTA's tile

        def await_turn():
            # done[w]: warpgroup w's last MMA has finished (pingpong).
            pl.when(wg == 0)(lambda: plgpu.barrier_wait(done[1]))
            pl.when(wg == 1)(lambda: plgpu.barrier_wait(done[0]))

        def end_turn():
            pl.when(wg == 0)(lambda: plgpu.barrier_arrive(done[0]))
            pl.when(wg == 1)(lambda: plgpu.barrier_arrive(done[1]))

        if config.pingpong:  # warpgroup 0 goes first
            pl.when(wg == 1)(lambda: plgpu.barrier_arrive(done[1]))

        @plgpu.nd_loop((batch * m_tiles * n_tiles,), collective_axes="sm")
        def _tile(info):
            (index,) = info.index
            z, index = index // (m_tiles * n_tiles), index % (m_tiles * n_tiles)
            mi, ni = plgpu.planar_snake(index, (m_tiles, n_tiles), 1, config.group)
            m_slice, n_slice = pl.ds(mi * CTA_M, CTA_M), pl.ds(ni * tile_n, tile_n)

            def scale(sa_smem, sb_smem):
                # sa * sb once a step, then one multiply-add an element into the total.
                sa = sa_smem[0, rows]
                if b_scalar:  # the tile's columns lie in one block of b: one scale
                    return lax.broadcast_in_dim(sa * sb_smem[0, 0], shape, [0])
                return (lax.broadcast_in_dim(sa, shape, [0])
                        * lax.broadcast_in_dim(sb_smem[0, :], shape, [1]))  # fmt: skip

            def product(a_smem, b_smem):
                if interpret:
                    # The CPU interpreter's wgmma reads no transposed operand; the
                    # same exact product of the slice, in f32, as a dot.
                    if config.pingpong:
                        await_turn()
                    out = lax.dot_general(a_smem[rows, :], b_smem[...], (((1,), (1,)), ((), ())),
                                          preferred_element_type=jnp.float32)  # fmt: skip
                    if config.pingpong:
                        end_turn()
                    return out

                def mma(fresh):
                    # ptxas compiles the first MMA of a fresh accumulator with its
                    # input off (scale-d 0): the zeroing costs nothing.
                    plgpu.wgmma(fresh, a_smem.at[rows], b_smem.transpose((1, 0)))
                    return fresh[...]  # waits for the MMA

                if config.pingpong:
                    await_turn()
                out = pl.run_scoped(mma, plgpu.ACC(shape, jnp.float32))
                if config.pingpong:
                    end_turn()
                return out

            def step(_, a_smem, b_smem, sa_smem, sb_smem, total):
                if config.scales_first:  # the loads' latency hides behind the MMA
                    slice_scale = scale(sa_smem, sb_smem)
                    return total + product(a_smem, b_smem) * slice_scale
                slice_product = product(a_smem, b_smem)
                return total + slice_product * scale(sa_smem, sb_smem)

            def context(run):
                out = run(jnp.zeros(shape, jnp.float32)).astype(out_gmem.dtype)
                tile = out_gmem.at[z, m_slice, n_slice].at[rows]
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                for part in range(tile_n // EPILOGUE_N):
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                    columns = slice(part * EPILOGUE_N, (part + 1) * EPILOGUE_N)
                    out_smem[wg, part % 2] = out[:, columns]
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg, part % 2], tile.at[:, columns])

            pipeline(step, context)(
                a_gmem.at[z, m_slice], b_gmem.at[z, n_slice],
                sa_gmem.at[z, :, m_slice], sb_gmem.at[z, :, n_slice],
                allocations=allocations,
            )  # fmt: skip

        if config.pingpong:  # warpgroup 1's last turn, so that every arrival is awaited
            pl.when(wg == 0)(lambda: plgpu.barrier_wait(done[1]))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _interpret_params():
    """Mosaic GPU's interpret-mode parameters (private in jax 0.10 and 0.11)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def mosaic_block_matmul(a, b, a_scale_inv, b_scale_inv, *, out_dtype, b_blocks=False,
                        config: KernelConfig = DEFAULT_CONFIG, sms=None,
                        interpret: bool = False):  # fmt: skip
    """The kernel: one CTA an SM, walking the (batch, 128 x ``tile_n``) output tiles.

    The scales go in transposed, (B, K // 128, rows), so that each step loads
    one contiguous row of them. ``b_blocks``: ``b_scale_inv`` is (B, N // 128,
    K // 128), repeated over each block's rows (a column of a tile reads the
    first). ``config``: how the kernel is built (:class:`KernelConfig`).
    ``sms``: CTAs launched; None: :func:`sm_count`. ``interpret``: Mosaic GPU's
    interpret mode on the CPU (tests), the MMA taken as a dot.
    """
    import jax.experimental.pallas.mosaic_gpu as plgpu

    batch, m, _ = a.shape
    n = b.shape[1]
    sms = sms or sm_count()
    tile_n = config.tile_n or tile_n_for(m, n, b_blocks, sms, batch,
                                         scales_first=config.scales_first)  # fmt: skip
    if n % tile_n or (b_blocks and BLOCK % tile_n):
        raise ValueError(
            f"KernelConfig(tile_n={tile_n}) must divide n={n}"
            + (f" and the weight's block, {BLOCK}" if b_blocks else "")
            + "; leave tile_n=None to choose by shape."
        )
    if b_blocks:
        b_scale_inv = expand_blocks(b_scale_inv, BLOCK)
    kernel = plgpu.kernel(
        functools.partial(
            _kernel, config=config, tile_n=tile_n, b_scalar=b_blocks, interpret=interpret
        ),
        out_type=jax.ShapeDtypeStruct((batch, m, n), out_dtype),
        # pingpong's two "MMA done" barriers, one arrival (a warpgroup) each.
        scratch_types=[plgpu.Barrier(num_arrivals=1)] * (2 if config.pingpong else 0),
        grid=(sms,),
        grid_names=("sm",),
        num_threads=3,  # two compute warpgroups and the memory one
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        kernel_name=KERNEL_NAME,
        **({"interpret": _interpret_params()} if interpret else {}),
    )
    scales = (jnp.swapaxes(a_scale_inv, 1, 2).astype(jnp.float32),
              jnp.swapaxes(b_scale_inv, 1, 2).astype(jnp.float32))  # fmt: skip
    return dispatch.varying_like(kernel(a, b, *scales), (a, b, *scales))

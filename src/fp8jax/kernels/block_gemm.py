"""The block-scaled FP8 GEMM: scales applied inside the main loop, every 128 of K.

``y[m, n] = sum_kb sa[m, kb] * sb[n, kb] * sum_{k in kb} a[m, k] * b[n, k]``
for FP8 ``a`` (B, M, K) and ``b`` (B, N, K), both with K minor, and f32
scales per row and 128-long slice of K (``sa`` (B, M, K/128), ``sb``
(B, N, K/128)). The scales vary along K, so no epilogue can apply them:
each slice's product is taken on the FP8 tensor cores, scaled and added to
an f32 accumulator, which is also DeepSeek-V3's promotion of the
accumulator to FP32 every 128 elements (docs/design.md#fine-grained-scaling).

On NVIDIA GPUs this is a Pallas Triton kernel: one program per output tile
loops over K in 128-wide steps, each step's dot on Hopper's FP8 tensor cores
(:mod:`fp8jax.kernels.triton_fp8_dot`). Triton's ``dot`` takes FP8 operands (E4M3
or E5M2, both of one type), so operands of two formats (a gradient in E5M2
against a weight in E4M3, ``fp8jax.HYBRID``) go to XLA's path. XLA's path,
also the CPU's and the reference, computes the same sums: K reshaped into
its 128-wide slices, one batched FP8 dot per slice with f32 output, scaled
and summed. It never dequantizes to a wider type before a GEMM. Whether the
kernel runs is :mod:`fp8jax.kernels.dispatch`'s decision.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.fine_quantize import expand_blocks
from fp8jax.kernels import dispatch, triton_fp8_dot

BLOCK = 128  # the K slice each scale covers
# Output tile rows x columns per program, warps and pipeline stages. Each step
# waits for its MMA before scaling the product, so the tensor cores idle unless
# other programs on the SM fill in: 64 x 128 tiles with 4 warps leave room for
# several per SM and ran 1.9x 128 x 128 with 8 warps at 8192^3 on an H200
# (docs/design.md#the-block-scaled-gemm-kernel).
TILE_M, TILE_N, WARPS, STAGES = 64, 128, 4, 3
# Rows of output tiles whose programs run column by column, so that programs
# running together share b's tiles in L2: 485 against 475 TFLOP/s at 8192^3
# on an H200 (docs/design.md#the-block-scaled-gemm-kernel).
GROUP_M = 8
KERNEL_NAME = "fp8jax_block_scaled_gemm"


def fits(a_shape, b_shape, a_dtype, b_dtype, tile=(TILE_M, TILE_N)) -> bool:
    """Whether the kernel takes these operands: whole output tiles, K in slices, one FP8 type."""
    (_, m, k), (_, n, _) = a_shape, b_shape
    return a_dtype == b_dtype and m % tile[0] == 0 and n % tile[1] == 0 and k % BLOCK == 0


def block_scaled_matmul(a, b, a_scale_inv, b_scale_inv, out_dtype, *,
                        b_blocks: bool = False) -> jax.Array:  # fmt: skip
    """``a (B, M, K) . b (B, N, K)^T`` with per-(row, K slice) scales, in ``out_dtype``.

    Args:
      a, b: FP8 operands, K a multiple of 128.
      a_scale_inv: f32 (B, M, K // 128); b_scale_inv: f32 (B, N, K // 128), or
        with ``b_blocks`` one per 128 x 128 block of ``b``: (B, N // 128, K // 128).
      out_dtype: the result's dtype; the accumulator is f32.
      b_blocks: ``b_scale_inv`` holds block scales (a weight's). The kernel then
        scales each step's product by one scalar of them where its tile of N is
        one block (docs/design.md#the-block-scaled-gemm-kernel).
    """
    out_dtype = jnp.dtype(out_dtype)
    where = dispatch.placement(
        lambda shards: shards == 1 and fits(a.shape, b.shape, a.dtype, b.dtype),
        rows_are_tokens=False,
    )
    xla = functools.partial(xla_block_matmul, out_dtype=out_dtype, b_blocks=b_blocks)
    if where is None:
        return xla(a, b, a_scale_inv, b_scale_inv)
    pallas = functools.partial(pallas_block_matmul, out_dtype=out_dtype, b_blocks=b_blocks)
    return dispatch.on_each_device(pallas, xla, (a, b, a_scale_inv, b_scale_inv), 0, ("rows",))


def xla_block_matmul(a, b, a_scale_inv, b_scale_inv, *, out_dtype, b_blocks=False) -> jax.Array:
    """The same sums in XLA: one FP8 dot per 128-wide slice of K (f32 out), scaled, summed."""
    if b_blocks:
        b_scale_inv = expand_blocks(b_scale_inv, BLOCK)
    batch, m, k = a.shape
    n, slices = b.shape[1], k // BLOCK
    a4 = a.reshape(batch, m, slices, BLOCK)
    b4 = b.reshape(batch, n, slices, BLOCK)
    # (B, slices, M, N): each slice's exact FP8 product, accumulated in f32.
    partial = lax.dot_general(a4, b4, (((3,), (3,)), ((0, 2), (0, 2))),
                              preferred_element_type=jnp.float32)  # fmt: skip
    sa = jnp.swapaxes(a_scale_inv, 1, 2)[..., :, None]  # (B, slices, M, 1)
    sb = jnp.swapaxes(b_scale_inv, 1, 2)[..., None, :]  # (B, slices, 1, N)
    return jnp.sum(partial * sa * sb, axis=1).astype(out_dtype)


def _kernel(a_ref, b_ref, sa_ref, sb_ref, o_ref, *, slices: int, b_block: bool):
    from jax.experimental import pallas as pl

    def step(kb, acc):
        a = a_ref[:, pl.ds(kb * BLOCK, BLOCK)]
        b = b_ref[:, pl.ds(kb * BLOCK, BLOCK)]
        product = lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                  preferred_element_type=jnp.float32)  # fmt: skip
        if b_block:  # the tile's one block of b: one scale per row of the product
            return acc + product * (sa_ref[kb, :] * sb_ref[kb, 0])[:, None]
        return acc + product * sa_ref[kb, :][:, None] * sb_ref[kb, :][None, :]

    acc = lax.fori_loop(0, slices, step, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _tile_of(program, tiles_m: int, tiles_n: int, group: int):
    """The (row, column) output tile of a program: ``group`` rows of tiles at a time.

    The programs of a group walk down its rows of tiles column by column, so
    that those running together share the weight's tiles in L2; ``group`` 0
    is the plain row-major order.
    """
    if not group:
        return program // tiles_n, program % tiles_n
    width = group * tiles_n
    first = (program // width) * group
    rows = jnp.minimum(tiles_m - first, group)  # the last group may be shorter
    return first + (program % width) % rows, (program % width) // rows


def pallas_block_matmul(a, b, a_scale_inv, b_scale_inv, *, out_dtype, interpret=False,
                        tile=(TILE_M, TILE_N), warps=WARPS, stages=STAGES,
                        group=None, b_blocks=False):  # fmt: skip
    """The kernel: a program per (batch, output tile), looping over K in 128-wide slices.

    The scales go in transposed, (B, K // 128, rows), so that each step reads
    one contiguous row of them. ``group``: rows of output tiles whose programs
    run column by column (:func:`_tile_of`); None: :data:`GROUP_M`. ``b_blocks``:
    ``b_scale_inv`` is (B, N // 128, K // 128), applied as a scalar a step where
    the tile of N is one block, else repeated per row.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pallas_triton

    triton_fp8_dot.install()  # FP8 tensor cores, not f16 ones
    batch, m, k = a.shape
    n, slices = b.shape[1], k // BLOCK
    tm, tn = tile
    tiles_m, tiles_n = m // tm, n // tn
    group = GROUP_M if group is None else group
    b_block = b_blocks and tn == BLOCK
    if b_blocks and not b_block:
        b_scale_inv = expand_blocks(b_scale_inv, BLOCK)
    # b's scales, transposed: (B, K // 128, N // 128) blocks or (B, K // 128, N) rows.
    sb_block = 1 if b_block else tn
    params = {} if interpret else {
        "compiler_params": pallas_triton.CompilerParams(num_warps=warps, num_stages=stages)
    }  # fmt: skip

    def spec(block, index):
        def at(z, program):
            return index(z, *_tile_of(program, tiles_m, tiles_n, group))

        return pl.BlockSpec(block, at)

    return dispatch.pallas_call(
        functools.partial(_kernel, slices=slices, b_block=b_block),
        grid=(batch, tiles_m * tiles_n),
        in_specs=[
            spec((None, tm, k), lambda z, i, j: (z, i, 0)),
            spec((None, tn, k), lambda z, i, j: (z, j, 0)),
            spec((None, slices, tm), lambda z, i, j: (z, 0, i)),
            spec((None, slices, sb_block), lambda z, i, j: (z, 0, j)),
        ],
        out_specs=spec((None, tm, tn), lambda z, i, j: (z, i, j)),
        out_shape=jax.ShapeDtypeStruct((batch, m, n), out_dtype),
        interpret=interpret,
        name=KERNEL_NAME,
        **params,
    )(a, b, jnp.swapaxes(a_scale_inv, 1, 2).astype(jnp.float32),
      jnp.swapaxes(b_scale_inv, 1, 2).astype(jnp.float32))  # fmt: skip

"""Variants of the block-scaled GEMM kernel at 8192^3 on the GPU: what its speed depends on.

Against :func:`fp8jax.kernels.block_gemm.pallas_block_matmul` (the library's), each
variant changes one thing: program order grouped along M (L2 reuse of the
weight's tiles), the weight's 128x128 block scale applied as one scalar per
tile (one multiply-add per accumulator element and step instead of three
operations), both, and more tile shapes.

    PYTHONPATH=src python bench/block_kernel_variants.py --heat 0.5 --out variants.json
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
from harness import add_compile_cache_argument, add_heat_argument, dump, measure, start
from jax import lax
from scaling import operands

from fp8jax import E4M3
from fp8jax.fine_quantize import quantize_blocks
from fp8jax.kernels import block_gemm, triton_fp8_dot

BF16, BLOCK = jnp.bfloat16, 128


def _kernel(a_ref, b_ref, sa_ref, sb_ref, o_ref, *, slices, tile_scale, order):
    from jax.experimental import pallas as pl

    def product(kb):
        a = a_ref[:, pl.ds(kb * BLOCK, BLOCK)]
        b = b_ref[:, pl.ds(kb * BLOCK, BLOCK)]
        return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    def scales(kb):
        if tile_scale:
            return (sa_ref[kb, :] * sb_ref[kb, 0])[:, None]
        return sa_ref[kb, :][:, None] * sb_ref[kb, :][None, :]

    zeros = jnp.zeros(o_ref.shape, jnp.float32)
    if order == "ahead":
        # The next slice's MMA is issued before the previous product is
        # scaled, so that the tensor cores need not wait for the CUDA cores.
        def step(kb, carry):
            acc, previous = carry
            p = product(kb)
            return acc + previous * scales(kb - 1), p

        acc, last = lax.fori_loop(1, slices, step, (zeros, product(0)))
        acc = acc + last * scales(slices - 1)
    elif order == "pairs":
        # Two independent MMAs in flight, then both scaled.
        def step(i, acc):
            p0, p1 = product(2 * i), product(2 * i + 1)
            return acc + p0 * scales(2 * i) + p1 * scales(2 * i + 1)

        acc = lax.fori_loop(0, slices // 2, step, zeros)
    else:

        def step(kb, acc):
            return acc + product(kb) * scales(kb)

        acc = lax.fori_loop(0, slices, step, zeros)
    o_ref[...] = acc.astype(o_ref.dtype)


def variant(a, b, sa, sb_blocks, *, tile=(128, 128), warps=8, stages=3, group=0,
            tile_scale=False, order="plain", interpret=False):  # fmt: skip
    """``sb_blocks``: the weight's block scales (B, N/128, K/128)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pallas_triton

    triton_fp8_dot.install()  # as the library's kernel: FP8 wgmma
    _, m, k = a.shape
    n, slices = b.shape[1], k // BLOCK
    tm, tn = tile
    gm, gn = m // tm, n // tn
    if tile_scale:
        assert tn == BLOCK
        sb = jnp.swapaxes(sb_blocks, 1, 2)  # (B, slices, N / 128)
        sb_spec = lambda z, i, j: (z, 0, j)  # noqa: E731
        sb_block = (None, slices, 1)
    else:
        sb = jnp.swapaxes(jnp.repeat(sb_blocks, BLOCK, axis=1), 1, 2)
        sb_spec = lambda z, i, j: (z, 0, j)  # noqa: E731
        sb_block = (None, slices, tn)

    def where(z, t):
        return z, *block_gemm._tile_of(t, gm, gn, group)  # the library's program order

    def spec(block, index):
        return pl.BlockSpec(block, lambda z, t: index(*where(z, t)))

    return pl.pallas_call(
        functools.partial(_kernel, slices=slices, tile_scale=tile_scale, order=order),
        grid=(a.shape[0], gm * gn),
        in_specs=[
            spec((None, tm, k), lambda z, i, j: (z, i, 0)),
            spec((None, tn, k), lambda z, i, j: (z, j, 0)),
            spec((None, slices, tm), lambda z, i, j: (z, 0, i)),
            spec(sb_block, sb_spec),
        ],
        out_specs=spec((None, tm, tn), lambda z, i, j: (z, i, j)),
        out_shape=jax.ShapeDtypeStruct((a.shape[0], m, n), BF16),
        interpret=interpret,
        **(
            {}
            if interpret
            else {
                "compiler_params": pallas_triton.CompilerParams(num_warps=warps, num_stages=stages)
            }
        ),
    )(a, b, jnp.swapaxes(sa, 1, 2), sb)


_BEST = {"tile_scale": True, "group": 8, "tile": (64, 128), "warps": 4, "stages": 4}
VARIANTS = {
    "flat_64x128_w4_s3": {"tile": (64, 128), "warps": 4},
    "tile_scale_group8_64x128_w4_s4": _BEST,
    # One change at a time from the library's kernel (64 x 128, 4 warps, 3 stages).
    "flat_64x128_w4_s4": {"tile": (64, 128), "warps": 4, "stages": 4},
    "group8_64x128_w4_s3": {"tile": (64, 128), "warps": 4, "group": 8},
    "group8_64x128_w4_s4": {"tile": (64, 128), "warps": 4, "stages": 4, "group": 8},
    "tile_scale_64x128_w4_s3": {"tile": (64, 128), "warps": 4, "tile_scale": True},
    # The MMA of the next 128 of K issued before the last one's product is scaled.
    "ahead_64x128_w4_s3": {"tile": (64, 128), "warps": 4, "order": "ahead"},
    "ahead_tile_scale_group8_64x128_w4_s4": _BEST | {"order": "ahead"},
    "ahead_tile_scale_group8_128x128_w8_s3": _BEST
    | {"order": "ahead", "tile": (128, 128), "warps": 8, "stages": 3},
    "ahead_tile_scale_group8_128x128_w4_s3": _BEST
    | {"order": "ahead", "tile": (128, 128), "stages": 3},
    "pairs_64x128_w4_s3": {"tile": (64, 128), "warps": 4, "order": "pairs"},
    "pairs_tile_scale_group8_64x128_w4_s4": _BEST | {"order": "pairs"},
    "pairs_tile_scale_group8_128x128_w8_s3": _BEST
    | {"order": "pairs", "tile": (128, 128), "warps": 8, "stages": 3},
}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", default=None)
    add_compile_cache_argument(parser)
    add_heat_argument(parser)
    args = parser.parse_args()
    results = {"environment": start(args), "rows": []}
    s = args.size
    _x, w, (qa, qb, sa, _) = operands(s, s, s)
    _, sb_blocks = quantize_blocks(w, E4M3, BLOCK)
    reference = None
    for name in args.variants:
        options = VARIANTS[name]
        fn = jax.jit(functools.partial(variant, **options))
        try:
            y = fn(qa, qb, sa, sb_blocks).astype(jnp.float32)
            reference = y if reference is None else reference
            diff = float(jnp.max(jnp.abs(y - reference)) / jnp.max(jnp.abs(reference)))
            row = measure(name, fn, qa, qb, sa, sb_blocks, iters=args.iters)
        except Exception as e:
            print(f"  {name}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            results["rows"].append({"name": name, "error": f"{type(e).__name__}: {e}"[:400]})
            continue
        row.pop("report", None)
        tflops = 2 * s**3 / row["median_ms"] / 1e9
        print(f"    {name}: {tflops:.0f} TFLOP/s, max diff vs first {diff:.2e}", flush=True)
        results["rows"].append(row | {"tflops": tflops, "max_rel_diff_vs_first": diff})
    if args.out:
        dump(args.out, results)


if __name__ == "__main__":
    main()
